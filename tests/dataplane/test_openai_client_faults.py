"""The official `openai` SDK as the caller, through a real HAProxy, while a replica freezes,
dies or is drained: what the SDK raises, how soon, and that its next turn is served."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from denv_agent.verdict import Verdict

from benchmarks.lab.dataplane import AGENT_UP, Dataplane, Frozen, SimulatedReplica, session_replica
from denv_iac.core.stack.model import FIRST_TOKEN_TIMEOUT_MS, STALL_TIMEOUT_MS
from denv_iac.local.replica_model import ReplicaSimConfig
from tests.timing import RECOVERY_SLACK_S, assert_within

pytestmark = pytest.mark.timing

SESSION = {"X-Denv-Session": "sdk-conversation"}
# 40 tokens, 50 ms apart: a stream that is still running when the fault comes.
LONG_STREAMS = ReplicaSimConfig("template", ttft_ms=20, itl_ms=50, tokens=40)
MESSAGES: Any = [{"role": "user", "content": "Hello"}]
DOWN = Verdict("down", 0, ("xid 79",)).reply  # what the agent says of a GPU that fell off the bus


@pytest.fixture
def plane(start_dataplane: Callable[..., Dataplane]) -> Dataplane:
    return start_dataplane(sim=LONG_STREAMS)


def _sdk(plane: Dataplane) -> openai.OpenAI:
    # No SDK retries: what the endpoint does is what is measured.
    return openai.OpenAI(
        base_url=f"{plane.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=30,
        default_headers=SESSION,
    )


class _Turn:
    """One streamed turn through the SDK, in a thread; what it got, what it raised, when."""

    def __init__(self, client: openai.OpenAI, request_id: str) -> None:
        self.request_id = request_id
        self.replica: str | None = None
        self.text = ""
        self.error: BaseException | None = None
        self.first_token_s: float | None = None
        self.ended_at = 0.0
        self._client = client
        self._thread = threading.Thread(target=self._run)
        self.started_at = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        try:
            raw = self._client.chat.completions.with_raw_response.create(
                model="voice",
                messages=MESSAGES,
                stream=True,
                extra_headers={"X-Request-Id": self.request_id},
            )
            self.replica = raw.headers.get("x-denv-replica")
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    if self.first_token_s is None:
                        self.first_token_s = time.monotonic() - self.started_at
                    self.text += chunk.choices[0].delta.content
        except Exception as error:  # what the SDK lets out is the point of the test
            self.error = error
        self.ended_at = time.monotonic()

    def join(self) -> _Turn:
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), f"{self.request_id} never ended"
        return self


def _served_whole(turn: _Turn, avoiding: SimulatedReplica | None = None) -> None:
    assert turn.error is None, repr(turn.error)
    assert turn.replica is not None
    assert avoiding is None or turn.replica != avoiding.replica_id
    assert turn.text.count(" ") + 1 >= LONG_STREAMS.tokens // 2  # the whole answer came
    assert turn.first_token_s is not None
    assert_within(turn.first_token_s, FIRST_TOKEN_TIMEOUT_MS / 1000, "an SDK turn's first token")


def _cut(turn: _Turn) -> None:
    """What the SDK raises for a stream cut mid-way: its connection error, from its transport's
    protocol error (the SDK's own HTTP stack, so matched by name, not by class)."""
    assert isinstance(turn.error, openai.APIConnectionError), repr(turn.error)
    cause = turn.error.__cause__
    assert type(cause).__name__ == "RemoteProtocolError", repr(cause)
    assert "incomplete chunked read" in str(cause)


def _stream_in_flight(
    plane: Dataplane, request_id: str
) -> tuple[SimulatedReplica, openai.OpenAI, _Turn]:
    """The conversation's replica, the SDK client, and a turn streaming on it a few tokens in."""
    victim = session_replica(plane, SESSION)
    client = _sdk(plane)
    turn = _Turn(client, request_id)
    plane.wait_until(lambda: turn.text.count(" ") >= 3, 5, "the turn a few tokens in")
    return victim, client, turn


def _replicas_that_saw(plane: Dataplane, request_id: str) -> list[str]:
    return [
        r.replica_id for r in plane.replicas.values() if r.stats()["by_request_id"].get(request_id)
    ]


def test_sdk_stream_on_a_frozen_replica_raises_within_the_stall_budget_and_the_next_turn_is_served(
    plane: Dataplane,
) -> None:
    victim, client, in_flight = _stream_in_flight(plane, "sdk-in-flight")
    with Frozen(victim) as frozen_at:
        in_flight.join()
        next_turn = _Turn(client, "sdk-next-turn").join()
        plane.wait_until(lambda: plane.status()[victim.replica_id].startswith("DOWN"), 3, "down")
        thawed_at = time.monotonic()
    # The caller hears the abort one stall budget after the last token (docs/streaming.md).
    _cut(in_flight)
    assert in_flight.replica == victim.replica_id and in_flight.text
    assert_within(
        in_flight.ended_at - frozen_at, STALL_TIMEOUT_MS / 1000, "an SDK stream on a frozen replica"
    )
    _served_whole(next_turn, victim)
    # Nothing replayed: the cut stream reached no other replica; the next turn exactly one.
    assert _replicas_that_saw(plane, "sdk-in-flight") == [victim.replica_id]
    assert (
        len([r for r in _replicas_that_saw(plane, "sdk-next-turn") if r != victim.replica_id]) == 1
    )
    # Back by itself, and the conversation returns to it.
    plane.wait_until(lambda: plane.status()[victim.replica_id] == "UP", 5, "back")
    assert_within(
        time.monotonic() - thawed_at, 1.0, "a thawed replica back in rotation", RECOVERY_SLACK_S
    )
    assert session_replica(plane, SESSION) is victim


def test_sdk_stream_whose_replica_dies_raises_at_once_and_the_next_turn_is_served(
    plane: Dataplane,
) -> None:
    victim, client, in_flight = _stream_in_flight(plane, "sdk-killed")
    killed_at = time.monotonic()
    victim.kill()
    in_flight.join()
    next_turn = _Turn(client, "sdk-after-kill").join()
    _cut(in_flight)
    assert in_flight.ended_at - killed_at < 0.2
    _served_whole(next_turn, victim)
    victim.restart()
    plane.wait_until(plane.all_up, 5, "every replica back")


def test_sdk_gets_a_503_it_can_read_when_no_replica_is_left(plane: Dataplane) -> None:
    voice = [r for r in plane.replicas.values() if r.pool == "voice"]
    for replica in voice:
        plane.agent.set_reply(replica.replica_id, DOWN)
    plane.wait_until(
        lambda: all(plane.status()[r.replica_id].startswith("DOWN") for r in voice), 3, "down"
    )
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as raised:
        _sdk(plane).chat.completions.create(model="voice", messages=MESSAGES, stream=True)
    assert time.monotonic() - started < 0.5
    assert raised.value.status_code == 503
    assert raised.value.code == "no_healthy_replica"
    for replica in voice:
        plane.agent.set_reply(replica.replica_id, AGENT_UP)
    plane.wait_until(plane.all_up, 3, "every replica back")
    _served_whole(_Turn(_sdk(plane), "sdk-after-503").join())
