"""The local data plane's processes on this machine: where they run (a Host: the loopback
address, or a network namespace's), the ports they take, the marks in their command lines that
tell them from any other process, and how soon one that died is restarted."""

import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from denv_iac.local.command_replica import REPLICA_ENV
from denv_iac.waits import wait_until

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Host:
    """Where processes of the data plane run: the address they listen on, and the command
    prefix that starts a process there (`ip netns exec NAME` for a network namespace)."""

    address: str = HOST
    prefix: tuple[str, ...] = ()


LOOPBACK = Host()
# Ports are drawn from below the range the kernel takes outgoing connections' own ports
# from: a port drawn there (as binding to port 0 does) may be taken by any connection made
# before its process binds it, and an endpoint once failed to start so ("Address already in
# use"). Each draw is checked by binding it, and no port is handed out twice by one process.
LOWEST_PORT = 10000
OUTGOING_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_FIRST_OUTGOING_PORT = 32768
_DRAWS = 1000
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
# Its own generator, not the shared one: a test runner that seeds `random` would otherwise
# have two processes draw the same ports in the same order.
_CHOOSER = random.SystemRandom()


def first_outgoing_port() -> int:
    try:
        return int(OUTGOING_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_FIRST_OUTGOING_PORT


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now, below the kernel's range for outgoing connections, and never handed
    out before by this process."""
    top = first_outgoing_port()
    if top <= LOWEST_PORT:
        raise RuntimeError(
            f"{OUTGOING_PORTS} starts at {top}: leave the ports from {LOWEST_PORT} up to "
            f"{LINUX_FIRST_OUTGOING_PORT} to listeners (sysctl net.ipv4.ip_local_port_range)"
        )
    with _HANDED_OUT_LOCK:
        for _ in range(_DRAWS):
            port = _CHOOSER.randrange(LOWEST_PORT, top)
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError(f"no free port found in {_DRAWS} draws from {LOWEST_PORT}-{top - 1}")


def endpoint_in_use(port: int, address: str = HOST) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((address, port)) == 0


def wait_for_port(port: int, what: str, address: str = HOST, timeout_s: float = 10.0) -> None:
    def closed(_: bool) -> RuntimeError:
        return RuntimeError(f"{what} did not open {address}:{port} within {timeout_s:.0f} s")

    wait_until(
        lambda: endpoint_in_use(port, address),
        bool,
        timeout_s=timeout_s,
        interval_s=0.02,
        timed_out=closed,
    )


# What the command lines of the processes we start contain, and no other command line does.
HAPROXY_MARK = "haproxy -W -f "
AGENT_MARK = "-m denv_agent --config "
REPLICA_MARK = "-m denv_iac.local.replica_sim --id="


def ours(pid: int, marker: str) -> bool:
    """Whether `pid` still runs one of our commands (a recycled pid must not be signalled): its
    command line holds `marker`; for a recipe's own command, its environment holds it."""
    environment = marker.startswith(f"{REPLICA_ENV}=")
    try:
        raw = Path(f"/proc/{pid}/{'environ' if environment else 'cmdline'}").read_bytes()
    except OSError:
        return False
    if environment:
        return marker.encode() in raw.split(b"\0")
    return marker in raw.replace(b"\0", b" ").decode(errors="replace")


# Restarts of a supervised process that died: the first at once, then each one that follows
# soon after doubles the wait, up to a ceiling, so a process that dies at start cannot spin.
RESTART_FIRST_S = 0.1
RESTART_CEILING_S = 5.0
# A process that stayed up this long starts over at the first wait.
RESTART_STABLE_S = 10.0


@dataclass
class RestartBackoff:
    """When a supervised process may be restarted next."""

    wait_s: float = 0.0
    not_before: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0

    def due(self, now: float) -> bool:
        return now >= self.not_before

    def restarted(self, now: float) -> None:
        stable = now - self.started_at >= RESTART_STABLE_S
        self.wait_s = (
            RESTART_FIRST_S
            if stable or not self.wait_s
            else min(self.wait_s * 2, RESTART_CEILING_S)
        )
        self.not_before = now + self.wait_s
        self.started_at = now
        self.restarts += 1
