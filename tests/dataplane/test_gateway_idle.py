"""A Kubernetes gateway, real HAProxy running its rendered config on 127.0.0.1, holds a relayed
connection that idles past its `timeout client`/`server` for as long as the endpoint's longest
idle timer (`timeout tunnel`), and closes it after that: a realtime session idling between turns
is never cut at the gateway while the endpoint still holds it."""

from __future__ import annotations

import dataclasses
import socket
import socketserver
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from denv_iac.core.balancer.gateway import GatewayRoute, render_gateway_config
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.kube_manifests.gateway import gateway_site
from denv_iac.local.processes import free_port
from tests.dataplane.gateway_loopback import gateway_on_loopback, gateway_stack

pytestmark = pytest.mark.timing

# Short stand-ins for the endpoint's 300 s stream idle timer and 10 min realtime tunnel.
STREAM_IDLE_S = 1
TUNNEL_S = 3


class _Echo(socketserver.BaseRequestHandler):
    """The pod: sends back what it gets, for as long as the connection stays open."""

    def handle(self) -> None:
        while data := self.request.recv(64):
            self.request.sendall(data)


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[int]:
    """The gateway's listener for one replica, relaying to an echoing pod."""
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo) as pod:
        pod.daemon_threads = True
        threading.Thread(target=pod.serve_forever, daemon=True).start()
        stack = gateway_stack()
        settings = dataclasses.replace(
            balancer_settings(stack),
            stream_idle_timeout_s=STREAM_IDLE_S,
            realtime_tunnel_timeout_s=TUNNEL_S,
        )
        listen = free_port()
        pod_port = pod.server_address[1]
        route = GatewayRoute("voice.k8s.node-0.0", "node-0", 8000, listen, "127.0.0.1", pod_port)
        config = render_gateway_config(gateway_site(stack.site("k8s"), False), [route], settings)
        path = tmp_path / "gateway.cfg"
        path.write_text(gateway_on_loopback(config, free_port(), free_port(), free_port()))
        with (tmp_path / "gateway.log").open("wb") as log:
            gateway = subprocess.Popen(
                ["haproxy", "-db", "-f", str(path)], stdout=log, stderr=subprocess.STDOUT
            )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", listen), timeout=0.5).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the gateway never listened"
                    time.sleep(0.05)
            yield listen
        finally:
            gateway.terminate()
            gateway.wait(timeout=10)


def _echoes(connection: socket.socket, data: bytes) -> bool:
    try:
        connection.sendall(data)
        return connection.recv(64) == data
    except OSError:
        return False


def test_a_relayed_connection_lives_through_the_endpoints_longest_idle_timer(relay: int) -> None:
    with socket.create_connection(("127.0.0.1", relay), timeout=5) as connection:
        assert _echoes(connection, b"turn 1")
        # Silent past `timeout client` and `server` (1 s), within the tunnel timer (3 s).
        time.sleep(STREAM_IDLE_S + 1)
        assert _echoes(connection, b"turn 2"), "the gateway cut an idle session it should hold"
        # Silent past the tunnel timer: a dead peer, closed.
        time.sleep(TUNNEL_S + 1.5)
        assert not _echoes(connection, b"turn 3"), "the gateway held a session past its tunnel"
