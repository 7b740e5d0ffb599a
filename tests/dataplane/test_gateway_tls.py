"""The balancer and a Kubernetes site's gateway, both real HAProxy, linked by mutual TLS.

The gateway runs its rendered config (listeners and agent frontend bound with `ssl ... verify
required`), the balancer its rendered config (server line with the client certificate, agent
checks through the loopback relay), a simulated replica stands behind the gateway as its pod,
and an agent stand-in as the pod's node agent; all on 127.0.0.1. A stream goes through both,
the agent's verdicts come back through the relay, and the gateway refuses every client that
lacks the stack's client certificate, plaintext included.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import socket
import ssl
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.lab.dataplane import FAST_REPLICA, AgentStandIn, stream_chat
from benchmarks.lab.waiting import eventually
from denv_iac.core.balancer import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    render_haproxy_config,
)
from denv_iac.core.balancer.gateway import GatewayRoute, render_gateway_config
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.kube_manifests.gateway import gateway_site
from denv_iac.core.stack.gateway_link import gateway_tls_name
from denv_iac.haproxy.files import write_config
from denv_iac.haproxy.runtime import HaproxyProcess, stats_command
from denv_iac.local.processes import free_port
from denv_iac.local.replica_sim import ReplicaProcess
from tests.dataplane.gateway_loopback import gateway_on_loopback, gateway_stack
from tests.gateway_pki import GatewayPki, reading_tls_from, write_pki

WAIT_S = 15.0  # for the gateway, its agents and its checks to come up or change

REPLICA = "voice.k8s.node-0.0"


@dataclasses.dataclass
class Link:
    pki: GatewayPki
    endpoint: str
    replica_port: int  # the gateway's listener for the replica
    agent_port: int  # the gateway's agent frontend
    agent: AgentStandIn
    balancer: HaproxyProcess

    def server_row(self) -> dict[str, str]:
        rows = csv.DictReader(io.StringIO(stats_command(self.balancer.stats_socket, "show stat")))
        return next(r for r in rows if (r["# pxname"], r["svname"]) == ("voice.tier10", REPLICA))


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


def _gateway_config(pki: GatewayPki, replica: int, listen: int, agent: int, agents: int) -> str:
    """The gateway's rendered config on local ports, its node agents found at `agents`."""
    stack = gateway_stack()
    route = GatewayRoute(REPLICA, "node-0", 8000, listen, "127.0.0.1", replica)
    site = gateway_site(stack.site("k8s"), tls=True)
    config = render_gateway_config(site, [route], balancer_settings(stack))
    return reading_tls_from(gateway_on_loopback(config, agent, agents, free_port()), pki.folder)


@pytest.fixture
def link(tmp_path: Path) -> Iterator[Link]:
    pki = write_pki(tmp_path / "tls", "k8s")
    replica = ReplicaProcess(
        dataclasses.replace(FAST_REPLICA, replica_id=REPLICA), log_path=tmp_path / "replica.log"
    )
    agent = AgentStandIn()
    started: list[Callable[[], object]] = [agent.close]
    try:
        replica.spawn()
        replica.wait_ready()
        started.append(replica.stop)
        listen, agent_port = free_port(), free_port()
        gateway_cfg = tmp_path / "gateway.cfg"
        gateway_cfg.write_text(_gateway_config(pki, replica.port, listen, agent_port, agent.port))
        with (tmp_path / "gateway.log").open("wb") as log:
            gateway = subprocess.Popen(
                ["haproxy", "-db", "-f", str(gateway_cfg)], stdout=log, stderr=subprocess.STDOUT
            )
        started.append(lambda: (gateway.terminate(), gateway.wait(timeout=10)))
        eventually(
            lambda: _listening(listen) and _listening(agent_port), WAIT_S, "the gateway listening"
        )
        settings = BalancerSettings(
            bind_address="127.0.0.1",
            port=free_port(),
            stats_socket=str(tmp_path / "balancer.sock"),
            prometheus_port=None,
            gateway_ca_file=str(pki.ca),
            gateway_client_cert=str(pki.client_pem),
            agent_relay_port_base=free_port(),
            # Generous on a loaded build machine: a TLS handshake there can take a few hundred
            # milliseconds, and what is measured here is the link, not its speed.
            check_timeout_ms=3000,
            connect_timeout_ms=1000,
        )
        server = BalancerServer(
            REPLICA,
            "k8s",
            "node-0",
            "127.0.0.1",
            listen,
            agent_port,
            gateway=gateway_tls_name("k8s"),
        )
        pool = BalancerPool("voice", (BalancerTier(10, ("k8s",), (server,)),))
        balancer_dir = tmp_path / "balancer"
        rendered = render_haproxy_config([pool], settings, str(balancer_dir))
        balancer = HaproxyProcess(
            write_config(rendered, balancer_dir),
            Path(settings.stats_socket),
            tmp_path / "balancer.log",
        )
        balancer.start()
        started.append(balancer.stop)
        yield Link(pki, f"http://127.0.0.1:{settings.port}", listen, agent_port, agent, balancer)
    finally:
        for stop in reversed(started):
            stop()


def _serving(link: Link) -> Callable[[], bool]:
    """UP on a passed health check (over TLS), with an agent verdict read through the relay."""

    def serving() -> bool:
        row = link.server_row()
        return (row["status"], row["check_status"], row["agent_status"]) == ("UP", "L7OK", "L7OK")

    return serving


def test_a_stream_flows_through_the_gateway_and_agent_verdicts_through_the_relay(
    link: Link,
) -> None:
    # Health checks passed over TLS (L7OK), and agent checks reached the agent through the relay.
    eventually(_serving(link), WAIT_S, "the health check passing and the agent's verdict read")
    with httpx.Client(base_url=link.endpoint, timeout=10) as client:
        outcome = stream_chat(
            client, {"model": "voice", "messages": [{"role": "user", "content": "hi"}]}
        )
    assert (outcome.status, outcome.replica, outcome.done, outcome.error) == (
        200,
        REPLICA,
        True,
        None,
    )
    assert len(outcome.chunks) >= FAST_REPLICA.tokens
    # The agent's word travels back the same way: a drain shows on the balancer.
    link.agent.set_reply(REPLICA, "drain")
    eventually(lambda: link.server_row()["status"].startswith("DRAIN"), WAIT_S, "the agent's drain")
    link.agent.set_reply(REPLICA, "up ready 100%")
    eventually(lambda: link.server_row()["status"] == "UP", WAIT_S, "the agent's ready")


def _tls_exchange(port: int, pki: GatewayPki, client_pem: Path | None, send: bytes) -> bytes:
    """What a TLS client gets back for `send`: verifying the gateway, with `client_pem` if any."""
    context = ssl.create_default_context(cafile=str(pki.ca))
    if client_pem is not None:
        context.load_cert_chain(str(client_pem))
    try:
        raw = socket.create_connection(("127.0.0.1", port), timeout=3)
        with context.wrap_socket(raw, server_hostname=gateway_tls_name("k8s")) as conn:
            conn.sendall(send)
            return conn.recv(4096)
    except (ssl.SSLError, OSError):
        return b""


def _plain_exchange(port: int, send: bytes) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as conn:
            conn.sendall(send)
            return conn.recv(4096)
    except OSError:
        return b""


REQUEST = b"GET /health HTTP/1.1\r\nHost: replica\r\nConnection: close\r\n\r\n"


def test_the_gateway_answers_only_clients_with_the_stacks_client_certificate(link: Link) -> None:
    eventually(_serving(link), WAIT_S, "the health check passing and the agent's verdict read")
    # With it: the replica answers through the gateway.
    assert _tls_exchange(link.replica_port, link.pki, link.pki.client_pem, REQUEST).startswith(
        b"HTTP/1.1 200"
    )
    agent_check = f"{REPLICA}\n".encode()
    assert _tls_exchange(link.agent_port, link.pki, link.pki.client_pem, agent_check).startswith(
        b"up"
    )
    # Without it, or with the gateway's own certificate (server authentication only): nothing.
    for client in (None, link.pki.gateway_pem):
        assert _tls_exchange(link.replica_port, link.pki, client, REQUEST) == b""
        assert _tls_exchange(link.agent_port, link.pki, client, agent_check) == b""
    # Plaintext never reaches the replica or the agent: no HTTP answer, no verdict.
    assert not _plain_exchange(link.replica_port, REQUEST).startswith(b"HTTP/")
    assert not _plain_exchange(link.agent_port, agent_check).startswith(b"up")
