"""The NVIDIA driver: verify a working one of the pinned branch, otherwise install it pinned."""

from __future__ import annotations

import dataclasses
import posixpath
import re
import shlex

from denv_iac.node.facts import NodeFacts
from denv_iac.node.holders import PERSISTENCED, active, stopped_around
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import (
    APT_UPDATE,
    PACKAGE_UNIT_DIR,
    FileContent,
    Step,
    apt_install,
    apt_purge,
    enable_link,
    text_file,
    wants_link,
)

# (os-release ID, VERSION_ID) -> the distro name in NVIDIA's repository paths.
SUPPORTED_OS = {("ubuntu", "22.04"): "ubuntu2204", ("ubuntu", "24.04"): "ubuntu2404"}
SUPPORTED_OS[("debian", "12")] = "debian12"
_REPO_ARCH = {"amd64": "x86_64", "arm64": "sbsa"}
KEYRING_DEB = "cuda-keyring_1.1-1_all.deb"
# What a driver install leaves behind, from NVIDIA's repository, Ubuntu's archive or Lambda
# Stack; the container toolkit (libnvidia-container*, nvidia-container-*) is not the driver.
_DRIVER_PACKAGE = re.compile(
    r"^(nvidia-open(-\d+)?|cuda-drivers(-\d+)?|nvidia-driver(-.+)?|nvidia-headless(-.+)?"
    r"|nvidia-utils-.+|nvidia-kernel-.+|nvidia-dkms-.+|nvidia-compute-utils-.+"
    r"|libnvidia-(compute|decode|encode|extra|fbc1|gl|cfg1|common)-.+|nvidia-firmware-.+"
    r"|nvidia-fabricmanager(-.+)?|libnvidia-nscq(-.+)?|nvidia-persistenced|nvidia-modprobe"
    r"|linux-modules-nvidia-.+|linux-objects-nvidia-.+|linux-signatures-nvidia-.+)$"
)
# The package whose version the driver carries, most specific first.
_MAIN_PACKAGES = ("nvidia-open", "cuda-drivers")
_MAIN_PATTERNS = (
    re.compile(r"^nvidia-driver-(\d+)(-server)?(-open)?$"),
    re.compile(r"^nvidia-headless-(\d+)(-server)?(-open)?$"),
)
MODULES = ("nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia")
# The in-kernel driver binds the GPUs first when it may, and the NVIDIA modules then fail to load.
NOUVEAU_CONF = "/etc/modprobe.d/denv-blacklist-nouveau.conf"
_NOUVEAU_TEXT = "blacklist nouveau\noptions nouveau modeset=0\n"
MISMATCH = "version mismatch"


class UnsupportedNode(RuntimeError):
    """The node cannot take this deploy; the message says why and what would work."""


def repo_url(facts: NodeFacts, spec: NodeDeploySpec) -> str:
    distro = SUPPORTED_OS[(facts.os_id, facts.os_version)]
    return spec.nvidia_repo.format(distro=distro, arch=_REPO_ARCH.get(facts.arch, facts.arch))


def check_supported(facts: NodeFacts) -> None:
    if (facts.os_id, facts.os_version) not in SUPPORTED_OS:
        found = f"{facts.os_id or 'unknown'} {facts.os_version}".strip()
        raise UnsupportedNode(
            f"{found} is not supported: use Ubuntu 22.04, Ubuntu 24.04 or Debian 12"
        )
    if facts.arch not in _REPO_ARCH:
        raise UnsupportedNode(f"architecture {facts.arch or 'unknown'}: use amd64 or arm64")


def main_package(facts: NodeFacts) -> tuple[str, str] | None:
    """(name, version) of the installed package the driver's version is read from."""
    for name in _MAIN_PACKAGES:
        if name in facts.packages:
            return name, facts.packages[name]
    for pattern in _MAIN_PATTERNS:
        for name in sorted(facts.packages):
            if pattern.match(name):
                return name, facts.packages[name]
    return None


def installed_driver_packages(facts: NodeFacts) -> list[str]:
    return sorted(name for name in facts.packages if _DRIVER_PACKAGE.match(name))


def package_branch(version: str) -> str:
    upstream = version.split(":", 1)[-1]
    return upstream.split(".", 1)[0]


def branch_for(facts: NodeFacts, spec: NodeDeploySpec) -> NodeDeploySpec:
    """`spec` pinned to the branch the node has, when the machine image ships the driver.

    The image's driver is matched to its kernel and tested by its vendor: replacing it with
    another branch buys a reboot and nothing else. The running branch counts, else the packaged
    one (a broken driver is repaired within its branch); with no driver at all, the pin stands.
    """
    if not spec.image_driver:
        return spec
    main = main_package(facts)
    branch = facts.driver_branch if facts.smi_ok else package_branch(main[1]) if main else ""
    return dataclasses.replace(spec, driver_branch=branch) if branch.isdigit() else spec


def verify_command(spec: NodeDeploySpec) -> str:
    """Succeeds when NVML answers and reports a driver of the pinned branch; else says why."""
    branch = spec.driver_branch
    return (
        "out=$(nvidia-smi --query-gpu=index,uuid,driver_version --format=csv,noheader 2>&1)"
        ' || { echo "$out"; exit 1; }; '
        f"printf '%s\\n' \"$out\" | awk -F', ' '{{n++; if ($3 !~ /^{branch}\\./) bad=$3}}"
        f' END{{if (n == 0 || bad != "") {{print "driver " bad " is not branch {branch}";'
        " exit 1}}'"
    )


def reload_modules_command(stop: list[str]) -> str:
    """Unload and load the modules with `stop` (the units holding the device) stopped around."""
    reload = f"modprobe -r {' '.join(MODULES)} && modprobe nvidia && modprobe nvidia_uvm"
    return stopped_around(stop, [reload])


def device_users(facts: NodeFacts, spec: NodeDeploySpec) -> list[str]:
    """What holds the GPUs now: the running replicas (first), then the NVML holders."""
    replicas = [r.unit for r in spec.replicas if r.unit in facts.active_units]
    return replicas + active(facts)


def driver_package(spec: NodeDeploySpec) -> str:
    return "nvidia-open" if spec.open_modules else "cuda-drivers"


def keyring_steps(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    """NVIDIA's repository, through its keyring package: the driver and toolkit come from it."""
    if "cuda-keyring" in facts.packages:
        return []
    url = f"{repo_url(facts, spec)}/{KEYRING_DEB}"
    commands = (
        f"curl -fsSL -o /tmp/{KEYRING_DEB} {shlex.quote(url)}",
        apt_install(f"/tmp/{KEYRING_DEB}"),  # through apt: it waits for the package lock
        f"rm -f /tmp/{KEYRING_DEB}",
        APT_UPDATE,
    )
    return [Step("repository", "add NVIDIA's repository (cuda-keyring)", commands)]


def nouveau_blacklist() -> FileContent:
    return text_file(NOUVEAU_CONF, _NOUVEAU_TEXT)


def prerequisite_steps(facts: NodeFacts) -> list[Step]:
    """What a driver install needs first: nouveau kept off the GPUs, the kernel's headers."""
    steps = []
    blacklist = nouveau_blacklist()
    if facts.files.get(blacklist.path) != blacklist.sha256:
        # Written by a command, not as a step's file: the repair runs these steps' commands.
        # The initramfs loads modules before the root file system is there: it learns the
        # blacklist only when rebuilt. Not rebuilt where no installed kernel has nouveau (cloud
        # kernels) or no initramfs-tools: there is nothing it could load early.
        folder = posixpath.dirname(blacklist.path)
        write = f"mkdir -p {folder} && printf %s {shlex.quote(_NOUVEAU_TEXT)} > {blacklist.path}"
        initramfs = (
            "if command -v update-initramfs >/dev/null"
            " && find /lib/modules -name 'nouveau.ko*' | grep -q .; then update-initramfs -u; fi"
        )
        steps.append(Step("driver", f"blacklist nouveau ({blacklist.path})", (write, initramfs)))
    headers = f"linux-headers-{facts.kernel}"
    # Only a booted kernel of the node's own: in a chroot `uname -r` is the build host's.
    if facts.systemd and facts.kernel and headers not in facts.packages:
        steps.append(
            Step(
                "driver",
                f"install {headers} (the driver's modules are built against them)",
                (apt_install(headers),),
                uses_apt=True,
            )
        )
    return steps


def install_steps(facts: NodeFacts, spec: NodeDeploySpec, purge: list[str]) -> list[Step]:
    """Purge `purge`, then install the pinned branch from NVIDIA's repository."""
    steps = prerequisite_steps(facts)
    if purge:
        steps.append(
            Step("driver", f"purge {len(purge)} other driver packages", (apt_purge(*purge),))
        )
    pinning = f"nvidia-driver-pinning-{spec.driver_branch}"
    package = driver_package(spec)
    steps.append(
        Step(
            "driver",
            f"pin branch {spec.driver_branch} and install {package}",
            (apt_install(pinning), apt_install(package)),
            uses_apt=True,
        )
    )
    return steps


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    main = main_package(facts)
    packaged_branch = package_branch(main[1]) if main else ""
    steps: list[Step] = []
    if facts.smi_ok and facts.driver_branch == spec.driver_branch:
        pass  # a working driver of the branch asked for: verified, never reinstalled
    elif packaged_branch == spec.driver_branch and facts.smi_present:
        # Installed right, running wrong: a half-done upgrade or modules never loaded.
        command = reload_modules_command(device_users(facts, spec))
        steps.append(_load_step(facts, "reload the kernel modules", command))
    else:
        keep = f"nvidia-driver-pinning-{spec.driver_branch}"
        purge = [name for name in installed_driver_packages(facts) if name != keep]
        steps += install_steps(facts, spec, purge)
        if facts.smi_ok and facts.systemd:
            # Another branch's modules are loaded and in use: only a reboot swaps them.
            steps.append(Step("driver", "reboot into the new driver", reboot=True))
        else:
            steps.append(_load_step(facts, "load the kernel modules", "modprobe nvidia"))
    if steps:
        steps.append(
            Step(
                "driver",
                f"verify branch {spec.driver_branch} through NVML",
                (verify_command(spec),),
            )
        )
    steps += service_steps(facts, "driver", PERSISTENCED, "persistence daemon")
    return steps


def _load_step(facts: NodeFacts, title: str, command: str) -> Step:
    if facts.systemd:
        return Step("driver", title, (command,))
    # A chroot or container shares the host's kernel: its modules are not ours to load.
    return Step("driver", f"{title}: skipped, no booted kernel of its own")


def service_steps(
    facts: NodeFacts,
    area: str,
    unit: str,
    what: str,
    changed: bool = False,
    unit_dir: str = PACKAGE_UNIT_DIR,
) -> list[Step]:
    """Enable (and, under systemd, start) a unit; `changed`: restart it, a step just changed it."""
    enabled = wants_link(unit) in facts.links
    if facts.systemd:
        if changed:
            commands = (f"systemctl enable {unit}", f"systemctl restart {unit}")
            return [Step(area, f"restart the {what}", commands)]
        if enabled and unit in facts.active_units:
            return []
        return [Step(area, f"enable and start the {what}", (f"systemctl enable --now {unit}",))]
    if enabled:
        return []
    # Without systemd running (a chroot, an image being built) enabling is all there is to do.
    return [
        Step(area, f"enable the {what} (not started: no systemd)", (enable_link(unit, unit_dir),))
    ]
