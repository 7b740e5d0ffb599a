"""Debian packages a deploy installs, offered to a VM that has no way out: a local repository.

The VM's own package status decides what it lacks: apt on this machine resolves the install
against that status (a simulation, nothing is installed here), downloads exactly those packages
from the Debian archive this machine uses (cached between runs), and they go into the VM as a
flat repository, its only apt source. The deploy's own `apt-get update` and `apt-get install`
then run unchanged.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.build_cache import TEST_CACHE
from tests.vm.bed import Vm
from tests.vm.standin_vm import send_folder

CACHE_DIR = TEST_CACHE / "debs"
REPO_IN_VM = "/srv/denv-debs"
_SOURCES = "/etc/apt/sources.list.d/denv-debs.list"


def _wanted(status: Path, packages: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, version) of every package `apt-get install` would add to a system of `status`."""
    argv = ["apt-get", "-s", "-o", f"Dir::State::status={status}", "install"]
    argv += ["--no-install-recommends", *packages]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120)
    return re.findall(r"^Inst (\S+) \((\S+) ", done.stdout, re.M)


def _fetched(name: str, version: str) -> Path:
    """The package's .deb from the cache, downloaded first if absent."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # apt-get download names a file name_version_arch.deb, an epoch's ':' written as %3a.
    pattern = f"{name}_{version.replace(':', '%3a')}_*.deb"
    found = sorted(CACHE_DIR.glob(pattern))
    if not found:
        subprocess.run(
            ["apt-get", "download", f"{name}={version}"],
            cwd=CACHE_DIR,
            check=True,
            capture_output=True,
            timeout=300,
        )
        found = sorted(CACHE_DIR.glob(pattern))
    if not found:
        raise RuntimeError(f"apt-get download {name}={version}: no {pattern} in {CACHE_DIR}")
    return found[0]


def offer_packages(vm: Vm, workdir: Path, *packages: str) -> list[str]:
    """Make `packages` installable in the VM from a repository of its own; their names with what
    they pull in. The VM's Debian sources are removed: nothing is fetched from outside."""
    status = workdir / f"{vm.name}.dpkg-status"
    status.write_text(vm.ssh("cat /var/lib/dpkg/status"))
    wanted = _wanted(status, packages)
    repo = workdir / f"{vm.name}-debs"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir()
    for name, version in wanted:
        deb = _fetched(name, version)
        shutil.copy(deb, repo / deb.name)
    index = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", "."], cwd=repo, check=True, capture_output=True
    ).stdout
    (repo / "Packages").write_bytes(index)
    send_folder(vm, repo, REPO_IN_VM)
    vm.ssh(
        "rm -f /etc/apt/sources.list /etc/apt/sources.list.d/debian.sources"
        f" && echo 'deb [trusted=yes] file:{REPO_IN_VM} ./' > {_SOURCES}"
    )
    return [name for name, _ in wanted]
