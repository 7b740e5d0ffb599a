"""VMs for the node tests: QEMU guests on a bridge inside a network namespace the test creates.

The namespace holds one bridge with the test's own address (`HOST`) and an "outside" address
(`OUTSIDE`), and one tap device per VM; nothing else is attached, so the guests reach each other
and those two addresses only. QEMU and every SSH command run inside the namespace. The SSH key
is generated per bed. KVM is probed briefly (nested KVM hangs in early boot on some machines)
and TCG is the fallback; `DENV_VM_ACCEL=tcg|kvm` skips the probe.

A VM started `behind_nat` sits on a LAN of its own (`NAT_SUBNET`) behind a NAT router, a second
namespace made with the first such VM: its public leg is `NAT_ADDRESS` on the bridge, and it
masquerades what the LAN sends there. Nothing on the bridge can open a connection into the LAN,
except the test's own address, which has a route through the router, as a deployer on the
office's LAN would; that is how SSH reaches such a VM.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from denv_iac.node.deploy import BOOT_ID
from tests.vm.image import Image, vm_disk

SUBNET = "10.77.0"
HOST = f"{SUBNET}.1"
OUTSIDE = f"{SUBNET}.254"
NAT_SUBNET = "192.168.77"
NAT_ADDRESS = f"{SUBNET}.250"  # the NAT router's public address: what the bridge sees of the LAN
NAT_LINK = "nat-wan"  # the router's port on the bridge (in the bed's namespace): the LAN's uplink
BOOT_TIMEOUT_S = 300.0
_KVM_PROBE_S = 12.0
_accel: str | None = None


def missing_tools() -> list[str]:
    """What this machine lacks to run VMs (empty when nothing)."""
    tools = ("qemu-system-x86_64", "debootstrap", "mkfs.ext4", "debugfs", "ssh", "ssh-keygen", "ip")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (network namespaces and taps)")
    if not Path("/dev/net/tun").exists():
        missing.append("/dev/net/tun")
    return missing


def accel(image: Image) -> str:
    """`kvm` when a guest kernel gets through early boot under KVM within seconds, else `tcg`."""
    global _accel
    if _accel is None:
        forced = os.environ.get("DENV_VM_ACCEL", "")
        if forced in ("kvm", "tcg"):
            _accel = forced
        elif not os.access("/dev/kvm", os.R_OK | os.W_OK):
            _accel = "tcg"
        else:
            _accel = "kvm" if _kvm_boots(image) else "tcg"
    return _accel


def _kvm_boots(image: Image) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        console = Path(tmp) / "console"
        argv = [
            "qemu-system-x86_64", "-accel", "kvm", "-cpu", "host", "-m", "256", "-no-reboot",
            "-display", "none", "-monitor", "none", "-serial", f"file:{console}",
            "-kernel", str(image.kernel), "-initrd", str(image.initrd),
            "-append", "console=ttyS0 panic=-1",
        ]  # fmt: skip
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _KVM_PROBE_S
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                if console.exists() and "Run /init as init process" in console.read_text(
                    errors="replace"
                ):
                    return True
                time.sleep(0.5)
            return False
        finally:
            proc.kill()
            proc.wait()


# The NAT router: the LAN's traffic leaves masqueraded as NAT_ADDRESS; from the bridge, only
# answers and the deployer's own connections (from HOST) get in.
_NAT_RULES = f"""table ip denv_bed_nat {{
  chain postrouting {{ type nat hook postrouting priority srcnat; oifname "wan" masquerade; }}
  chain forward {{
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan0" accept
    iifname "wan" ip saddr {HOST} accept
  }}
}}
"""


@dataclass
class Vm:
    bed: Bed
    name: str
    address: str  # where SSH reaches it (on the NAT's LAN when behind NAT)
    proc: subprocess.Popen[bytes]
    console: Path
    behind_nat: bool = False
    tap: str = ""  # its port on its bridge (the bed's namespace, or the NAT router's)
    argv: list[str] = field(default_factory=list)  # how QEMU was started: again on power-on

    def ssh_args(self, *command: str) -> list[str]:
        return [
            "ip", "netns", "exec", self.bed.netns, "ssh", "-i", str(self.bed.key), "-F", "none",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            "-o", "ControlMaster=auto", "-o", f"ControlPath={self.bed.workdir}/ssh-%h",
            "-o", "ControlPersist=120", f"root@{self.address}", *command,
        ]  # fmt: skip

    def ssh(self, command: str, timeout: float = 120.0, check: bool = True) -> str:
        """Run a shell command in the VM as root; its stdout (CalledProcessError on failure)."""
        done = subprocess.run(
            self.ssh_args(command), capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
        return done.stdout

    def wait_ssh(self, timeout: float = BOOT_TIMEOUT_S) -> float:
        """Seconds until an SSH login works (the VM's console tail in the error otherwise)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: QEMU exited: {self.console_tail()}")
            try:
                probe = subprocess.run(self.ssh_args("true"), capture_output=True, timeout=15)
                if probe.returncode == 0:
                    return time.monotonic() - start
            except subprocess.TimeoutExpired:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name}: no SSH after {timeout:.0f} s: {self.console_tail()}")

    def boot_id(self) -> str:
        return self.ssh(f"cat {BOOT_ID}").strip()

    def close_shared_connection(self) -> None:
        """Close the SSH connection that commands share: after a reboot or a power-off it would
        answer from the old boot, then hang once that is gone."""
        *options, login = self.ssh_args()
        subprocess.run([*options, "-O", "exit", login], capture_output=True, timeout=30)

    def power_cycle(self) -> float:
        """Power the VM off, then start it again from its own disk and return at once, as a
        cloud reports a new instance running: nothing is waited for. When QEMU started."""
        self.ssh("systemctl poweroff", check=False)
        self.close_shared_connection()
        try:
            self.proc.wait(timeout=BOOT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"{self.name}: still running {BOOT_TIMEOUT_S:.0f} s after poweroff:"
                f" {self.console_tail()}"
            ) from None
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return time.monotonic()

    def reboot(self) -> float:
        """Reboot the VM and wait until SSH answers from the new boot; when the reboot began."""
        before = self.boot_id()
        self.ssh("systemctl reboot", check=False)
        start = time.monotonic()
        # Ask each time over a connection of its own until the new boot answers.
        self.close_shared_connection()
        own = [
            "ControlPath=none" if arg.startswith("ControlPath=") else arg
            for arg in self.ssh_args(f"cat {BOOT_ID}")
        ]
        while time.monotonic() - start < BOOT_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: QEMU exited: {self.console_tail()}")
            try:
                done = subprocess.run(own, capture_output=True, text=True, timeout=30)
                if done.returncode == 0 and done.stdout.strip() not in ("", before):
                    return start
            except subprocess.TimeoutExpired:
                pass
            time.sleep(2)
        raise TimeoutError(
            f"{self.name}: no SSH from a new boot after {BOOT_TIMEOUT_S:.0f} s:"
            f" {self.console_tail()}"
        )

    def console_tail(self, lines: int = 15) -> str:
        text = self.console.read_text(errors="replace") if self.console.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])


@dataclass
class Bed:
    """A network namespace with a bridge, a per-bed SSH key, and the VMs started on it."""

    image: Image
    workdir: Path
    netns: str = field(default_factory=lambda: f"denv-vm-{os.getpid()}")
    vms: list[Vm] = field(default_factory=list)
    nat_netns: str | None = None  # the NAT router's namespace, made with the first VM behind it

    @property
    def key(self) -> Path:
        return self.workdir / "id_ed25519"

    def __enter__(self) -> Bed:
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True
        )
        self._ip("netns", "add", self.netns)
        try:
            for args in (
                ("link", "set", "lo", "up"),
                ("link", "add", "br0", "type", "bridge"),
                ("addr", "add", f"{HOST}/24", "dev", "br0"),
                ("addr", "add", f"{OUTSIDE}/24", "dev", "br0"),
                ("link", "set", "br0", "up"),
            ):
                self._ip("-n", self.netns, *args)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for vm in self.vms:
            if vm.proc.poll() is None:
                vm.proc.send_signal(signal.SIGKILL)
                vm.proc.wait()
        if self.nat_netns is not None:
            subprocess.run(["ip", "netns", "del", self.nat_netns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def netns_run(self, *command: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A command run inside the bed's namespace (the test's side of the bridge)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, *command],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def netns_run_input(
        self, command: list[str], stdin: str, cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """A command run inside the namespace with `stdin` as its input."""
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, *command],
            input=stdin,
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=timeout,
        )

    def _nat_router(self) -> str:
        """The NAT router's namespace: `wan` on the bridge, `lan0` the LAN's bridge; made once."""
        if self.nat_netns is not None:
            return self.nat_netns
        self.nat_netns = router = f"{self.netns}-nat"
        self._ip("netns", "add", router)
        bed_side: tuple[tuple[str, ...], ...] = (
            ("link", "add", NAT_LINK, "type", "veth", "peer", "name", "wan", "netns", router),
            ("link", "set", NAT_LINK, "master", "br0", "up"),
            ("route", "add", f"{NAT_SUBNET}.0/24", "via", NAT_ADDRESS),
        )
        for args in bed_side:
            self._ip("-n", self.netns, *args)
        for args in (
            ("link", "set", "lo", "up"),
            ("addr", "add", f"{NAT_ADDRESS}/24", "dev", "wan"),
            ("link", "set", "wan", "up"),
            ("link", "add", "lan0", "type", "bridge"),
            ("addr", "add", f"{NAT_SUBNET}.1/24", "dev", "lan0"),
            ("link", "set", "lan0", "up"),
        ):
            self._ip("-n", router, *args)
        for command in (["sysctl", "-qw", "net.ipv4.ip_forward=1"], ["nft", "-f", "-"]):
            done = subprocess.run(
                ["ip", "netns", "exec", router, *command],
                input=_NAT_RULES,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} in {router}: {done.stderr.strip()}")
        return router

    def start(self, name: str, memory_mb: int = 1024, behind_nat: bool = False) -> Vm:
        """Boot a VM from a fresh copy of the image; call `wait_ssh` on it. Behind NAT, it sits
        on the NAT router's LAN with a default route through it."""
        index = len(self.vms) + 11
        netns, bridge, address, route = self.netns, "br0", f"{SUBNET}.{index}", ""
        if behind_nat:
            netns, bridge = self._nat_router(), "lan0"
            address, route = f"{NAT_SUBNET}.{index}", f"    gateway {NAT_SUBNET}.1\n"
        tap = f"tap{index}"
        self._ip("-n", netns, "tuntap", "add", tap, "mode", "tap")
        self._ip("-n", netns, "link", "set", tap, "master", bridge, "up")
        files = {
            "/root/.ssh/authorized_keys": (self.key.with_suffix(".pub").read_text(), 0o600),
            "/etc/hostname": (f"{name}\n", 0o644),
            "/etc/hosts": (f"127.0.0.1 localhost\n127.0.1.1 {name}\n", 0o644),
            "/etc/network/interfaces": (
                "auto lo\niface lo inet loopback\n\n"
                f"auto eth0\niface eth0 inet static\n    address {address}/24\n{route}",
                0o644,
            ),
        }
        disk = vm_disk(self.image, self.workdir / f"{name}.img", files)
        console = self.workdir / f"{name}.console"
        mode = accel(self.image)
        cpu = ["-cpu", "host"] if mode == "kvm" else []
        argv = [
            "ip", "netns", "exec", netns, "qemu-system-x86_64", "-accel", mode, *cpu,
            "-m", str(memory_mb), "-smp", "1", "-display", "none", "-monitor", "none",
            "-serial", f"file:{console}", "-kernel", str(self.image.kernel),
            "-initrd", str(self.image.initrd),
            "-append", "console=ttyS0 root=/dev/vda rw net.ifnames=0",
            "-drive", f"file={disk},format=raw,if=virtio",
            "-netdev", f"tap,id=n0,ifname={tap},script=no,downscript=no",
            "-device", f"virtio-net-pci,netdev=n0,mac=52:54:00:4d:00:{index:02x}",
        ]  # fmt: skip
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        vm = Vm(self, name, address, proc, console, behind_nat, tap, argv)
        self.vms.append(vm)
        return vm
