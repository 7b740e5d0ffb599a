from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from denv_agent.conditions import Condition, Effect
from denv_agent.config import Replica, Thresholds
from denv_agent.replica_health import (
    ProbeError,
    ReplicaReading,
    check_health,
    probe_first_token,
    replica_conditions,
)

from agent.tests.agent_testkit import ReplicaServer, closed_port, make_config


@pytest.fixture
def server() -> Iterator[ReplicaServer]:
    server = ReplicaServer()
    yield server
    server.close()


@pytest.mark.parametrize(
    ("mode", "result"),
    [("ok", None), ("error", "http 503"), ("hang", "timeout"), ("garbage", "bad response")],
)
def test_health_check_outcomes(server: ReplicaServer, mode: str, result: str | None) -> None:
    server.health = mode
    assert check_health(server.health_url, 0.2) == result


def test_health_check_refused() -> None:
    assert check_health(f"http://127.0.0.1:{closed_port()}/health", 0.2) == "connection refused"


def test_probe_measures_time_to_first_token(server: ReplicaServer) -> None:
    server.ttft_s = 0.15
    ttft_ms = probe_first_token(f"{server.base_url}/v1/chat/completions", "voice", 2.0)
    assert 150 <= ttft_ms < 1000


@pytest.mark.parametrize(
    ("stream", "message"), [("no_token", "stream ended without a token"), ("error", "http 500")]
)
def test_probe_failures_say_why(server: ReplicaServer, stream: str, message: str) -> None:
    server.stream = stream
    with pytest.raises(ProbeError, match=message):
        probe_first_token(f"{server.base_url}/v1/chat/completions", "voice", 1.0)


def test_probe_times_out_on_a_silent_stream(server: ReplicaServer) -> None:
    server.ttft_s = 5
    with pytest.raises(ProbeError, match="timeout"):
        probe_first_token(f"{server.base_url}/v1/chat/completions", "voice", 0.2)


def _replica(tmp_path: Path, **extra: object) -> Replica:
    return make_config(
        tmp_path, [{"id": "r", "health_url": "http://x/h", "gpu": 0, **extra}]
    ).replicas[0]


@pytest.mark.parametrize(
    ("reading", "expected"),
    [
        (ReplicaReading(), [Condition(Effect.DOWN, "starting")]),
        (ReplicaReading(checks=5, ever_ok=True), []),
        (
            ReplicaReading(checks=5, ever_ok=True, failures=2, last_error="timeout"),
            [Condition(Effect.NOTE, "health check failed 2x: timeout")],
        ),
        (
            ReplicaReading(checks=9, ever_ok=True, failures=7, last_error="connection refused"),
            [Condition(Effect.DOWN, "health check failed 3x: connection refused")],
        ),
        (
            ReplicaReading(checks=1, failures=1, last_error="connection refused"),
            [Condition(Effect.DOWN, "health check failed 1x: connection refused")],
        ),
        (
            ReplicaReading(checks=3, ever_ok=True, probe_failures=3, probe_error="http 500"),
            [Condition(Effect.DOWN, "first-token probe failed 3x: http 500")],
        ),
        (
            ReplicaReading(checks=3, ever_ok=True, ttft_ms=412.4),
            [Condition(Effect.WEIGHT, "ttft 412 ms over 300 ms budget", 50)],
        ),
        (ReplicaReading(checks=3, ever_ok=True, ttft_ms=120.0), []),
    ],
)
def test_replica_conditions(
    tmp_path: Path, reading: ReplicaReading, expected: list[Condition]
) -> None:
    replica = _replica(tmp_path, ttft_budget_ms=300, probe_model="voice")
    assert replica_conditions(reading, replica, Thresholds()) == expected
