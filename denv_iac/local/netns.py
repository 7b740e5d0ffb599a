"""Sites in network namespaces: the local data plane spread over links that can be cut.

NetnsLab makes one network namespace for the balancer and one per site, each site joined to
the balancer's namespace by a veth pair of its own (the site at 10.231.N.2, the balancer's end
at 10.231.N.1; HAProxy listens on 10.231.0.1). Nothing is added to this machine's own
namespace, so labs running side by side do not meet. NetnsCluster is the local runner on
them: each site's replicas and agents run in the site's namespace (`ip netns exec`), HAProxy
in the balancer's. Whatever talks to them (the load client, fault injection, the replicas'
request logs) runs through `lab.call`, in a thread that has joined the balancer's namespace.

Faults, on a site's link: `cut` takes it down (packets vanish: no reset, no ICMP), `lose`
drops a share of the packets through it with nftables (this kernel has no `netem`), and a
cluster started with `slow_sites` puts a delaying TCP proxy (denv_iac.local.delay_proxy)
where HAProxy reaches that site, for `delay` to slow it.

Every name starts with `denvnet-<pid>-`: a namespace left by a run that died (its pid gone)
is removed, with the processes in it, when the next lab starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import ParamSpec, TypeVar

from denv_iac.core.balancer.model import BalancerSettings
from denv_iac.core.stack.model import StackSpec
from denv_iac.local.delay_proxy import DelayProxyProcess
from denv_iac.local.processes import Host, free_port
from denv_iac.local.run_state import AgentState, ReplicaState, RunState
from denv_iac.local.runner import LocalCluster, Progress
from denv_iac.local.slow_link import SlowLink
from denv_iac.waits import wait_until_or_last

PREFIX = "denvnet-"
BALANCER_ADDRESS = "10.231.0.1"
SITE_DEVICE = "uplink"  # a site's end of its link, in the site's namespace
LOSS_TABLE = "denv_loss"
MAX_SITES = 254  # one /24 of 10.231.0.0/16 each

_CLONE_NEWNET = 0x40000000
_P = ParamSpec("_P")
_T = TypeVar("_T")


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces; the message says why."""


def unavailable_reason() -> str | None:
    """Why no lab can start here, or None when one can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install {package}; make setup does)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"`ip netns` fails here: {probe.stderr.strip()}"
    return None


def owner_pid(namespace: str) -> int | None:
    """The pid of the process whose lab made `namespace`; None for a name not ours."""
    if not namespace.startswith(PREFIX):
        return None
    head = namespace[len(PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def pids_in(namespace: str) -> list[int]:
    listed = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
    )
    return [int(pid) for pid in listed.stdout.split() if int(pid) != os.getpid()]


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_namespace(namespace: str, timeout_s: float = 5.0) -> None:
    """Kill what still runs in `namespace` (only processes its lab started run there), then
    delete it; the veth ends in it go with it, and their peers with them."""
    pids = pids_in(namespace)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # Past the wait the namespace goes anyway: what still runs in it is killed already.
    wait_until_or_last(
        lambda: any(running(pid) for pid in pids),
        lambda alive: not alive,
        timeout_s=timeout_s,
        interval_s=0.02,
    )
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, check=False)


def remove_leftovers() -> list[str]:
    """Remove the namespaces of labs whose process is gone; returns their names."""
    left = [ns for ns in namespaces() if (pid := owner_pid(ns)) is not None and not _alive(pid)]
    for namespace in left:
        remove_namespace(namespace)
    return left


def _join(namespace: str) -> None:
    """Move the calling thread (only it) into `namespace`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def call_in(namespace: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run `fn` in a thread of its own inside `namespace` and return what it returns.

    Sockets it opens, threads and processes it starts are in that namespace too.
    """
    outcome: list[tuple[_T, None] | tuple[None, BaseException]] = []

    def body() -> None:
        try:
            _join(namespace)
            outcome.append((fn(*args, **kwargs), None))
        except BaseException as error:  # handed to the caller's thread below
            outcome.append((None, error))

    thread = threading.Thread(target=body, name=f"in {namespace}", daemon=True)
    thread.start()
    thread.join()
    value, error = outcome[0]
    if error is not None:
        raise error
    return value  # type: ignore[return-value]  # no error: fn returned it


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class SiteLink:
    """One site's namespace and its link to the balancer's."""

    site: str
    namespace: str
    address: str  # the site's own address, on its end of the link
    balancer_end: str  # the balancer's address on this link
    balancer_device: str  # the link's device in the balancer's namespace


def plan_links(tag: str, sites: Sequence[str]) -> dict[str, SiteLink]:
    if len(sites) > MAX_SITES:
        raise ValueError(f"a lab holds at most {MAX_SITES} sites, not {len(sites)}")
    return {
        site: SiteLink(site, f"{tag}-s{n}", f"10.231.{n}.2", f"10.231.{n}.1", f"site{n}")
        for n, site in enumerate(sites, 1)
    }


class NetnsLab:
    """The namespaces and links of one run; a context manager that always removes them.

    A site in `round_trips` is far: its link is a SlowLink, on which every packet, the
    handshake's included, takes half the round trip (in ms) each way.
    """

    def __init__(self, sites: Sequence[str], round_trips: Mapping[str, float] = {}) -> None:
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.balancer_namespace = f"{tag}-lb"
        self.links = plan_links(tag, sites)
        unknown = sorted(set(round_trips) - set(self.links))
        if unknown:
            raise ValueError(f"round_trips: {', '.join(unknown)} is no site of the lab")
        self.round_trips = dict(round_trips)
        self._made: list[str] = []
        self._slow_links: list[SlowLink] = []

    @property
    def made(self) -> list[str]:
        """The namespaces this lab has made and not yet removed."""
        return list(self._made)

    def __enter__(self) -> NetnsLab:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        remove_leftovers()
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()

    def _make(self) -> None:
        balancer = self.balancer_namespace
        self._add_namespace(balancer)
        _ip("-n", balancer, "address", "add", f"{BALANCER_ADDRESS}/32", "dev", "lo")
        for link in self.links.values():
            self._add_namespace(link.namespace)
            if link.site in self.round_trips:
                slow = SlowLink(
                    link.namespace,
                    SITE_DEVICE,
                    balancer,
                    link.balancer_device,
                    self.round_trips[link.site],
                )
                self._slow_links.append(slow)  # before start: remove() stops it either way
                slow.start()
            else:
                # Made straight inside both namespaces: neither end ever shows in this one.
                _ip(
                    *("link", "add", SITE_DEVICE, "netns", link.namespace, "type", "veth"),
                    *("peer", "name", link.balancer_device, "netns", balancer),
                )
            _ip("-n", link.namespace, "address", "add", f"{link.address}/24", "dev", SITE_DEVICE)
            _ip(
                "-n",
                balancer,
                "address",
                "add",
                f"{link.balancer_end}/24",
                "dev",
                link.balancer_device,
            )
            _ip("-n", link.namespace, "link", "set", SITE_DEVICE, "up")
            _ip("-n", balancer, "link", "set", link.balancer_device, "up")

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._made.append(namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")

    def remove(self) -> None:
        for slow in self._slow_links:
            slow.stop()
        self._slow_links.clear()
        for namespace in reversed(self._made):
            remove_namespace(namespace)
        self._made.clear()

    def host(self, site: str) -> Host:
        link = self.links[site]
        return Host(link.address, ("ip", "netns", "exec", link.namespace))

    @property
    def balancer_host(self) -> Host:
        return Host(BALANCER_ADDRESS, ("ip", "netns", "exec", self.balancer_namespace))

    def call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run `fn` from the balancer's namespace, where every site can be reached."""
        return call_in(self.balancer_namespace, fn, *args, **kwargs)

    def cut(self, site: str) -> None:
        """Take the site's link down: its packets vanish, nobody gets a reset."""
        _ip("-n", self.links[site].namespace, "link", "set", SITE_DEVICE, "down")

    def heal(self, site: str) -> None:
        _ip("-n", self.links[site].namespace, "link", "set", SITE_DEVICE, "up")

    def lose(self, site: str, percent: int) -> None:
        """Drop `percent` of the packets on the site's link, each way, at random (traffic
        inside the site, such as its agent's probes, is spared)."""
        if not 0 < percent < 100:
            raise ValueError(f"percent: {percent} is not between 1 and 99")
        drop = f"numgen random mod 100 < {percent} drop"
        ruleset = (
            f"table inet {LOSS_TABLE} {{\n"
            "  chain input { type filter hook input priority 0; "
            f'iifname "{SITE_DEVICE}" {drop}; }}\n'
            "  chain output { type filter hook output priority 0; "
            f'oifname "{SITE_DEVICE}" {drop}; }}\n'
            "}\n"
        )
        command = ["ip", "netns", "exec", self.links[site].namespace, "nft", "-f", "-"]
        done = subprocess.run(command, input=ruleset, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"nft in {site}: {done.stderr.strip()}")

    def stop_losing(self, site: str) -> None:
        namespace = self.links[site].namespace
        _ip("netns", "exec", namespace, "nft", "delete", "table", "inet", LOSS_TABLE)


class NetnsCluster(LocalCluster):
    """The local data plane with each site in its lab namespace and HAProxy in the balancer's.

    HAProxy reaches each site in `slow_sites` through a delay proxy on the balancer's end of
    the site's link, which `delay` slows.
    """

    def __init__(
        self,
        stack: StackSpec,
        directory: Path,
        lab: NetnsLab,
        port: int | None = None,
        slow_sites: Sequence[str] = (),
    ) -> None:
        hosts = {site: lab.host(site) for site in lab.links}
        super().__init__(stack, directory, port, hosts, lab.balancer_host)
        self.lab = lab
        self.slow_sites = tuple(slow_sites)
        self._proxies: dict[str, DelayProxyProcess] = {}

    def up(self, progress: Progress = lambda _: None) -> RunState:
        return self.lab.call(super().up, progress)

    def _start_haproxy(
        self, replicas: list[ReplicaState], agents: list[AgentState], progress: Progress
    ) -> RunState:
        for site in self.slow_sites:
            link = self.lab.links[site]
            mine = [r for r in replicas if r.site == site]
            ports = sorted({r.port for r in mine} | {r.agent_port for r in mine})
            proxy = DelayProxyProcess(
                link.balancer_end,
                link.address,
                ports,
                self.balancer.prefix,
                # The runner's HAProxy keeps the default connect timeout; the proxy takes it on.
                connect_timeout_ms=BalancerSettings.connect_timeout_ms,
            )
            self._proxies[site] = proxy  # before start: down() stops a half-started one too
            proxy.start()
        return super()._start_haproxy(replicas, agents, progress)

    def _server_address(self, replica: ReplicaState) -> str:
        if replica.site in self.slow_sites:
            return self.lab.links[replica.site].balancer_end
        return replica.address

    def delay(self, site: str, one_way_ms: float) -> None:
        """Delay every byte between the balancer and `site` by `one_way_ms`, each way."""
        self._proxies[site].set_delay(one_way_ms)

    @property
    def pids(self) -> list[int]:
        """Every process this cluster started and still holds."""
        state = self.state
        held = [p.pid for p in self._proxies.values() if p.pid is not None]
        if state is not None:
            held += [state.haproxy_pid, *(a.pid for a in state.agents)]
            held += [r.pid for r in state.replicas]
        return held

    def down(self) -> None:
        super().down()
        for proxy in self._proxies.values():
            proxy.stop()


@contextlib.contextmanager
def running_in_netns(
    stack: StackSpec,
    directory: Path,
    slow_sites: Sequence[str] = (),
    round_trips: Mapping[str, float] | None = None,
) -> Iterator[NetnsCluster]:
    """A lab with one namespace per site of `stack` and the stack's data plane up in it.

    A site is far (a SlowLink) by `round_trips`, by default the round trips the stack states
    (a site at 0 is near). Whatever happens inside, every process is stopped and every
    namespace removed.
    """
    if round_trips is None:
        round_trips = {s.name: s.round_trip_ms for s in stack.sites if s.round_trip_ms}
    with NetnsLab([site.name for site in stack.sites], round_trips) as lab:
        cluster = NetnsCluster(stack, directory, lab, free_port(), slow_sites)
        try:
            cluster.up()
            yield cluster
        finally:
            cluster.down()
