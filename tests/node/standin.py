"""Stand-ins for NVIDIA's and Docker's packages, under their real names and versions, in a
local apt repository; a fake PCI bus for the chroot; a stand-in denv-agent wheel.

The stand-in driver ships an `nvidia-smi` that answers from the fake PCI bus and keeps MIG
state in a file, and the stand-in `libnvidia-ml.so.1` (tests/nvml_standin) that the agent's NVML
binding loads, answering from the same bus, module version and MIG state. The "loaded kernel
module" version is a file too: its postinst writes the package's version there, and a test that
writes another one gets NVML's version mismatch.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import zipfile
from pathlib import Path

from tests import nvml_standin

DRIVER = "580.95.05"
NEWER_DRIVER = "590.44.01"  # in the repository too: the branch pin must keep it out
MODULE_DIR = "/var/lib/nvidia-standin"
MODULE_VERSION_FILE = f"/{nvml_standin.MODULE_VERSION}"
AGENT_STATE_FILE = "/var/lib/denv/agent-state"
REPO_IN_ROOT = "/srv/nvidia-standin"
# Where Debian's multiarch layout and NVIDIA's driver packages put NVML.
NVML_IN_ROOT = f"/usr/lib/x86_64-linux-gnu/{nvml_standin.LIBRARY}"
DEVICE = f"/{nvml_standin.DEVICE}"
# Fabric manager and NSCQ carry a Debian revision of their own (NVIDIA's repositories: the
# driver 550.127.05-0ubuntu1, fabric manager 550.127.05-1): the deploy matches the upstream part.
FABRIC_REVISION = "2"
# A later point release of the branch: apt's candidate, the wrong one beside a 580.95.05 driver.
LATER_FABRIC = "580.105.08"
NVLSM = "2025.06.7-1"  # the NVLink subnet manager is versioned on its own

_NVIDIA_SMI = r"""#!/usr/bin/python3
import json, os, sys

DRIVER = "@DRIVER@"
MODULE = "@MODULE@"
MODE = "@MODE@"  # MIG mode, current and pending: the GPU keeps it across a reboot
INSTANCES = "@INSTANCES@"  # GPU instances, in /run: a reboot loses them, as it does real ones
DEVICE = "@DEVICE@"  # what NVML clients and the NVIDIA daemons hold open


def gpus():
    base = "/sys/bus/pci/devices"
    found = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        def read(field):
            with open(os.path.join(base, name, field)) as f:
                return f.read().strip()
        if read("vendor") == "0x10de" and read("class").startswith("0x0302"):
            found.append(name)
    return found


def load(path, empty):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return empty


def save(path, state):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".partial", "w") as f:
        json.dump(state, f)
    os.replace(path + ".partial", path)  # the stand-in NVML never reads half a file


def holders():  # processes other than this one holding the device, as name[pid]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if int(pid) != os.getpid() and any(
                os.readlink(f"/proc/{pid}/fd/{fd}") == DEVICE for fd in fds
            ):
                with open(f"/proc/{pid}/comm") as f:
                    found.append(f"{f.read().strip()}[{pid}]")
        except OSError:
            pass
    return found


try:
    with open(MODULE) as f:
        loaded = f.read().strip()
except FileNotFoundError:
    loaded = ""
if loaded != DRIVER:
    if loaded:
        print("Failed to initialize NVML: Driver/library version mismatch")
    else:
        print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    sys.exit(18 if loaded else 9)

args = sys.argv[1:]
mode = load(MODE, {"mig": {}, "pending": {}})
mode.setdefault("pending", {})
instances = load(INSTANCES, {"devices": {}})
index = args[args.index("-i") + 1] if "-i" in args else None
bus = lambda i: "all GPUs" if i is None else "0000" + gpus()[int(i)].upper()
uuid = lambda i: "GPU-%08d-aaaa-bbbb-cccc-%012d" % (i, i)
if args and args[0].startswith("--query-gpu="):
    for i, pci in enumerate(gpus()):
        values = {
            "index": str(i), "uuid": uuid(i), "name": "NVIDIA H100 80GB HBM3",
            "pci.bus_id": "0000" + pci.upper(), "driver_version": DRIVER,
            "mig.mode.current": "Enabled" if mode["mig"].get(str(i)) else "Disabled",
        }
        print(", ".join(values[q] for q in args[0].split("=", 1)[1].split(",")))
elif args == ["-L"]:
    for i, _ in enumerate(gpus()):
        print("GPU %d: NVIDIA H100 80GB HBM3 (UUID: %s)" % (i, uuid(i)))
        devices = instances["devices"].get(str(i), []) if mode["mig"].get(str(i)) else []
        for n, profile in enumerate(devices):
            print("  MIG %-11s Device %2d: (UUID: MIG-%d-%d-%s)" % (profile, n, i, n, profile))
elif "-mig" in args and args[0] != "mig":
    # Pending until the GPU is reset, as on A100 and H100.
    on = args[args.index("-mig") + 1] == "1"
    mode["pending"][index] = on
    save(MODE, mode)
    print("%s MIG Mode for GPU %s." % ("Enabled" if on else "Disabled", bus(index)))
    print("All done.")
elif args[:1] == ["mig"] and "-cgi" in args:
    if not mode["mig"].get(index):
        print("No MIG-enabled devices found.")
        sys.exit(6)
    instances["devices"][index] = args[args.index("-cgi") + 1].split(",")
    save(INSTANCES, instances)
    for n, profile in enumerate(instances["devices"][index]):
        # As the real one reports it: what a boot's journal shows was made in that boot.
        print("Successfully created GPU instance ID %2d on GPU %2s using profile MIG %s"
              % (n + 1, index, profile))
elif args[:1] == ["mig"] and ("-dgi" in args or "-dci" in args):
    instances["devices"][index] = []
    save(INSTANCES, instances)
elif "-r" in args:
    held = holders()
    if held:
        print("GPU %s is currently in use by another process." % bus(index))
        print("stand-in nvidia-smi: the device is held by", " ".join(held), file=sys.stderr)
        sys.exit(255)
    if index in mode["pending"]:
        mode["mig"][index] = mode["pending"].pop(index)
        instances["devices"].pop(index, None)
        save(MODE, mode)
        save(INSTANCES, instances)
    print("GPU %s was successfully reset." % bus(index))
else:
    print("stand-in nvidia-smi: unsupported arguments", args, file=sys.stderr)
    sys.exit(2)
"""

_NVIDIA_CTK = r"""#!/bin/sh
if [ "$1 $2" = "runtime configure" ]; then
  mkdir -p /etc/docker
  printf '{"runtimes": {"nvidia": {"path": "nvidia-container-runtime", "args": []}}}\n' \
    > /etc/docker/daemon.json
  exit 0
fi
echo "stand-in nvidia-ctk: unsupported arguments: $*" >&2
exit 2
"""

# A daemon stays up, as the real one does: on a booted machine an exited one would be started
# again by every deploy.
_ECHO = '#!/bin/sh\necho {name} "$@"\n'
_UNIT = "[Unit]\nDescription={name} (stand-in)\n[Service]\nExecStart=/bin/sleep infinity\n"
_UNIT += "[Install]\nWantedBy=multi-user.target\n"
# An NVIDIA daemon also holds the device open while it runs, as the real ones hold /dev/nvidia*.
_HOLDER_UNIT = _UNIT.replace(
    "ExecStart=/bin/sleep infinity", f"ExecStart=/bin/sh -c 'exec sleep infinity 3<>{DEVICE}'"
)

# `docker run` stays in the foreground like a container does; the rest only echo.
_DOCKER = '#!/bin/sh\necho docker "$@"\nif [ "$1" = run ]; then exec sleep infinity; fi\n'

_AGENT_CLI = '''"""Stand-in agent CLI: drain and undrain record what the balancer would be told."""
import pathlib
import sys


def main() -> None:
    state = pathlib.Path("@STATE@")
    state.parent.mkdir(parents=True, exist_ok=True)
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command in ("drain", "undrain"):
        state.write_text("drain\\n" if command == "drain" else "up\\n")
        print(command + "ed")
    elif command == "clear-faults":
        print("cleared")
    else:
        sys.exit("stand-in denv-agent: " + command)
'''


def _package(
    out: Path,
    name: str,
    version: str,
    files: dict[str, tuple[str | bytes, int]],
    postinst: str = "",
) -> None:
    tree = out / f"build-{name}-{version}"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: denv tests <tests@denv.invalid>\n"
        f"Description: stand-in for {name}\n"
    )
    if postinst:
        (tree / "DEBIAN/postinst").write_text(f"#!/bin/sh\nset -e\n{postinst}\n")
        (tree / "DEBIAN/postinst").chmod(0o755)
    for path, (text, mode) in files.items():
        target = tree / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            target.write_bytes(text)
        else:
            target.write_text(text)
        target.chmod(mode)
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-b", str(tree), str(out / f"{name}_{version}_all.deb")],
        check=True,
        capture_output=True,
    )


def build_repo(out: Path, kernel: str | None = None, wireguard: bool = False) -> None:
    """A flat apt repository (Packages index) of the stand-ins in `out`; with `kernel` (a
    booted machine's `uname -r`), the headers a driver install asks for first; with
    `wireguard`, a wireguard-tools whose commands only echo (a chroot's: a VM takes Debian's)."""
    out.mkdir(parents=True, exist_ok=True)
    if wireguard:
        _package(
            out,
            "wireguard-tools",
            "1.0.20210914-1",
            {
                "/usr/bin/wg": (_ECHO.format(name="wg"), 0o755),
                "/usr/bin/wg-quick": (_ECHO.format(name="wg-quick"), 0o755),
                "/lib/systemd/system/wg-quick@.service": (_UNIT.format(name="wg-quick"), 0o644),
            },
        )
    if kernel:
        headers = f"linux-headers-{kernel}"
        _package(out, headers, "1-1", {f"/usr/src/{headers}/Makefile": ("", 0o644)})
    source = f"deb [trusted=yes] file:{REPO_IN_ROOT} ./\n"
    _package(
        out,
        "cuda-keyring",
        "1.1-1",
        {"/etc/apt/sources.list.d/cuda-debian12-x86_64.list": (source, 0o644)},
    )
    _package(
        out,
        "nvidia-driver-pinning-580",
        "580.95.05-1",
        {
            "/etc/apt/preferences.d/nvidia-driver-pinning-580": (
                "Package: nvidia-open cuda-drivers nvidia-fabricmanager-* libnvidia-nscq-*\n"
                "Pin: version 580.*\nPin-Priority: 1000\n",
                0o644,
            )
        },
    )
    for version in (DRIVER, NEWER_DRIVER):
        smi = _NVIDIA_SMI
        for key, value in {
            "@DRIVER@": version,
            "@MODULE@": MODULE_VERSION_FILE,
            "@MODE@": f"/{nvml_standin.MIG_MODE}",
            "@INSTANCES@": f"/{nvml_standin.MIG_INSTANCES}",
            "@DEVICE@": DEVICE,
        }.items():
            smi = smi.replace(key, value)
        _package(
            out,
            "nvidia-open",
            f"{version}-1",
            {
                "/usr/bin/nvidia-smi": (smi, 0o755),
                NVML_IN_ROOT: (
                    (nvml_standin.build(version) / nvml_standin.LIBRARY).read_bytes(),
                    0o644,
                ),
                "/lib/systemd/system/nvidia-persistenced.service": (
                    _HOLDER_UNIT.format(name="nvidia-persistenced"),
                    0o644,
                ),
                # The device's folder at every boot, before any holder opens it.
                "/usr/lib/tmpfiles.d/nvidia-standin.conf": (
                    f"d {Path(DEVICE).parent} 0755 root root -\n",
                    0o644,
                ),
            },
            # ldconfig: what the real library package's trigger runs.
            postinst=f"mkdir -p {MODULE_DIR} {Path(DEVICE).parent};"
            f" echo {version} > {MODULE_VERSION_FILE}; ldconfig",
        )
    # The branch's names up to 580, the unsuffixed ones from 590 (fabric.py's rule).
    for suffix, upstream in (("-580", DRIVER), ("-580", LATER_FABRIC), ("", NEWER_DRIVER)):
        _fabric_packages(out, suffix, f"{upstream}-{FABRIC_REVISION}")
    _package(out, "nvlsm", NVLSM, {"/usr/share/doc/nvlsm/x": ("", 0o644)})
    _package(
        out, "nvidia-container-toolkit", "1.17.8-1", {"/usr/bin/nvidia-ctk": (_NVIDIA_CTK, 0o755)}
    )
    _package(
        out,
        "docker.io",
        "26.1.5+dfsg1-1",
        {
            "/usr/bin/docker": (_DOCKER, 0o755),
            "/lib/systemd/system/docker.service": (_UNIT.format(name="docker"), 0o644),
        },
    )
    index = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", "."], cwd=out, check=True, capture_output=True
    ).stdout
    (out / "Packages").write_bytes(index)


def _fabric_packages(out: Path, suffix: str, version: str) -> None:
    """Fabric manager (a daemon that holds the GPUs) and NSCQ under one branch's names."""
    _package(
        out,
        f"nvidia-fabricmanager{suffix}",
        version,
        {
            "/lib/systemd/system/nvidia-fabricmanager.service": (
                _HOLDER_UNIT.format(name="fabricmanager"),
                0o644,
            )
        },
    )
    _package(
        out,
        f"libnvidia-nscq{suffix}",
        version,
        {f"/usr/share/doc/libnvidia-nscq{suffix}/x": ("", 0o644)},
    )


def fake_pci_bus(root: Path, gpus: int, nvswitches: int) -> None:
    """NVIDIA devices under the chroot's /sys, as the kernel lists them (vendor, class)."""
    devices = [("0x030200", 0x18 + i) for i in range(gpus)]
    devices += [("0x068000", 0x80 + i) for i in range(nvswitches)]
    for cls, bus in devices:
        folder = root / f"sys/bus/pci/devices/0000:{bus:02x}:00.0"
        folder.mkdir(parents=True)
        (folder / "vendor").write_text("0x10de\n")
        (folder / "class").write_text(f"{cls}\n")


def agent_wheel(out: Path, version: str = "0.1.0") -> Path:
    """A wheel named denv-agent with a console script, no dependencies: installs offline."""
    dist = f"denv_agent-{version}.dist-info"
    files = {
        "denv_agent/__init__.py": "",
        "denv_agent/cli.py": _AGENT_CLI.replace("@STATE@", AGENT_STATE_FILE),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: denv-agent\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: denv-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{dist}/entry_points.txt": "[console_scripts]\ndenv-agent = denv_agent.cli:main\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    path = out / f"denv_agent-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path
