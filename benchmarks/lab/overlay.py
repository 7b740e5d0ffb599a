"""The overlay on a namespace lab: wireguard-go on both ends of a site's link, a capture on it.

This machine's kernel has no WireGuard module, so wg-quick falls back to wireguard-go, the
userspace implementation, exactly as it does on a host without the module. Each end is configured
from the overlay's own rendered config (`render_config` + `with_private_key`), written where
`ip netns exec` shows it as /etc/wireguard inside that namespace only (/etc/netns/NAME/wireguard).
Interface names are per process (wireguard-go's control sockets live in one shared
/var/run/wireguard), and what a run that died left behind is removed when the next one starts.

Used by the data-path test and the overlay benchmark.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from denv_iac.components.overlay import new_key_pair
from denv_iac.core.overlay_plan import (
    OverlayMember,
    OverlayPlan,
    allocate,
    render_config,
    with_private_key,
)
from denv_iac.core.stack.model import OverlaySpec, StackSpec
from denv_iac.core.stack.reader import read_stack
from denv_iac.local.netns import (
    PREFIX,
    SITE_DEVICE,
    NetnsCluster,
    NetnsLab,
    call_in,
    owner_pid,
    running,
)
from denv_iac.local.netns import unavailable_reason as netns_unavailable
from denv_iac.local.processes import Host, free_port

NETNS_ETC = Path("/etc/netns")
WIREGUARD_RUN = Path("/var/run/wireguard")
HUB = "lab:balancer"
ETH_P_ALL = 0x0003
WG_QUICK_TIMEOUT_S = 20
NAT_TABLE = "denv_nat"


def nat_rules(port: int) -> str:
    """A NAT's inbound rule for the WireGuard port: only datagrams answering a flow the site
    started get in (the plain path, the baseline the overlay is measured against, stays open)."""
    return (
        f"table inet {NAT_TABLE} {{\n"
        "  chain input { type filter hook input priority 0; "
        f'iifname "{SITE_DEVICE}" udp dport {port} ct state new counter drop; }}\n'
        "}\n"
    )


SITE = "office"
# One simulated replica that answers at once: what the overlay adds is all there is to see.
STACK = {
    "denv:sites": [
        {"name": SITE, "kind": "local", "nodes": [{"name": "n0", "gpu": "H100", "gpus": 1}]}
    ],
    "denv:recipes": [
        {
            "name": "voice",
            "min_warm": 1,
            "spare": 0,
            "sites": [SITE],
            "simulate": {"ttft_ms": 0, "itl_ms": 1, "tokens": 3},
        }
    ],
    "denv:balancer": {"sites": [SITE]},
}


def unavailable_reason() -> str | None:
    """Why the overlay lab cannot run here (no root, no netns, no WireGuard tools), or None."""
    reason = netns_unavailable()
    if reason is not None:
        return reason
    for tool, package in (("wg-quick", "wireguard-tools"), ("wireguard-go", "wireguard-go")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install {package}; make setup does)"
    if not Path("/etc/wireguard").is_dir():
        return "/etc/wireguard is missing (wireguard-tools makes it)"
    return None


def _interface(role: str) -> str:
    return f"dv{role}{os.getpid()}"  # at most 10 characters of Linux's 15


def remove_leftovers() -> None:
    """Config folders and control sockets of runs whose process is gone."""
    for folder in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else ():
        pid = owner_pid(folder.name)
        if pid is not None and not running(pid):
            shutil.rmtree(folder, ignore_errors=True)
    for sock in WIREGUARD_RUN.glob("dv[bs]*.sock") if WIREGUARD_RUN.is_dir() else ():
        digits = sock.stem[3:]
        if digits.isdigit() and not running(int(digits)):
            sock.unlink(missing_ok=True)


def _run(command: list[str]) -> None:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=WG_QUICK_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()[-500:]}")


@dataclass
class OverlayLink:
    """The overlay between the lab's balancer namespace and one site's namespace."""

    lab: NetnsLab
    site: str
    # The site behaves as behind NAT: no WireGuard flow may start from the link, so only the
    # node's own handshakes and keepalives (and their answers) pass.
    behind_nat: bool = False
    plan: OverlayPlan = field(init=False)
    _up: list[tuple[str, str]] = field(default_factory=list)  # (namespace, interface)

    def __post_init__(self) -> None:
        link = self.lab.links[self.site]
        node = f"{self.site}.n0"
        spec = OverlaySpec()
        addresses = allocate(spec.cidr, [HUB, node])
        self.plan = OverlayPlan(
            spec,
            (
                OverlayMember(HUB, "lab", addresses[HUB], link.balancer_end, True, False),
                OverlayMember(
                    node, self.site, addresses[node], link.address, False, True, self.behind_nat
                ),
            ),
        )
        self.node = node

    @property
    def node_address(self) -> str:
        return self.plan.member(self.node).address

    def __enter__(self) -> OverlayLink:
        remove_leftovers()
        try:
            self._bring_up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _bring_up(self) -> None:
        if self.behind_nat:
            site = self.lab.links[self.site].namespace
            command = ["ip", "netns", "exec", site, "nft", "-f", "-"]
            rules = nat_rules(self.plan.spec.port)
            done = subprocess.run(command, input=rules, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"nft in {self.site}: {done.stderr.strip()}")
        pairs = {m.name: new_key_pair() for m in self.plan.members}
        public = {name: pair[1] for name, pair in pairs.items()}
        where = {m.name: m.public_address for m in self.plan.members}
        ends = (
            (self.lab.balancer_namespace, HUB, _interface("b")),
            (self.lab.links[self.site].namespace, self.node, _interface("s")),
        )
        for namespace, member, interface in ends:
            folder = NETNS_ETC / namespace / "wireguard"
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)
            text = render_config(self.plan, member, public, where)
            path = folder / f"{interface}.conf"
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(with_private_key(text, pairs[member][0]))
            self._up.append((namespace, interface))
            _run(["ip", "netns", "exec", namespace, "wg-quick", "up", interface])

    def reload(self) -> None:
        """What `systemctl reload wg-quick@IF` runs: syncconf from the stripped file."""
        for namespace, interface in self._up:
            script = f"wg syncconf {interface} <(wg-quick strip {interface})"
            _run(["ip", "netns", "exec", namespace, "bash", "-c", script])

    def close(self) -> None:
        for namespace, interface in reversed(self._up):
            # wg-quick down deletes the interface, and wireguard-go exits with it.
            subprocess.run(
                ["ip", "netns", "exec", namespace, "wg-quick", "down", interface],
                capture_output=True,
                timeout=WG_QUICK_TIMEOUT_S,
                check=False,
            )
            shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
            (WIREGUARD_RUN / f"{interface}.sock").unlink(missing_ok=True)
        self._up.clear()


class OverlayCluster(NetnsCluster):
    """The site's replicas and agent listen on its overlay address only: HAProxy's server lines,
    health and agent checks all go through the tunnel."""

    def __init__(self, stack: StackSpec, directory: Path, overlay: OverlayLink, port: int) -> None:
        super().__init__(stack, directory, overlay.lab, port)
        prefix = overlay.lab.host(overlay.site).prefix
        self.hosts = {overlay.site: Host(overlay.node_address, prefix)}


class Capture:
    """Every frame through a device of a namespace, read by an AF_PACKET socket until stopped."""

    def __init__(self, namespace: str, device: str) -> None:
        def opened() -> socket.socket:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.bind((device, 0))
            return sock

        self._sock = call_in(namespace, opened)  # the socket stays in that namespace
        self._sock.settimeout(0.05)
        self.frames: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name=f"capture {device}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.frames.append(self._sock.recv(65535))
            except TimeoutError:
                continue

    def stop(self) -> bytes:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        return b"".join(self.frames)

    def udp_payload_bytes(self, port: int) -> int:
        """Bytes of UDP payload to or from `port` (IPv4 over Ethernet) among the frames."""
        total = 0
        for frame in self.frames:
            if len(frame) < 42 or frame[12:14] != b"\x08\x00" or frame[23] != 17:
                continue
            header = (frame[14] & 0x0F) * 4
            udp = frame[14 + header :]
            ports = {int.from_bytes(udp[0:2], "big"), int.from_bytes(udp[2:4], "big")}
            if port in ports:
                total += len(udp) - 8
        return total


@dataclass(frozen=True)
class Streamed:
    status: int
    ttft_s: float
    body: bytes


class Client:
    """One keep-alive connection to the balancer, streaming chat completions; run it inside the
    balancer's namespace (`lab.call`)."""

    def __init__(self, address: str, port: int) -> None:
        self._connection = http.client.HTTPConnection(address, port, timeout=10)

    def stream(self, model: str, prompt: str) -> Streamed:
        payload = json.dumps(
            {"model": model, "stream": True, "messages": [{"role": "user", "content": prompt}]}
        )
        headers = {"Content-Type": "application/json"}
        sent = time.perf_counter()
        self._connection.request("POST", "/v1/chat/completions", payload, headers)
        response = self._connection.getresponse()
        body = b""
        first = None
        while chunk := response.read1(65536):
            body += chunk
            if first is None and b'"content"' in body:
                first = time.perf_counter()
        return Streamed(response.status, (first or time.perf_counter()) - sent, body)

    def close(self) -> None:
        self._connection.close()


@dataclass(frozen=True)
class Lab:
    lab: NetnsLab
    overlay: OverlayLink
    plain: NetnsCluster  # the replica on the link's address
    tunnel: OverlayCluster  # the same stack, its replica on the overlay address


@contextlib.contextmanager
def plain_and_overlay(folder: Path, behind_nat: bool = False) -> Iterator[Lab]:
    """The data plane of STACK up twice on one lab: plain, and over the overlay."""
    stack = read_stack("overlay", STACK)
    with NetnsLab([SITE]) as lab, OverlayLink(lab, SITE, behind_nat) as overlay:
        plain = NetnsCluster(stack, folder / "plain", lab, free_port())
        tunnel = OverlayCluster(stack, folder / "overlay", overlay, free_port())
        try:
            plain.up()
            tunnel.up()
            yield Lab(lab, overlay, plain, tunnel)
        finally:
            tunnel.down()
            plain.down()


def measure_ttft(lab: Lab, pairs: int) -> dict[str, list[float]]:
    """TTFT in seconds of `pairs` streams each way, plain and overlay interleaved so that drift
    and noise hit both alike."""
    address = lab.lab.balancer_host.address

    def measure() -> dict[str, list[float]]:
        clients = {
            "plain": Client(address, lab.plain.port),
            "overlay": Client(address, lab.tunnel.port),
        }
        times: dict[str, list[float]] = {"plain": [], "overlay": []}
        try:
            for n in range(pairs):
                for path in ("plain", "overlay") if n % 2 else ("overlay", "plain"):
                    answer = clients[path].stream("voice", "hello")
                    if answer.status != 200:
                        raise RuntimeError(f"a stream over the {path} path failed: {answer}")
                    times[path].append(answer.ttft_s)
        finally:
            for client in clients.values():
                client.close()
        return times

    return lab.lab.call(measure)


def wg_show(namespace: str, interface: str, what: str) -> str:
    """`wg show INTERFACE WHAT` inside `namespace`."""
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, "wg", "show", interface, what],
        capture_output=True,
        text=True,
        timeout=WG_QUICK_TIMEOUT_S,
        check=True,
    )
    return done.stdout


def hub_interface() -> str:
    return _interface("b")


def nat_dropped(namespace: str) -> int:
    """Packets the NAT rule has stopped so far."""
    listed = subprocess.run(
        ["ip", "netns", "exec", namespace, "nft", "list", "table", "inet", NAT_TABLE],
        capture_output=True,
        text=True,
        timeout=WG_QUICK_TIMEOUT_S,
        check=True,
    )
    found = re.search(r"counter packets (\d+)", listed.stdout)
    return int(found.group(1)) if found else 0
