"""`denv doctor`: what this machine has of what a stack (and this repository's tests) need.

Each check runs the real tool (`haproxy -v`, `uv --version`, ...) and, when something is
missing or too old, says what to install. The exit status is 1 when something the chosen
stack needs is missing; the rest are reported for the commands and tests that use them.
"""

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from denv_iac.cli.console import fail

HAPROXY_MIN = (2, 6)  # the oldest branch whose config the generator targets (docs/balancer.md)
KVM = Path("/dev/kvm")
# In a checkout: the Debian packages the tests run for real (scripts/setup.sh installs them).
SYSTEM_PACKAGES = Path(__file__).resolve().parents[2] / "scripts" / "system-packages.txt"


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    detail: str  # what was found; when not ok, what to install
    purpose: str  # what needs it


def haproxy_version(text: str) -> tuple[int, int, int] | None:
    """The version `haproxy -v` prints ("HAProxy version 2.6.12-1+deb12u4 ...")."""
    found = re.search(r"HA-?Proxy version (\d+)\.(\d+)(?:\.(\d+))?", text)
    if found is None:
        return None
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


def _output(*args: str) -> str | None:
    """A tool's output; None when it is not on PATH or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return None
    return (done.stdout + done.stderr).strip() if done.returncode == 0 else None


def check_haproxy() -> Finding:
    purpose = "a local stack's balancer: denv local, make demo, the data-plane tests"
    install = "install HAProxy 2.6 or newer: sudo apt-get install haproxy"
    text = _output("haproxy", "-v")
    if text is None:
        return Finding("haproxy", False, f"haproxy not found; {install}", purpose)
    version = haproxy_version(text)
    if version is None:
        return Finding("haproxy", False, f"`haproxy -v` names no version; {install}", purpose)
    dotted = ".".join(map(str, version))
    if version[:2] < HAPROXY_MIN:
        return Finding("haproxy", False, f"HAProxy {dotted} is too old; {install}", purpose)
    return Finding("haproxy", True, f"HAProxy {dotted}", purpose)


def check_uv() -> Finding:
    purpose = "make setup, uv run, the install test"
    text = _output("uv", "--version")
    if text is None:
        return Finding("uv", False, "uv not found; install it: python3 -m pip install uv", purpose)
    return Finding("uv", True, text, purpose)


def check_namespaces() -> Finding:
    # Imported here: the local runner's modules are not needed by the other checks.
    from denv_iac.local.netns import unavailable_reason

    purpose = "make reliability: the scenarios across network namespaces"
    reason = unavailable_reason()
    if reason is None:
        return Finding("namespaces", True, "root, ip and nft present", purpose)
    return Finding("namespaces", False, f"{reason}; run as root (sudo make reliability)", purpose)


def check_qemu() -> Finding:
    purpose = "VM tests of the node deploy"
    text = _output("qemu-system-x86_64", "--version")
    if text is None:
        install = "install QEMU: sudo apt-get install qemu-system-x86 qemu-utils"
        return Finding("qemu", False, f"qemu-system-x86_64 not found; {install}", purpose)
    version = text.splitlines()[0]
    if not os.access(KVM, os.R_OK | os.W_OK):
        return Finding("qemu", True, f"{version}; no access to {KVM}, VMs run slowly", purpose)
    return Finding("qemu", True, f"{version}, with KVM", purpose)


def check_pulumi() -> Finding:
    purpose = "pulumi up and preview of cloud stacks"
    text = _output("pulumi", "version")
    if text is None:
        install = "install the Pulumi CLI (https://www.pulumi.com/docs/install/)"
        return Finding("pulumi", False, f"pulumi not found; {install}", purpose)
    return Finding("pulumi", True, f"Pulumi CLI {text}", purpose)


def listed_packages(text: str) -> list[str]:
    """The package names of system-packages.txt: one a line, `#` starts a comment."""
    return [name for line in text.splitlines() if (name := line.partition("#")[0].strip())]


def check_test_packages(listing: Path = SYSTEM_PACKAGES) -> Finding:
    purpose = "make test: HAProxy, node deploys into a Debian root and VMs, promtool, ..."
    if not listing.is_file():
        return Finding("packages", True, "not a checkout: no tests here", purpose)
    wanted = listed_packages(listing.read_text("utf-8"))
    if shutil.which("dpkg-query") is None:
        detail = f"no dpkg-query, not Debian? install the equivalents of {', '.join(wanted)}"
        return Finding("packages", False, detail, purpose)
    # dpkg-query exits 1 when it knows some name not, and still lists the others.
    shown = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Status}\n", *wanted],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout
    installed = {
        line.split()[0] for line in shown.splitlines() if line.endswith(" install ok installed")
    }
    missing = [name for name in wanted if name not in installed]
    if missing:
        fix = f"run `make setup` as root, or: sudo apt-get install {' '.join(missing)}"
        return Finding("packages", False, f"missing {', '.join(missing)}; {fix}", purpose)
    return Finding("packages", True, f"all {len(wanted)} installed", purpose)


CHECKS: dict[str, Callable[[], Finding]] = {
    "haproxy": check_haproxy,
    "pulumi": check_pulumi,
    "uv": check_uv,
    "namespaces": check_namespaces,
    "qemu": check_qemu,
    "packages": check_test_packages,
}


def check_commands(recipes: list[tuple[str, str]], project: Path) -> Finding:
    """Each local recipe's program, `(recipe, program)`: found as written (relative to the
    project's folder, where a local replica runs) or on PATH."""
    purpose = "the model servers a local stack's recipes run (their `command`)"
    missing = []
    for recipe, program in recipes:
        path = project / program if "/" in program else shutil.which(program)
        if path is None or not os.access(path, os.X_OK):
            hint = "; `make llama` builds it" if Path(program).name == "llama-server" else ""
            missing.append(f"recipe {recipe}: {program} not found{hint}")
    if missing:
        return Finding("commands", False, "; ".join(missing), purpose)
    return Finding("commands", True, f"{len(recipes)} found", purpose)


def needed_by(site_kinds: set[str]) -> set[str]:
    """The checks a stack with these site kinds cannot do without."""
    # A local stack runs its balancer here; any other site is created or reached by Pulumi.
    return {"haproxy"} if site_kinds <= {"local"} else {"pulumi"}


@click.command()
@click.option(
    "--stack",
    "stack_name",
    help="Also say what this stack needs (exit status 1 when that is missing).",
)
def doctor(stack_name: str | None) -> None:
    """Check this machine for what a stack needs, and say what to install."""
    needed: set[str] = set()
    if stack_name is not None:
        from denv_iac.core.stack.reader import StackError
        from denv_iac.stacks_dir import find_stacks_dir, load_stack

        try:
            stack = load_stack(find_stacks_dir(), stack_name)
        except StackError as error:
            fail(error.problems)
        needed = needed_by({site.kind for site in stack.sites})
    findings = [check() for check in CHECKS.values()]
    if stack_name is not None and "haproxy" in needed:
        programs = [(r.name, r.command[0]) for r in stack.recipes if r.command]
        if programs:
            findings.append(check_commands(programs, find_stacks_dir().parent))
            needed.add("commands")
    width = max(len(f.name) for f in findings)
    for finding in findings:
        status = "ok" if finding.ok else ("MISSING" if finding.name in needed else "missing")
        needs = f"; stack {stack_name} needs it" if finding.name in needed else ""
        click.echo(
            f"{status:8} {finding.name:{width}}  {finding.detail}  -- {finding.purpose}{needs}"
        )
    if any(not f.ok for f in findings if f.name in needed):
        sys.exit(1)
