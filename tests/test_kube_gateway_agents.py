"""The in-cluster gateway relays each agent check to the agent of the replica's node.

A real HAProxy runs the gateway's rendered agent frontend and backend, with the backend's agents
(in the cluster, every node's, found through the agents' headless Service) standing here as two
real agent-check servers of the agent package: one on the replica's node, one on another. The
balancer's check, relayed, must get the verdict of the agent that knows the replica, and follow
the replica when its pod moves to the other node.
"""

import re
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from denv_agent.agentcheck import AgentCheckServer

from benchmarks.lab.waiting import eventually
from denv_iac.local.processes import free_port
from tests.test_kube_manifests import VOICE, _manifests, _site

pytestmark = pytest.mark.needs_haproxy
REPLICA = "voice.k8s.node-1.0"


def _gateway_agent_config(frontend_port: int, agents: list[int]) -> str:
    """The rendered agent frontend and this replica's backend, its agents at local ports."""
    rendered = _manifests([_site()], [VOICE]).gateway_config["data"]["haproxy.cfg"]
    frontend = rendered.split("frontend denv.agent\n")[1].split("\n\n")[0].splitlines()
    route = next(line for line in frontend if f"use_backend agent.{REPLICA} " in line)
    backend = rendered.split(f"backend agent.{REPLICA}\n")[1].split("\n\n")[0].splitlines()
    (template,) = [line for line in backend if "server-template" in line]
    assert re.search(r"init-addr none check inter \d+s rise 1 fall 1$", template)
    servers = [
        f"    server agent{n} 127.0.0.1:{port} check inter 100ms rise 1 fall 1"
        for n, port in enumerate(agents)
    ]
    return "\n".join(
        [
            "defaults",
            "    mode tcp",
            "    timeout connect 500ms",
            "    timeout client 5s",
            "    timeout server 5s",
            "",
            "frontend denv.agent",
            f"    bind 127.0.0.1:{frontend_port}",
            *[line for line in frontend[1:] if "use_backend" not in line],
            route,
            "",
            f"backend agent.{REPLICA}",
            *[line for line in backend if line is not template],
            *servers,
            "",
        ]
    )


@contextmanager
def _haproxy(config: str, folder: Path) -> Iterator[None]:
    path = folder / "gateway.cfg"
    path.write_text(config)
    process = subprocess.Popen(
        ["haproxy", "-db", "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield
    finally:
        process.terminate()
        process.wait(timeout=10)


def _ask(port: int) -> bytes:
    """The balancer's agent check, as it reaches the gateway: the replica id, then read."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.sendall(f"{REPLICA}\n".encode())
            return conn.recv(256)
    except OSError:
        return b""


def _wait(probe: Callable[[], bytes], expected: bytes, timeout_s: float = 10.0) -> None:
    """Until the check gets `expected`; then every check does, not one in so many."""
    eventually(
        lambda: probe() == expected, timeout_s, f"the check getting {expected!r}", detail=probe
    )
    assert [probe() for _ in range(10)] == [expected] * 10


def test_the_check_reaches_the_agent_that_knows_the_replica_and_follows_it(tmp_path: Path) -> None:
    replies: list[dict[str, bytes]] = [{}, {REPLICA: b"up ready 100%\n"}]
    agents = [AgentCheckServer(("127.0.0.1", 0), lambda n=n: replies[n], 0.25) for n in range(2)]
    for agent in agents:
        agent.start()
    port = free_port()
    config = _gateway_agent_config(port, [agent.address[1] for agent in agents])
    try:
        with _haproxy(config, tmp_path):
            # The replica's pod runs on the second agent's node.
            _wait(lambda: _ask(port), b"up ready 100%\n")
            # Its pod is rescheduled onto the first agent's node, where it is still starting.
            replies[0], replies[1] = {REPLICA: b"down #starting\n"}, {}
            _wait(lambda: _ask(port), b"down #starting\n")
            # On no node (pending): the check finds no agent, and the balancer gets no verdict.
            replies[0] = {}
            _wait(lambda: _ask(port), b"")
    finally:
        for agent in agents:
            agent.stop()
