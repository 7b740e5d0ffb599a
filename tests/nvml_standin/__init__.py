"""The stand-in libnvidia-ml.so.1 (nvml_standin.c): built with the machine's C compiler once per
source and driver version, and the fault file a test writes to script it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("nvml_standin.c")
BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "nvml-standin"
LIBRARY = "libnvidia-ml.so.1"
# Below the stand-in's root ($DENV_NVML_STANDIN_ROOT, "/" on a VM), as nvml_standin.c reads them.
MODULE_VERSION = "var/lib/nvidia-standin/module-version"
FAULTS = "var/lib/nvidia-standin/nvml-faults"
MIG_MODE = "var/lib/nvidia-standin/state.json"  # MIG mode: kept across a reboot, as a GPU keeps it
MIG_INSTANCES = "run/nvidia-standin/mig.json"  # GPU instances: gone at reboot, as real ones are
# Held open by every NVML client and NVIDIA daemon, as /dev/nvidiactl is: a reset is refused then.
DEVICE = "run/nvidia-standin/nvidiactl"


def build(driver: str) -> Path:
    """The folder holding libnvidia-ml.so.1 that reports `driver` (for LD_LIBRARY_PATH)."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + driver.encode()).hexdigest()[:16]
    folder = BUILD_DIR / f"{driver}-{digest}"
    if (folder / LIBRARY).is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    # Built beside and renamed into place: a concurrent build never loads half a file.
    fd, partial = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    flags = ["-shared", "-fPIC", "-O2", "-Wall", "-Werror", f'-DSTANDIN_DRIVER="{driver}"']
    done = subprocess.run(
        ["gcc", *flags, "-o", partial, str(SOURCE), "-lpthread"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        os.unlink(partial)
        raise RuntimeError(f"building the NVML stand-in failed: {done.stderr.strip()}")
    os.replace(partial, folder / LIBRARY)
    return folder


def set_faults(root: Path, *lines: str) -> None:
    """Replace the fault file below `root` with these lines (none: a healthy machine)."""
    path = root / FAULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text("".join(f"{line}\n" for line in lines))
    # Atomic, so a call never reads half a file.
    partial.replace(path)
