"""A bootable Debian 12 VM image built from Debian packages only, cached between test runs.

debootstrap makes the root (Debian's cloud kernel, systemd, sshd, ifupdown, python3), `mkfs.ext4 -d`
writes it into a raw disk image, and the kernel and initrd are copied out for QEMU's direct kernel
boot. Each VM boots a sparse copy of that image into which `debugfs` writes what differs per VM
(the run's SSH key, the host name, the static address), so the cached image is never booted itself.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.build_cache import TEST_CACHE
from tests.node.debian_root import SUITE, debian_mirror

CACHE_DIR = TEST_CACHE / "debian12-vm"
IMAGE_SIZE = "3G"
INCLUDE = (
    "linux-image-cloud-amd64",
    "initramfs-tools",
    "systemd-sysv",
    "udev",
    "dbus",
    "openssh-server",
    "ifupdown",
    "iproute2",
    "python3",
    "python3-venv",
    "ca-certificates",
    "curl",
    "nftables",
)
_FSTAB = "/dev/vda / ext4 rw,errors=remount-ro 0 1\n"
_SSHD = "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUseDNS no\n"


@dataclass(frozen=True)
class Image:
    disk: Path
    kernel: Path
    initrd: Path


def _cached(cache_dir: Path) -> Image:
    return Image(cache_dir / "disk.img", cache_dir / "vmlinuz", cache_dir / "initrd.img")


def ensure_image(cache_dir: Path = CACHE_DIR) -> Image:
    """The cached image, built first if absent (minutes: debootstrap from the Debian archive)."""
    image = _cached(cache_dir)
    if all(path.is_file() for path in (image.disk, image.kernel, image.initrd)):
        return image
    for tool in ("debootstrap", "mkfs.ext4"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building the VM image needs {tool} (run make setup)")
    partial = cache_dir.with_name(cache_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    root = partial / "root"
    root.mkdir(parents=True)
    argv = [
        "debootstrap", "--variant=minbase", f"--include={','.join(INCLUDE)}",
        SUITE, str(root), debian_mirror(),
    ]  # fmt: skip
    subprocess.run(
        argv,
        check=True,
        capture_output=True,
        timeout=1800,
    )
    (root / "etc/fstab").write_text(_FSTAB)
    (root / "etc/ssh/sshd_config.d/denv-test.conf").write_text(_SSHD)
    (root / "root/.ssh").mkdir(mode=0o700, exist_ok=True)
    # No console login prompts to wait for, and no clock sync that cannot reach anything.
    for unit in ("serial-getty@ttyS0.service", "getty@tty1.service"):
        (root / "etc/systemd/system" / unit).unlink(missing_ok=True)
        (root / "etc/systemd/system" / unit).symlink_to("/dev/null")
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    initrds = sorted((root / "boot").glob("initrd.img-*"))
    if not kernels or not initrds:
        raise RuntimeError(f"the VM root has no kernel or initrd under {root / 'boot'}")
    shutil.copy(kernels[-1], partial / "vmlinuz")
    shutil.copy(initrds[-1], partial / "initrd.img")
    disk = partial / "disk.img"
    subprocess.run(["truncate", "-s", IMAGE_SIZE, str(disk)], check=True)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-L", "denv-vm", "-d", str(root), str(disk)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    shutil.rmtree(root)
    shutil.rmtree(cache_dir, ignore_errors=True)
    partial.rename(cache_dir)
    return _cached(cache_dir)


def vm_disk(image: Image, dest: Path, files: dict[str, tuple[str, int]]) -> Path:
    """A sparse copy of the image with `files` (guest path -> (text, mode)) written into it."""
    subprocess.run(["cp", "--sparse=always", str(image.disk), str(dest)], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        commands = []
        for n, (guest_path, (text, mode)) in enumerate(sorted(files.items())):
            source = Path(tmp) / str(n)
            source.write_text(text)
            commands += [
                f"rm {guest_path}",
                f"write {source} {guest_path}",
                f"sif {guest_path} mode 0{0o100000 | mode:o}",
                f"sif {guest_path} uid 0",
                f"sif {guest_path} gid 0",
            ]
        script = Path(tmp) / "debugfs.cmd"
        script.write_text("\n".join(commands) + "\n")
        subprocess.run(
            ["debugfs", "-w", "-f", str(script), str(dest)], check=True, capture_output=True
        )
    return dest
