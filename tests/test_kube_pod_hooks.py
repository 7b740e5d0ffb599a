"""A replica pod's hooks, as rendered, run against a real agent on 127.0.0.1.

The readiness probe and the preStop of the server container are python3 scripts that ask the
agent of the pod's node. Here each runs as the kubelet would run it (its argument list, the pod's
name in its env), with the agent's URL pointed at a real agent of the agent package serving its
pod endpoints locally, and a real model server whose port the preStop watches: ready only once
warm; a stopping pod drained at once, then held until its last connection closes, or cut at the
drain bound.
"""

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from denv_agent.agent import Agent

from agent.tests.agent_testkit import (
    GPU0,
    ReplicaServer,
    closed_port,
    kube_agent,
    pods_url,
    replica_servers,
    reply,
    wait_for,
)
from denv_iac.core.kube_manifests.agent import AGENT_PODS_PORT
from tests.test_kube_manifests import VOICE, _manifests, _pool, _server, _site
from tests.timing import RECOVERY_SLACK_S, assert_within

POD = "voice-0"
REPLICA = "voice.k8s.node-1.0"
# The preStop samples open connections every half second.
SAMPLE_S = 0.5
AGENT_URL = f"http://denv-agent-local.denv.svc.cluster.local:{AGENT_PODS_PORT}"


@contextmanager
def pod_agent(tmp_path: Path, server: ReplicaServer, probe: bool = False) -> Iterator[Agent]:
    extra: dict[str, object] = {"probe_model": "m", "ttft_budget_ms": 5000} if probe else {}
    replica = {"id": REPLICA, "health_url": server.health_url, "pod": POD, **extra}
    with kube_agent(tmp_path, [replica], {POD: GPU0}) as agent:
        yield agent


@pytest.fixture
def server() -> Iterator[ReplicaServer]:
    with replica_servers(1) as (replica,):
        yield replica


def _hooks(**recipe: Any) -> tuple[list[str], list[str]]:
    """The server container's readiness and preStop commands, as rendered."""
    pool = _pool(_manifests([_site()], [{**VOICE, **recipe}]), "voice")
    container = _server(pool.stateful_set)
    ready = container["readinessProbe"]["exec"]["command"]
    stop = container["lifecycle"]["preStop"]["exec"]["command"]
    return ready, stop


def _local(command: list[str], agent_url: str, **replace: str) -> list[str]:
    """`command` as this machine runs it: this python, the local agent, other args replaced."""
    python, flag, script, url, *args = command
    assert (python, flag) == ("python3", "-c")
    assert url == AGENT_URL
    names = ["port", "wait", "settle", "hold", "quiet"][: len(args)]
    values = [replace.get(name, value) for name, value in zip(names, args, strict=True)]
    return [sys.executable, flag, script, agent_url, *values]


def _run(command: list[str], timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DENV_POD": POD}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_the_rendered_hooks_ask_the_agent_of_the_pods_own_node() -> None:
    ready, stop = _hooks(drain_timeout_s=300)
    assert ready[3:] == [AGENT_URL]
    # port, drain bound, settle (two agent checks of 200 ms and a second), drain hold, quiet
    assert stop[3:] == [AGENT_URL, "8000", "300", "1.4", "330", "40"]


def test_readiness_passes_only_once_the_agent_calls_the_replica_warm(
    tmp_path: Path, server: ReplicaServer
) -> None:
    ready, _ = _hooks()
    server.stream = "no_token"  # health answers, the model streams no token
    with pod_agent(tmp_path, server, probe=True) as agent:
        command = _local(ready, pods_url(agent))
        wait_for(lambda: agent.snapshot.replicas[REPLICA].probes >= 2, True)
        answer = _run(command)
        assert answer.returncode == 1
        assert answer.stderr.startswith("not warm: "), answer.stderr
        assert "ended without a token" in answer.stderr or "no first token" in answer.stderr
        server.stream = "ok"
        wait_for(lambda: _run(command).returncode, 0, timeout_s=10, interval_s=0.2)


def test_readiness_fails_when_no_agent_answers() -> None:
    ready, _ = _hooks()
    answer = _run(_local(ready, f"http://127.0.0.1:{closed_port()}"))
    assert answer.returncode == 1
    assert "warmth unknown, no agent answered" in answer.stderr, answer.stderr


def _stop_hook(agent: Agent, port: int, wait: str, **replace: str) -> list[str]:
    """The rendered preStop, watching `port`, bound to `wait` s, once `agent` has the replica
    up."""
    wait_for(lambda: reply(agent, REPLICA), lambda r: r.startswith("up"))
    _, stop = _hooks()
    return _local(stop, pods_url(agent), port=str(port), wait=wait, settle="0.2", **replace)


def _session(server: ReplicaServer) -> socket.socket:
    """A realtime session: a connection held open, no request running on it."""
    return socket.create_connection(("127.0.0.1", server.server.server_address[1]))


@pytest.mark.timing
def test_a_stopping_pod_is_drained_then_stops_once_its_last_connection_closes(
    tmp_path: Path, server: ReplicaServer
) -> None:
    with pod_agent(tmp_path, server) as agent:
        command = _stop_hook(agent, server.server.server_address[1], wait="20")
        session = _session(server)
        hook = subprocess.Popen(
            command,
            env={**os.environ, "DENV_POD": POD},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: reply(agent, REPLICA), "drain #pod stopping\n", timeout_s=10)
            time.sleep(2 * SAMPLE_S)
            assert hook.poll() is None, "stopped with a session open"
        finally:
            closed = time.monotonic()
            session.close()
        out, err = hook.communicate(timeout=30)
        assert_within(
            time.monotonic() - closed,
            SAMPLE_S,
            "preStop ends after the last close",
            RECOVERY_SLACK_S,
        )
        assert hook.returncode == 0 and "no streams open" in out, (out, err)
        # Still drained until its server stops; then the replacement pod starts undrained.
        assert reply(agent, REPLICA) == "drain #pod stopping\n"
        server.health = "error"
        wait_for(lambda: agent.snapshot.drains.stopping, frozenset())


@pytest.mark.timing
def test_a_session_that_outlives_the_drain_bound_is_cut_and_counted(
    tmp_path: Path, server: ReplicaServer
) -> None:
    # The agent's health checks go to a server of their own: the hook counts every connection
    # to the port it watches, and one of them, open at the bound's sample, was counted beside
    # the session ("2 connections") on a loaded machine. The session is the one it must count.
    with (
        replica_servers(1) as (health,),
        pod_agent(tmp_path, health) as agent,
        _session(server),
    ):
        command = _stop_hook(agent, server.server.server_address[1], wait="1")
        started = time.monotonic()
        answer = _run(command)
        elapsed = time.monotonic() - started
        assert_within(elapsed, 1 + SAMPLE_S, "preStop ends at its bound", RECOVERY_SLACK_S)
        assert elapsed >= 1
        assert answer.returncode == 0
        assert "1 connections still open after 1 s: cut" in answer.stderr, answer.stderr
        assert reply(agent, REPLICA) == "drain #pod stopping\n"


@pytest.mark.timing
def test_a_stopping_pod_with_only_an_idle_pooled_connection_stops_after_the_quiet_window(
    tmp_path: Path, server: ReplicaServer
) -> None:
    # A balancer's connection kept for reuse: it carried a request and its answer, then nothing.
    # The pod waits out the quiet window from its last byte, not the drain bound; nodes follow
    # the same rule (tests/node/test_repair_wait.py).
    quiet_s = 1
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        pod_agent(tmp_path, server) as agent,
        socket.create_connection(listener.getsockname()) as pooled,
    ):
        command = _stop_hook(agent, listener.getsockname()[1], wait="30", quiet=str(quiet_s))
        accepted, _ = listener.accept()
        with accepted:
            pooled.sendall(b"GET /health HTTP/1.1\r\n\r\n")
            accepted.recv(1024)
            accepted.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            pooled.recv(1024)
            last_byte = time.monotonic()
            answer = _run(command)
            elapsed = time.monotonic() - last_byte
            # Still open when the hook ended: it was not waited for, and was not cut.
            assert pooled.getpeername() and accepted.fileno() >= 0
    assert answer.returncode == 0, answer.stderr
    # Waited for while it was not yet quiet for the window, then left to close with the server.
    assert elapsed >= quiet_s
    assert_within(elapsed, quiet_s + SAMPLE_S, "preStop ends after the quiet window", 5)
    assert answer.stdout.startswith("no streams open after "), answer
    assert "; 1 idle connection(s), quiet for 1 s or more" in answer.stdout, answer.stdout
    assert "cut" not in answer.stderr, answer.stderr
