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

_NVIDIA_SMI = r"""#!/usr/bin/python3
import json, os, sys

DRIVER = "@DRIVER@"
STATE = "/var/lib/nvidia-standin/state.json"
MODULE = "@MODULE@"


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


def load():
    try:
        with open(STATE) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"mig": {}, "devices": {}}


def save(state):
    with open(STATE, "w") as f:
        json.dump(state, f)


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
state = load()
index = args[args.index("-i") + 1] if "-i" in args else None
uuid = lambda i: "GPU-%08d-aaaa-bbbb-cccc-%012d" % (i, i)
if args and args[0].startswith("--query-gpu="):
    for i, bus in enumerate(gpus()):
        values = {
            "index": str(i), "uuid": uuid(i), "name": "NVIDIA H100 80GB HBM3",
            "pci.bus_id": "0000" + bus.upper(), "driver_version": DRIVER,
            "mig.mode.current": "Enabled" if state["mig"].get(str(i)) else "Disabled",
        }
        print(", ".join(values[q] for q in args[0].split("=", 1)[1].split(",")))
elif args == ["-L"]:
    for i, _ in enumerate(gpus()):
        print("GPU %d: NVIDIA H100 80GB HBM3 (UUID: %s)" % (i, uuid(i)))
        for n, profile in enumerate(state["devices"].get(str(i), [])):
            print("  MIG %-11s Device %2d: (UUID: MIG-%d-%d-%s)" % (profile, n, i, n, profile))
elif "-mig" in args and args[0] != "mig":
    state["mig"][index] = args[args.index("-mig") + 1] == "1"
    save(state)
elif args[:1] == ["mig"] and "-cgi" in args:
    state["devices"][index] = args[args.index("-cgi") + 1].split(",")
    save(state)
elif args[:1] == ["mig"] and ("-dgi" in args or "-dci" in args):
    state["devices"][index] = []
    save(state)
elif "-r" in args:
    print("GPU %s was successfully reset." % index)
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
_UNIT = "[Unit]\nDescription={name} (stand-in)\n[Service]\nExecStart=/bin/sleep infinity\n"
_UNIT += "[Install]\nWantedBy=multi-user.target\n"

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


def build_repo(out: Path, kernel: str | None = None) -> None:
    """A flat apt repository (Packages index) of the stand-ins in `out`; with `kernel` (a
    booted machine's `uname -r`), the headers a driver install asks for first."""
    out.mkdir(parents=True, exist_ok=True)
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
        smi = _NVIDIA_SMI.replace("@DRIVER@", version).replace("@MODULE@", MODULE_VERSION_FILE)
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
                    _UNIT.format(name="nvidia-persistenced"),
                    0o644,
                ),
            },
            # ldconfig: what the real library package's trigger runs.
            postinst=f"mkdir -p {MODULE_DIR}; echo {version} > {MODULE_VERSION_FILE}; ldconfig",
        )
    _package(
        out,
        "nvidia-fabricmanager-580",
        f"{DRIVER}-1",
        {
            "/lib/systemd/system/nvidia-fabricmanager.service": (
                _UNIT.format(name="fabricmanager"),
                0o644,
            )
        },
    )
    _package(
        out,
        "libnvidia-nscq-580",
        f"{DRIVER}-1",
        {"/usr/share/doc/libnvidia-nscq-580/x": ("", 0o644)},
    )
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
