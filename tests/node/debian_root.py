"""A pristine Debian 12 root built with debootstrap once and cached between test runs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.build_cache import TEST_CACHE

CACHE_DIR = TEST_CACHE / "debian12-root"
SUITE = "bookworm"
# What a cloud image of Ubuntu or Debian already carries, so the deploy finds its prerequisites
# installed and the stand-in repository only has to provide NVIDIA's and Docker's packages.
INCLUDE = ("ca-certificates", "curl", "python3", "python3-venv", "nftables", "iproute2")


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian archive this machine's apt already uses (deb822 or one-line sources)."""
    files = [*sorted(apt_dir.glob("sources.list.d/*.sources")), apt_dir / "sources.list"]
    files += sorted(apt_dir.glob("sources.list.d/*.list"))
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text()
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(
                    (key.strip().lower(), value.strip())
                    for key, _, value in (
                        line.partition(":") for line in stanza.splitlines() if ":" in line
                    )
                    if not key.startswith("#")
                )
                if SUITE in fields.get("suites", "").split():
                    return str(fields["uris"].split()[0])
        else:
            for line in text.splitlines():
                parts = re.sub(r"\[[^]]*\]", "", line).split()
                if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE:
                    return parts[1]
    raise RuntimeError(f"no apt source for Debian {SUITE} on this machine to debootstrap from")


def ensure_root(cache_dir: Path = CACHE_DIR) -> Path:
    """The cached root, built first if absent; it is only ever copied, never deployed into."""
    if (cache_dir / "etc/debian_version").is_file():
        return cache_dir
    partial = cache_dir.with_name(cache_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(INCLUDE)}",
            SUITE,
            str(partial),
            debian_mirror(),
        ],
        check=True,
        capture_output=True,
        timeout=1200,
    )
    partial.rename(cache_dir)
    return cache_dir
