"""The pod endpoints over real HTTP on 127.0.0.1: a replica pod's warm readiness and its drain
before it stops, as a Kubernetes agent answers them for the pods on its node."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from denv_agent.agent import Agent

from agent.tests.agent_testkit import (
    GPU0,
    ReplicaServer,
    http_call,
    kube_agent,
    replica_servers,
    reply,
    wait_for,
)

HERE, ELSEWHERE = "voice-0", "voice-1"


def _replica(pod: str, server: ReplicaServer, probe: bool) -> dict[str, object]:
    extra: dict[str, object] = {"probe_model": "m", "ttft_budget_ms": 5000} if probe else {}
    return {
        "id": f"voice.k8s.node-1.{pod[-1]}",
        "health_url": server.health_url,
        "pod": pod,
        **extra,
    }


@contextmanager
def pod_agent(tmp_path: Path, server: ReplicaServer, *, probe: bool) -> Iterator[Agent]:
    replicas = [_replica(HERE, server, probe), _replica(ELSEWHERE, server, probe)]
    with kube_agent(tmp_path, replicas, {HERE: GPU0}) as agent:
        yield agent


def _call(agent: Agent, method: str, path: str) -> tuple[int, dict[str, object]]:
    assert agent.pod_api is not None
    status, body = http_call(agent.pod_api.address, method, path)
    return status, json.loads(body)


@pytest.fixture
def server() -> Iterator[ReplicaServer]:
    with replica_servers(1) as (replica,):
        yield replica


@pytest.mark.parametrize(
    ("probe", "stream", "health", "ready", "reason"),
    [
        # Health answers and no probe is configured: warm as soon as it answers.
        (False, "ok", "ok", True, None),
        # A probe is configured and streams a first token: warm.
        (True, "ok", "ok", True, None),
        # Health answers but the model never streams a token: not warm (before the probe's
        # third failure, no first token yet; from it, the replica is down for it).
        (True, "no_token", "ok", False, "token"),
        # Health never answers: not warm.
        (False, "ok", "error", False, "health check failed"),
    ],
)
def test_a_pod_is_ready_only_when_warm(
    tmp_path: Path,
    server: ReplicaServer,
    probe: bool,
    stream: str,
    health: str,
    ready: bool,
    reason: str | None,
) -> None:
    server.stream, server.health = stream, health
    with pod_agent(tmp_path, server, probe=probe) as agent:
        if ready:
            wait_for(lambda: _call(agent, "GET", f"/pods/{HERE}/ready")[0], 200)
        else:
            # Long enough for several health checks and probes (every 0.05 s and 0.1 s).
            reading = lambda: agent.snapshot.replicas["voice.k8s.node-1.0"]  # noqa: E731
            wait_for(lambda: reading().checks >= 3 and (reading().probes >= 2 or not probe), True)
        status, doc = _call(agent, "GET", f"/pods/{HERE}/ready")
        assert (status, doc["ready"]) == ((200, True) if ready else (503, False)), doc
        assert doc["replica"] == "voice.k8s.node-1.0"
        if reason is not None:
            assert reason in str(doc["reason"]), doc


def test_a_pod_not_on_this_node_or_a_wrong_path_is_not_found(
    tmp_path: Path, server: ReplicaServer
) -> None:
    with pod_agent(tmp_path, server, probe=False) as agent:
        wait_for(lambda: _call(agent, "GET", f"/pods/{HERE}/ready")[0], 200)
        for method, path in [
            ("GET", f"/pods/{ELSEWHERE}/ready"),
            ("POST", f"/pods/{ELSEWHERE}/drain?hold_s=30"),
            ("GET", "/pods/nobody/ready"),
            ("GET", f"/pods/{HERE}/ready/more"),
            ("GET", "/healthz"),
            ("POST", f"/pods/{HERE}/undrain?hold_s=30"),
        ]:
            status, doc = _call(agent, method, path)
            assert status == 404, (method, path, doc)
        assert _call(agent, "GET", f"/pods/{HERE}/ready")[0] == 200  # nothing was drained


@pytest.mark.parametrize("hold", ["", "0", "-5", "soon", "nan", "172801"])
def test_a_drain_without_a_sound_hold_is_refused(
    tmp_path: Path, server: ReplicaServer, hold: str
) -> None:
    with pod_agent(tmp_path, server, probe=False) as agent:
        wait_for(lambda: reply(agent, "voice.k8s.node-1.0"), lambda r: r.startswith("up"))
        status, doc = _call(agent, "POST", f"/pods/{HERE}/drain?hold_s={hold}")
        assert status == 400 and "hold_s" in str(doc["error"]), doc
        assert reply(agent, "voice.k8s.node-1.0").startswith("up")


def test_a_stopping_pod_is_drained_until_its_server_stops(
    tmp_path: Path, server: ReplicaServer
) -> None:
    with pod_agent(tmp_path, server, probe=False) as agent:
        wait_for(lambda: reply(agent, "voice.k8s.node-1.0"), lambda r: r.startswith("up"))
        status, doc = _call(agent, "POST", f"/pods/{HERE}/drain?hold_s=60")
        assert status == 200 and str(doc["verdict"]).startswith("drain"), doc
        assert reply(agent, "voice.k8s.node-1.0") == "drain #pod stopping\n"
        assert agent.healthz()["drains"]["stopping"] == ["voice.k8s.node-1.0"]
        # Still warm while it finishes its calls: the pod stays ready.
        assert _call(agent, "GET", f"/pods/{HERE}/ready")[0] == 200
        # Its server stops: the drain ends, the replica is down for its own reason.
        server.health = "error"
        wait_for(lambda: agent.snapshot.drains.stopping, frozenset())
        assert reply(agent, "voice.k8s.node-1.0").startswith("down #health check failed")
        # The pod that replaces it comes up undrained, with no call to undo the drain.
        server.health = "ok"
        wait_for(lambda: reply(agent, "voice.k8s.node-1.0"), lambda r: r.startswith("up"))


def test_a_stopping_drain_ends_at_its_hold_even_if_the_server_still_answers(
    tmp_path: Path, server: ReplicaServer
) -> None:
    with pod_agent(tmp_path, server, probe=False) as agent:
        wait_for(lambda: reply(agent, "voice.k8s.node-1.0"), lambda r: r.startswith("up"))
        assert _call(agent, "POST", f"/pods/{HERE}/drain?hold_s=0.3")[0] == 200
        assert reply(agent, "voice.k8s.node-1.0").startswith("drain")
        wait_for(lambda: reply(agent, "voice.k8s.node-1.0"), lambda r: r.startswith("up"))
        assert agent.snapshot.drains.stopping == frozenset()
