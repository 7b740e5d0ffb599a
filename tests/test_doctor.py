"""`denv doctor` runs the real tools and says what to install when one is missing or too old."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from denv_iac.cli.doctor import (
    SYSTEM_PACKAGES,
    check_haproxy,
    check_test_packages,
    haproxy_version,
    listed_packages,
    needed_by,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("HAProxy version 2.6.12-1+deb12u4 2026/10/17 - https://haproxy.org/", (2, 6, 12)),
        ("HAProxy version 3.0.5-1 2024/09/19", (3, 0, 5)),
        ("HA-Proxy version 1.8.19-1+deb10u3 2020/08/01", (1, 8, 19)),
        ("HAProxy version 2.9-dev4", (2, 9, 0)),
        ("command not found", None),
    ],
)
def test_haproxy_version(text: str, version: tuple[int, int, int] | None) -> None:
    assert haproxy_version(text) == version


def test_the_installed_haproxy_is_found_with_its_version() -> None:
    printed = subprocess.run(["haproxy", "-v"], capture_output=True, text=True, check=True).stdout
    finding = check_haproxy()
    assert finding.ok, finding.detail
    version = haproxy_version(printed)
    assert version is not None and finding.detail == f"HAProxy {'.'.join(map(str, version))}"


def test_a_local_stack_needs_haproxy_and_any_other_the_pulumi_cli() -> None:
    assert needed_by({"local"}) == {"haproxy"}
    assert needed_by({"local", "aws"}) == {"pulumi"}
    assert needed_by({"joined"}) == {"pulumi"}


def _doctor(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "denv_iac", "doctor", *args],
        cwd=ROOT,
        env={**os.environ, "PATH": str(path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_old_haproxy_is_named_with_the_fix_and_fails_a_local_stack(tmp_path: Path) -> None:
    haproxy = tmp_path / "haproxy"
    haproxy.write_text("#!/bin/sh\necho 'HAProxy version 2.4.22-0ubuntu0.22.04.3 2023/08/14'\n")
    haproxy.chmod(0o755)
    result = _doctor(tmp_path, "--stack", "local")
    assert result.returncode == 1, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if " haproxy " in line]
    assert line.startswith("MISSING")
    assert "HAProxy 2.4.22 is too old; install HAProxy 2.6 or newer" in line
    assert "stack local needs it" in line


def test_missing_tools_each_say_what_to_install(tmp_path: Path) -> None:
    result = _doctor(tmp_path)
    assert result.returncode == 0, result.stderr  # no stack chosen: nothing is required
    lines = {line.split()[1]: line for line in result.stdout.splitlines()}
    assert set(lines) == {"haproxy", "pulumi", "uv", "namespaces", "qemu", "packages"}
    assert "sudo apt-get install haproxy" in lines["haproxy"]
    assert "python3 -m pip install uv" in lines["uv"]
    assert "apt-get install qemu-system-x86" in lines["qemu"]
    assert "install the Pulumi CLI" in lines["pulumi"]
    assert "no dpkg-query, not Debian? install the equivalents of haproxy," in lines["packages"]
    assert all(line.startswith("missing") for line in lines.values())


def test_an_unknown_stack_is_one_line_naming_the_option() -> None:
    result = _doctor(Path(os.environ["PATH"].split(os.pathsep)[0]), "--stack", "nope")
    assert result.returncode == 2
    assert result.stderr.startswith("error: --stack:") and len(result.stderr.splitlines()) == 1


def test_the_test_packages_are_read_from_the_list_setup_installs(tmp_path: Path) -> None:
    listing = tmp_path / "system-packages.txt"
    listing.write_text("# why each\nhaproxy   # the balancer\n\ndenv-no-such-package  # x\n")
    assert listed_packages(listing.read_text()) == ["haproxy", "denv-no-such-package"]
    finding = check_test_packages(listing)
    assert not finding.ok
    assert finding.detail == (
        "missing denv-no-such-package; run `make setup` as root, "
        "or: sudo apt-get install denv-no-such-package"
    )
    assert check_test_packages(SYSTEM_PACKAGES).ok  # what `make setup` installed here
    assert check_test_packages(tmp_path / "absent.txt").detail == "not a checkout: no tests here"


def test_a_local_recipes_program_is_found_in_the_project_or_on_path(tmp_path: Path) -> None:
    from denv_iac.cli.doctor import check_commands

    server = tmp_path / ".venv" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    found = check_commands([("chat", ".venv/bin/llama-server"), ("stt", "sh")], tmp_path)
    assert found.ok and found.detail == "2 found"
    server.unlink()
    missing = check_commands(
        [("chat", ".venv/bin/llama-server"), ("stt", "no-such-transcriber")], tmp_path
    )
    assert not missing.ok
    assert missing.detail == (
        "recipe chat: .venv/bin/llama-server not found; `make llama` builds it; "
        "recipe stt: no-such-transcriber not found"
    )
