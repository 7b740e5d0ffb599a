from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from denv_agent.conditions import Condition, Effect
from denv_agent.config import Replica, Thresholds
from denv_agent.replica_health import (
    ProbeError,
    ReplicaReading,
    check_health,
    probe_stream,
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
    timing = probe_stream(f"{server.base_url}/v1/chat/completions", "voice", 2.0)
    assert 150 <= timing.ttft_ms < 1000
    assert timing.max_gap_ms is None  # one token: no gap to time


def test_probe_measures_the_longest_gap_between_tokens(server: ReplicaServer) -> None:
    server.tokens, server.gap_s = 3, 0.2
    timing = probe_stream(f"{server.base_url}/v1/chat/completions", "voice", 2.0)
    assert timing.max_gap_ms is not None and 200 <= timing.max_gap_ms < 1000


@pytest.mark.timing
def test_with_a_stall_budget_the_probe_ends_once_a_pause_outlasts_it(
    server: ReplicaServer,
) -> None:
    server.tokens, server.gap_s = 3, 5.0
    started = time.monotonic()
    first: list[tuple[float, float]] = []
    timing = probe_stream(
        f"{server.base_url}/v1/chat/completions",
        "voice",
        3.0,
        300,
        lambda ttft_ms: first.append((ttft_ms, time.monotonic() - started)),
    )
    assert time.monotonic() - started < 1.5
    # The first token was told as it came, before the pause that ended the probe.
    ((ttft_ms, told_after_s),) = first
    assert ttft_ms == timing.ttft_ms and told_after_s < 0.25
    assert timing.max_gap_ms is not None and 300 <= timing.max_gap_ms < 1000


def test_a_stream_silent_after_its_first_token_is_one_long_gap(server: ReplicaServer) -> None:
    server.tokens, server.gap_s = 3, 5.0
    timing = probe_stream(f"{server.base_url}/v1/chat/completions", "voice", 0.5)
    assert timing.ttft_ms < 400
    assert timing.max_gap_ms is not None and timing.max_gap_ms >= 500 - timing.ttft_ms - 1


@pytest.mark.parametrize(
    ("stream", "message"), [("no_token", "stream ended without a token"), ("error", "http 500")]
)
def test_probe_failures_say_why(server: ReplicaServer, stream: str, message: str) -> None:
    server.stream = stream
    with pytest.raises(ProbeError, match=message):
        probe_stream(f"{server.base_url}/v1/chat/completions", "voice", 1.0)


def test_probe_times_out_on_a_silent_stream(server: ReplicaServer) -> None:
    server.ttft_s = 5
    with pytest.raises(ProbeError, match="timeout"):
        probe_stream(f"{server.base_url}/v1/chat/completions", "voice", 0.2)


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
        (ReplicaReading(checks=3, ever_ok=True, ttft_ms=120.0, gap_ms=900.0), []),
        (
            ReplicaReading(checks=3, ever_ok=True, ttft_ms=120.0, gap_ms=1500.4),
            [Condition(Effect.DRAIN, "stream stalled 1500 ms, over 1000 ms budget")],
        ),
    ],
)
def test_replica_conditions(
    tmp_path: Path, reading: ReplicaReading, expected: list[Condition]
) -> None:
    replica = _replica(tmp_path, ttft_budget_ms=300, probe_model="voice", stall_budget_ms=1000)
    assert replica_conditions(reading, replica, Thresholds()) == expected
