"""NVSwitch boards: fabric manager at exactly the running driver's version, and on NVLink 5
boards (HGX B200) the NVLink subnet manager beside it."""

from __future__ import annotations

from enum import StrEnum

from denv_iac.node.driver import driver_package, package_branch, service_steps
from denv_iac.node.facts import NodeFacts
from denv_iac.node.holders import FABRICMANAGER
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import FileContent, Step, apt_install, text_file

# From this branch on, NVIDIA's repository names the packages without the branch suffix
# (nvidia-fabricmanager, libnvidia-nscq): the pinning package keeps the branch instead.
UNSUFFIXED_FROM = 590
# NVLink 5 boards: their switches are managed through ConnectX bridge functions (vendor
# 0x15b3), so no NVIDIA bridge (class 0x0680) shows on the PCI bus; the GPUs name the board.
# HGX B300 is an NVLink 5 baseboard too: NVML names it "NVIDIA B300 SXM6 AC" (the product label
# NVIDIA-B300-SXM6-AC), PCI device 0x3182 (NVIDIA's mig-parted config filters it as 0x318210DE).
NVLINK5_NAMES = frozenset({"NVIDIA B200", "NVIDIA B100", "NVIDIA B300 SXM6 AC"})
NVLINK5_PCI_IDS = frozenset({"0x2901", "0x29bc", "0x3182"})  # GB100 [B200], GB102 [B100], B300
NVLSM = "nvlsm"  # NVIDIA's NVLink subnet manager; fabric manager starts it on NVLink 5 boards
# Holds fabric manager and NSCQ at the driver's version: the branch's pinning package lets an
# upgrade move them to any later release of the branch, and fabric manager does not start beside
# a driver of another version. Read before the pinning package's file (apt reads them by name).
PIN = "/etc/apt/preferences.d/denv-fabric-manager"


class Board(StrEnum):
    PLAIN = "plain"  # PCIe cards, NVLink bridges: no fabric to bring up
    NVSWITCH = "nvswitch"  # HGX A100 / H100 / H200: fabric manager and NSCQ
    NVLINK5 = "nvlink5"  # HGX B200 / B300: fabric manager, NSCQ and the NVLink subnet manager


def board(facts: NodeFacts) -> Board:
    names = {gpu.name for gpu in facts.gpus}
    if names & NVLINK5_NAMES or facts.pci_gpu_ids & NVLINK5_PCI_IDS:
        return Board.NVLINK5
    return Board.NVSWITCH if facts.nvswitches else Board.PLAIN


def packages(driver_version: str, branch: str, kind: Board) -> tuple[str, ...]:
    """What `apt-get install` takes for the board: `name=version` arguments.

    The fabric manager packages carry their own Debian revision (the driver 550.127.05-0ubuntu1,
    fabric manager 550.127.05-1), so the pin is the driver's upstream version with any revision.
    `driver_version` may be a shell expansion (`$v`) read on the node when the command runs.
    """
    if kind is Board.PLAIN:
        return ()
    pinned = tuple(f"{name}={driver_version}-*" for name in _names(branch))
    # The subnet manager is versioned on its own, not with the driver.
    return (*pinned, NVLSM) if kind is Board.NVLINK5 else pinned


def _names(branch: str) -> tuple[str, str]:
    suffix = "" if int(branch) >= UNSUFFIXED_FROM else f"-{branch}"
    return f"nvidia-fabricmanager{suffix}", f"libnvidia-nscq{suffix}"


def pin(driver_version: str, branch: str) -> FileContent:
    """The apt pin at PIN: fabric manager and NSCQ at the driver's upstream version, any
    revision. `driver_version` may be a shell expansion, as in `packages`."""
    text = f"Package: {' '.join(_names(branch))}\nPin: version {driver_version}-*\n"
    return text_file(PIN, text + "Pin-Priority: 1001\n")


def running_version(facts: NodeFacts) -> str:
    """The working driver's version (the loaded module's, else NVML's); '' while NVML fails:
    the driver plan then reloads or replaces the modules in this run, and the version that
    counts is the one loaded after that, read on the node by `install_command`."""
    if not facts.smi_ok:
        return ""
    return facts.module_version or facts.driver_version


def _upstream(version: str) -> str:
    """A Debian version without epoch and revision: 550.127.05-0ubuntu1 -> 550.127.05."""
    return version.split(":", 1)[-1].rsplit("-", 1)[0]


def installed(facts: NodeFacts, wanted: tuple[str, ...]) -> bool:
    for argument in wanted:
        name, _, pin = argument.partition("=")
        have = facts.packages.get(name)
        if have is None or (pin and _upstream(have) != pin.removesuffix("-*")):
            return False
    return True


def install_command(spec: NodeDeploySpec, kind: Board) -> str:
    """Install at the version of the driver on the node when the command runs: the loaded
    module's, else the installed driver package's (a chroot loads no module of its own)."""
    query = f"dpkg-query -W -f='${{Version}}' {driver_package(spec)}"
    strip = "sed -e 's/^[0-9]*://' -e 's/-[^-]*$//'"
    version = f"v=$(cat /sys/module/nvidia/version 2>/dev/null || {query} | {strip})"
    # Double quotes: $v expands, the version's `*` reaches apt unglobbed.
    arguments = " ".join(f'"{argument}"' for argument in packages("$v", spec.driver_branch, kind))
    # The same bytes as pin(version) once $v is known: a second run finds nothing to write.
    held = pin("%s", spec.driver_branch).content.decode().replace("\n", "\\n")
    write = f"printf '{held}' \"$v\" > {PIN}"
    return f'{version} && [ -n "$v" ] && {write} && {apt_install()}{arguments}'


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    kind = board(facts)
    if kind is Board.PLAIN:
        return []
    running = running_version(facts)
    if running and package_branch(running) == spec.driver_branch:
        wanted = packages(running, spec.driver_branch, kind)
        held = pin(running, spec.driver_branch)
        if installed(facts, wanted):
            steps = []
            if facts.files.get(PIN) != held.sha256:
                steps.append(Step("driver", f"pin fabric manager to {running}", file=held))
            return steps + service_steps(facts, "driver", FABRICMANAGER, "fabric manager")
        title = f"install fabric manager {running} ({kind.value} board)"
        # The pin is written first: apt then takes exactly that version.
        step = Step("driver", title, (apt_install(*wanted),), file=held, uses_apt=True)
    else:
        # The driver is installed or replaced in this same run: its version is read then.
        title = f"install fabric manager at the driver's version ({kind.value} board)"
        step = Step("driver", title, (install_command(spec, kind),), uses_apt=True)
    return [
        step,
        *service_steps(facts, "driver", FABRICMANAGER, "fabric manager", changed=True),
    ]
