"""What a VM gets to stand in for a GPU machine and the internet.

The stand-in NVIDIA packages (tests/node/standin.py) as a local apt repository in the VM, stand-in
NVIDIA devices listed under /sys/bus/pci/devices (a tmpfs mounted over it at boot by a unit), and
the agent's Python dependencies as wheels that pip in the VM takes instead of an index. The VM's
Debian sources are removed: nothing is fetched from outside.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests import nvml_standin
from tests.node import standin
from tests.vm.bed import Vm

WHEELS_DIR = Path("/var/cache/denv-test/wheels")
WHEELS_IN_VM = "/srv/denv-wheels"
AGENT_DEPENDENCIES = ("nvidia-ml-py", "prometheus-client")
_LOCK = Path(__file__).resolve().parents[2] / "requirements.lock"

PCI_IN_VM = "/usr/local/share/standin-pci"
_PCI_UNIT = """[Unit]
Description=stand-in NVIDIA devices on the PCI bus listing
DefaultDependencies=no
Before=sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/mount -t tmpfs standin-pci /sys/bus/pci/devices
ExecStart=/bin/cp -a @PCI@/. /sys/bus/pci/devices/

[Install]
WantedBy=sysinit.target
"""


def _modprobe_conf() -> str:
    """The stand-in kernel modules: `modprobe nvidia` loads the installed driver's version (what
    the stand-in nvidia-smi compares with its own), `modprobe -r nvidia` unloads it."""
    # modprobe runs an install command with the shell.
    version = "dpkg-query -W -f '${Version}' nvidia-open | cut -d- -f1"
    load = f"{version} > {standin.MODULE_VERSION_FILE}"
    lines = [
        f"install nvidia mkdir -p {standin.MODULE_DIR} && {load}",
        f"remove nvidia /bin/rm -f {standin.MODULE_VERSION_FILE}",
    ]
    for module in ("nvidia_uvm", "nvidia_drm", "nvidia_modeset"):
        lines += [f"install {module} /bin/true", f"remove {module} /bin/true"]
    return "\n".join(lines) + "\n"


def agent_dependency_wheels(out: Path = WHEELS_DIR) -> list[Path]:
    """The agent's dependencies at the versions requirements.lock pins, downloaded once."""
    pins = dict(re.findall(r"^([a-z0-9-]+)==(\S+)", _LOCK.read_text(), re.M))
    wanted = [f"{name}=={pins[name]}" for name in AGENT_DEPENDENCIES]
    have = sorted(out.glob("*.whl"))
    names = {p.name.split("-")[0].replace("_", "-") + "==" + p.name.split("-")[1] for p in have}
    if not set(wanted) <= names:
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out), *wanted],
            check=True,
            capture_output=True,
            timeout=300,
        )
    return sorted(out.glob("*.whl"))


def send_folder(vm: Vm, folder: Path, dest: str) -> None:
    tar = subprocess.Popen(["tar", "-C", str(folder), "-cz", "."], stdout=subprocess.PIPE)
    subprocess.run(
        vm.ssh_args(f"mkdir -p {dest} && tar -xz -C {dest}"), stdin=tar.stdout, check=True
    )
    tar.wait()


def make_gpu_machine(vm: Vm, workdir: Path, gpus: int = 2, nvswitches: int = 0) -> None:
    """Turn a booted VM into a GPU machine with no driver, offline but for the stand-ins."""
    repo = workdir / "nvidia-repo"
    standin.build_repo(repo, kernel=vm.ssh("uname -r").strip())
    send_folder(vm, repo, standin.REPO_IN_ROOT)
    wheels = workdir / "wheels"
    wheels.mkdir(exist_ok=True)
    for wheel in agent_dependency_wheels():
        (wheels / wheel.name).write_bytes(wheel.read_bytes())
    send_folder(vm, wheels, WHEELS_IN_VM)
    stage = workdir / "pci"
    standin.fake_pci_bus(stage, gpus=gpus, nvswitches=nvswitches)
    send_folder(vm, stage / "sys/bus/pci/devices", PCI_IN_VM)
    unit = _PCI_UNIT.replace("@PCI@", PCI_IN_VM)
    vm.ssh(
        f"cat > /etc/modprobe.d/nvidia-standin.conf <<'EOF'\n{_modprobe_conf()}EOF\n"
        " rm -f /etc/apt/sources.list /etc/apt/sources.list.d/debian.sources"
        f" && printf '[global]\\nno-index = true\\nfind-links = {WHEELS_IN_VM}\\n' > /etc/pip.conf"
        f" && cat > /etc/systemd/system/standin-pci.service <<'EOF'\n{unit}EOF\n"
        " systemctl daemon-reload && systemctl enable --now standin-pci.service"
    )


def set_nvml_faults(vm: Vm, *lines: str) -> None:
    """Script the stand-in NVML library in the VM: replace its fault file with these lines
    (the format is in tests/nvml_standin/nvml_standin.c; none: healthy GPUs)."""
    path = f"/{nvml_standin.FAULTS}"
    text = shlex.quote("".join(f"{line}\n" for line in lines))
    # Renamed into place, so a call never reads half a file.
    vm.ssh(f"printf %s {text} > {path}.partial && mv {path}.partial {path}")
