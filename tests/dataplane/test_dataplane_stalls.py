"""Silence and recovery through a real HAProxy: a frozen, hung or dripping replica costs a caller
at most its pool's silence budget, and every fault that clears brings the replica back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from benchmarks.lab.dataplane import (
    AGENT_UP,
    FIRST_TOKEN_S,
    LONG_STREAMS,
    STALL_S,
    Dataplane,
    Frozen,
    StreamOutcome,
    session_replica,
    stream_chat,
)
from denv_iac.local.replica_model import ReplicaSimConfig
from tests.timing import RECOVERY_SLACK_S, assert_within

pytestmark = pytest.mark.timing

SESSION = {"X-Denv-Session": "conversation-7"}
# After a fault clears, the replica must serve again within this.
RECOVERY_S = 1.0


@pytest.fixture
def plane(start_dataplane: Callable[..., Dataplane]) -> Dataplane:
    return start_dataplane(sim=LONG_STREAMS)


class _BackgroundStream:
    """A long stream running while the test injects its fault; `ended_at` is when it ended."""

    def __init__(self, plane: Dataplane, headers: dict[str, str]) -> None:
        self._outcome: list[StreamOutcome] = []
        self._client = plane.client(timeout_s=30)
        self._started = time.monotonic()
        chunks: list[dict[str, Any]] = []
        self._thread = threading.Thread(
            target=lambda: self._outcome.append(
                stream_chat(self._client, {"model": "voice"}, headers, chunks)
            )
        )
        self._thread.start()
        plane.wait_until(lambda: len(chunks) >= 3, 5, "the stream a few tokens in")

    def result(self) -> tuple[StreamOutcome, float]:
        self._thread.join(timeout=30)
        self._client.close()
        assert self._outcome, "the stream never ended"
        outcome = self._outcome[0]
        return outcome, self._started + outcome.elapsed_s


def _back_in_rotation(plane: Dataplane, replica_id: str, since: float) -> float:
    plane.wait_until(lambda: plane.status()[replica_id] == "UP", 5, f"{replica_id} back")
    return time.monotonic() - since


def test_frozen_replica_cuts_its_stream_retries_new_requests_and_comes_back(
    plane: Dataplane,
) -> None:
    victim = session_replica(plane, SESSION)
    stream = _BackgroundStream(plane, {**SESSION, "X-Request-Id": "in-flight"})
    with Frozen(victim) as frozen_at:
        # Sticky requests of the same conversation, sent in the moments before mark-down.
        with plane.client(timeout_s=30) as client:
            turns = [
                stream_chat(client, {"model": "voice"}, {**SESSION, "X-Request-Id": f"turn-{n}"})
                for n in range(3)
            ]
        in_flight, ended_at = stream.result()
        plane.wait_until(lambda: plane.status()[victim.replica_id].startswith("DOWN"), 3, "down")
        thawed_at = time.monotonic()
    back_s = _back_in_rotation(plane, victim.replica_id, thawed_at)

    # The stream in flight: an abort, within the stall budget of its last token.
    assert in_flight.replica == victim.replica_id
    assert not in_flight.done and in_flight.error is not None
    assert 0 < len(in_flight.chunks) < LONG_STREAMS.tokens
    assert_within(ended_at - frozen_at, STALL_S, "a frozen replica's stream ends")
    # Each new turn: served whole elsewhere, having waited at most the first-token budget.
    for turn in turns:
        assert (turn.status, turn.done, turn.error) == (200, True, None)
        assert turn.replica != victim.replica_id
        assert turn.first_token_s is not None
        assert_within(turn.first_token_s, FIRST_TOKEN_S, "a turn retried off a frozen replica")
    # Nothing replayed: no turn and not the cut stream reached a second live replica.
    for request_id in ("in-flight", "turn-0", "turn-1", "turn-2"):
        others = [
            r
            for r in plane.replicas.values()
            if r is not victim and r.stats()["by_request_id"].get(request_id)
        ]
        assert len(others) <= (0 if request_id == "in-flight" else 1)
    assert_within(back_s, RECOVERY_S, "a thawed replica back in rotation", RECOVERY_SLACK_S)
    assert session_replica(plane, SESSION) is victim


def test_replica_that_accepts_and_never_answers_costs_one_budget_then_recovers(
    plane: Dataplane,
) -> None:
    victim = session_replica(plane, SESSION)
    victim.fault("hang")
    with plane.client(timeout_s=30) as client:
        outcomes = [
            stream_chat(client, {"model": "voice", "max_tokens": 2}, SESSION) for _ in range(3)
        ]
    for outcome in outcomes:
        assert (outcome.status, outcome.done) == (200, True)
        assert outcome.replica != victim.replica_id
        assert outcome.first_token_s is not None
        assert_within(outcome.first_token_s, FIRST_TOKEN_S, "a turn retried off a hung replica")
    plane.wait_until(lambda: plane.status()[victim.replica_id].startswith("DOWN"), 5, "down")
    victim.fault("none")
    back_s = _back_in_rotation(plane, victim.replica_id, time.monotonic())
    assert_within(back_s, RECOVERY_S, "a cleared replica back in rotation", RECOVERY_SLACK_S)


def test_dripping_stream_is_cut_not_left_waiting(start_dataplane: Callable[..., Dataplane]) -> None:
    # A token every 1.5 s: each pause is past the stall budget.
    plane = start_dataplane(sim=ReplicaSimConfig("template", ttft_ms=20, itl_ms=1500, tokens=4))
    with plane.client(timeout_s=30) as client:
        outcome = stream_chat(client, {"model": "voice"}, {**SESSION, "X-Request-Id": "drip"})
    assert not outcome.done and outcome.error is not None
    assert len(outcome.chunks) == 1
    assert_within(
        outcome.elapsed_s, 0.02 + STALL_S, "a dripping stream is cut"
    )  # one token, 20 ms in
    assert sum(r.stats()["by_request_id"].get("drip", 0) for r in plane.replicas.values()) == 1


def test_answer_not_streamed_keeps_the_long_timer(
    start_dataplane: Callable[..., Dataplane],
) -> None:
    # The whole answer takes 2 s, twice the silence budget: no stream, so nothing to cut.
    plane = start_dataplane(sim=LONG_STREAMS)
    with plane.client(timeout_s=30) as client:
        response = client.post("/v1/chat/completions", json={"model": "voice", "stream": False})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("verdict", ["drain #operator", "drain #xid 63 row remap pending"])
def test_undrain_returns_the_replica_within_a_second(plane: Dataplane, verdict: str) -> None:
    victim = session_replica(plane, SESSION)
    plane.agent.set_reply(victim.replica_id, verdict)
    plane.wait_until(lambda: plane.status()[victim.replica_id].startswith("DRAIN"), 2, "drain")
    plane.agent.set_reply(victim.replica_id, AGENT_UP)
    back_s = _back_in_rotation(plane, victim.replica_id, time.monotonic())
    assert_within(back_s, RECOVERY_S, "a cleared replica back in rotation", RECOVERY_SLACK_S)
    assert session_replica(plane, SESSION) is victim


def test_up_without_ready_would_keep_the_drain(plane: Dataplane) -> None:
    """Why the agent says `up ready`: HAProxy 2.6 ends an agent-set drain only on `ready`."""
    victim = session_replica(plane, SESSION)
    plane.agent.set_reply(victim.replica_id, "drain")
    plane.wait_until(lambda: plane.status()[victim.replica_id].startswith("DRAIN"), 2, "drain")
    polls = plane.agent.polls[victim.replica_id]
    plane.agent.set_reply(victim.replica_id, "up 100%")
    plane.wait_until(
        lambda: plane.agent.polls[victim.replica_id] >= polls + 5, 5, "five agent checks"
    )
    assert plane.status()[victim.replica_id].startswith("DRAIN")
    assert AGENT_UP.startswith("up ready")
