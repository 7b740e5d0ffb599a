"""The network-namespace harness: links that really cut, delay and lose, and nothing left after."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from denv_iac.core.stack.reader import read_stack
from denv_iac.local.delay_proxy import DelayProxyProcess
from denv_iac.local.netns import (
    PREFIX,
    NetnsLab,
    namespaces,
    owner_pid,
    plan_links,
    running,
    running_in_netns,
)
from denv_iac.local.processes import free_port

STACK = {
    "denv:sites": [
        {"name": site, "kind": "local", "nodes": [{"name": "n0", "gpu": "H100", "gpus": 1}]}
        for site in ("east", "west")
    ],
    "denv:recipes": [
        {
            "name": "voice",
            "min_warm": 2,
            "spare": 0,
            "sites": [["east", "west"]],
            "simulate": {"ttft_ms": 5, "itl_ms": 1, "tokens": 3},
        }
    ],
    "denv:balancer": {"sites": ["east"]},
}


@pytest.mark.parametrize(
    ("namespace", "pid"),
    [
        (f"{PREFIX}4242-a1b2c3-lb", 4242),
        (f"{PREFIX}17-a1b2c3-s1", 17),
        (f"{PREFIX}x17-a1b2c3-s1", None),  # not a pid
        ("denvnet4242-lb", None),  # not our prefix
        ("someone-elses", None),
    ],
)
def test_owner_pid_reads_only_our_names(namespace: str, pid: int | None) -> None:
    assert owner_pid(namespace) == pid


def test_each_site_gets_its_own_subnet_and_namespace() -> None:
    links = plan_links(f"{PREFIX}1-t", ["east", "west"])
    assert [(link.namespace, link.address, link.balancer_end) for link in links.values()] == [
        (f"{PREFIX}1-t-s1", "10.231.1.2", "10.231.1.1"),
        (f"{PREFIX}1-t-s2", "10.231.2.2", "10.231.2.1"),
    ]
    with pytest.raises(ValueError, match="at most 254 sites"):
        plan_links("t", [f"s{n}" for n in range(255)])


def _listening_in(namespace: str, address: str) -> tuple[subprocess.Popen[str], int]:
    """An HTTP server inside `namespace`, and its port."""
    port = free_port()
    server = subprocess.Popen(
        [
            *("ip", "netns", "exec", namespace),
            *(sys.executable, "-m", "http.server", "--bind", address, str(port)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return server, port


def _get(url: str, timeout_s: float = 1.0) -> int:
    deadline = time.monotonic() + 5
    while True:
        try:
            return httpx.get(url, timeout=timeout_s).status_code
        except httpx.ConnectError:  # still starting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _get_once_up(url: str) -> int:
    """The first answer through the delay proxy: while the site's server is still starting,
    the proxy's connect to it is refused and it resets its client, with no answer."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return _get(url)
        except httpx.RemoteProtocolError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.needs_netns
def test_a_cut_link_is_silent_and_a_healed_one_serves_again() -> None:
    with NetnsLab(["east"]) as lab:
        link = lab.links["east"]
        server, port = _listening_in(link.namespace, link.address)
        try:
            url = f"http://{link.address}:{port}/"
            assert lab.call(_get, url) == 200
            lab.cut("east")
            # No reset, no ICMP: the request only times out.
            with pytest.raises(httpx.TimeoutException):
                lab.call(_get, url, 0.3)
            lab.heal("east")
            assert lab.call(_get, url) == 200
        finally:
            server.kill()
            server.wait()


@pytest.mark.needs_netns
def test_a_far_link_makes_the_handshake_itself_take_its_round_trip() -> None:
    with NetnsLab(["near", "far"], round_trips={"far": 120}) as lab:
        servers = {
            site: _listening_in(link.namespace, link.address) for site, link in lab.links.items()
        }
        try:

            def handshake_s(site: str) -> float:
                link = lab.links[site]
                _get(f"http://{link.address}:{servers[site][1]}/", 5.0)  # up and answering
                start = time.perf_counter()
                with socket.create_connection((link.address, servers[site][1]), timeout=5):
                    return time.perf_counter() - start

            near, far = (min(lab.call(handshake_s, site) for _ in range(3)) for site in lab.links)
            lab.cut("far")  # a far link cuts as a veth link does
            with pytest.raises(httpx.TimeoutException):
                lab.call(_get, f"http://{lab.links['far'].address}:{servers['far'][1]}/", 0.3)
        finally:
            for server, _ in servers.values():
                server.kill()
                server.wait()
    assert near < 0.02
    assert 0.12 <= far < 0.2


@pytest.mark.needs_netns
def test_the_delay_proxy_adds_its_delay_each_way() -> None:
    with NetnsLab(["east"]) as lab:
        link = lab.links["east"]
        server, port = _listening_in(link.namespace, link.address)
        proxy = DelayProxyProcess(link.balancer_end, link.address, [port], lab.balancer_host.prefix)
        try:
            proxy.start()
            url = f"http://{link.balancer_end}:{port}/"
            assert lab.call(_get_once_up, url) == 200

            def timed_get() -> float:
                start = time.perf_counter()
                _get(url)
                return time.perf_counter() - start

            direct = min(lab.call(timed_get) for _ in range(3))
            proxy.set_delay(100)
            delayed = min(lab.call(timed_get) for _ in range(3))
        finally:
            proxy.stop()
            server.kill()
            server.wait()
    assert delayed >= 0.2 > direct  # request and answer, 100 ms each


@pytest.mark.needs_netns
def test_the_delay_proxy_resets_its_client_when_the_site_does_not_answer_the_handshake() -> None:
    # The balancer's connect timeout stands behind the proxy: a silent link must look like a
    # failed connect (a reset before any answer, retried elsewhere), not like a hung replica.
    with NetnsLab(["east"]) as lab:
        link = lab.links["east"]
        server, port = _listening_in(link.namespace, link.address)
        proxy = DelayProxyProcess(
            link.balancer_end, link.address, [port], lab.balancer_host.prefix, 100
        )
        try:
            proxy.start()
            url = f"http://{link.balancer_end}:{port}/"
            assert lab.call(_get_once_up, url) == 200
            lab.cut("east")

            def refused_within() -> float:
                start = time.perf_counter()
                with pytest.raises(httpx.TransportError) as caught:
                    _get(url, 5.0)
                assert not isinstance(caught.value, httpx.TimeoutException)
                return time.perf_counter() - start

            assert lab.call(refused_within) < 2.0
        finally:
            proxy.stop()
            server.kill()
            server.wait()


@pytest.mark.needs_netns
def test_loss_rules_come_and_go() -> None:
    with NetnsLab(["east"]) as lab:
        namespace = lab.links["east"].namespace

        def ruleset() -> str:
            listed = subprocess.run(
                ["ip", "netns", "exec", namespace, "nft", "list", "ruleset"],
                capture_output=True,
                text=True,
                check=True,
            )
            return listed.stdout

        lab.lose("east", 20)
        assert 'iifname "uplink" numgen random mod 100 < 20 drop' in ruleset()
        assert 'oifname "uplink" numgen random mod 100 < 20 drop' in ruleset()
        lab.stop_losing("east")
        assert "numgen" not in ruleset()
        with pytest.raises(ValueError, match="percent: 100"):
            lab.lose("east", 100)


@pytest.mark.needs_netns
def test_nothing_is_left_when_the_body_raises(tmp_path: Path) -> None:
    stack = read_stack("t", STACK)
    with (
        pytest.raises(RuntimeError, match="the test failed"),
        running_in_netns(stack, tmp_path, slow_sites=["west"]) as cluster,
    ):
        made = cluster.lab.made
        pids = cluster.pids
        assert len(made) == 3 and set(made) <= set(namespaces())
        # HAProxy, two agents, two replicas and the delay proxy, all running.
        assert len(pids) == 6 and all(running(pid) for pid in pids)
        raise RuntimeError("the test failed")
    assert not set(made) & set(namespaces())
    assert not any(running(pid) for pid in pids)


@pytest.mark.needs_netns
def test_a_crashed_runs_namespace_is_removed_at_the_next_start() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    leftover = f"{PREFIX}{gone.pid}-dead00-lb"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", leftover, "sleep", "60"])
    try:
        with NetnsLab(["east"]) as lab:
            assert leftover not in namespaces()
            assert set(lab.made) <= set(namespaces())
        assert sleeper.wait(5) != 0  # killed with its namespace
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        subprocess.run(["ip", "netns", "delete", leftover], capture_output=True, check=False)
