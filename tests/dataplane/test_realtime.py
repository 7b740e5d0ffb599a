"""Realtime voice sessions (WebSocket) through a real HAProxy to the simulated replicas."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import openai
import pytest
from openai.types.realtime import (
    ResponseAudioDeltaEvent,
    ResponseAudioTranscriptDoneEvent,
    ResponseDoneEvent,
    ResponseOutputItemAddedEvent,
    SessionCreatedEvent,
    SessionUpdatedEvent,
)
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from benchmarks.lab.dataplane import FAST_REPLICA, Dataplane, Frozen
from denv_iac.wire.audio import FRAME_BYTES, audio_frame


def _open(plane: Dataplane, session: str | None = None) -> ClientConnection:
    headers = {"X-Denv-Session": session} if session else {}
    url = plane.url.replace("http://", "ws://") + "/v1/realtime?model=voice"
    return connect(url, additional_headers=headers, subprotocols=["realtime"], open_timeout=5)


def _event(ws: ClientConnection, timeout_s: float = 5.0) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(ws.recv(timeout=timeout_s))
    return event


def _turn(ws: ClientConnection) -> list[dict[str, Any]]:
    ws.send(json.dumps({"type": "response.create"}))
    events = []
    while not events or events[-1]["type"] != "response.done":
        events.append(_event(ws))
    return events


def test_a_turn_streams_20ms_pcm16_frames_and_its_transcript(dataplane: Dataplane) -> None:
    with _open(dataplane, "call-1") as ws:
        assert ws.subprotocol == "realtime"
        assert ws.response is not None
        replica = ws.response.headers["X-Denv-Replica"]
        assert replica.startswith("voice.")
        created = _event(ws)
        assert created["type"] == "session.created"
        assert created["session"]["replica"] == replica
        events = _turn(ws)
    audio = [
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    ]
    assert len(audio) == FAST_REPLICA.tokens
    assert all(len(frame) == FRAME_BYTES for frame in audio)
    assert audio[1] == audio_frame(1)
    text = [e for e in events if e["type"] == "response.output_audio_transcript.done"]
    assert text and text[0]["transcript"].startswith("tok0 ")
    assert events[-1]["response"]["status"] == "completed"
    assert dataplane.replicas[replica].stats()["realtime_turns_completed"] == 1


def test_a_replica_dying_mid_turn_closes_the_socket_and_nothing_is_replayed(
    dataplane: Dataplane,
) -> None:
    with _open(dataplane, "call-2") as ws:
        assert ws.response is not None
        replica = dataplane.replicas[ws.response.headers["X-Denv-Replica"]]
        _event(ws)
        replica.fault("die_after_tokens", 3)
        ws.send(json.dumps({"type": "response.create"}))
        deltas = 0
        last = time.monotonic()
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                if _event(ws)["type"] == "response.output_audio.delta":
                    deltas += 1
                    last = time.monotonic()
        close_ms = (time.monotonic() - last) * 1000
    assert deltas == 3
    assert closed.value.rcvd is None  # no close frame: the client sees 1006, abnormal closure
    assert close_ms < FAST_REPLICA.itl_ms + 200
    assert replica.stats()["realtime_turns_aborted"] == 1
    assert sum(r.stats()["realtime_sessions"] for r in dataplane.replicas.values()) == 1


@pytest.mark.timing
def test_a_session_idle_between_turns_stays_open(dataplane: Dataplane) -> None:
    with _open(dataplane, "call-3") as ws:
        _event(ws)
        assert _turn(ws)[-1]["type"] == "response.done"
        time.sleep(2.5)  # a caller thinking: longer than any pool's silence budget
        assert _turn(ws)[-1]["type"] == "response.done"


def _closed_after(ws: ClientConnection, limit_s: float) -> tuple[float, ConnectionClosed]:
    """Seconds until the socket closes, waiting up to `limit_s`."""
    start = time.monotonic()
    try:
        while time.monotonic() - start < limit_s:
            ws.recv(timeout=limit_s)
    except ConnectionClosed as closed:
        return time.monotonic() - start, closed
    raise AssertionError(f"the session stayed open for {limit_s} s")


@pytest.mark.timing
@pytest.mark.parametrize("fault", ["freeze", "agent_down"])
def test_a_session_whose_replica_freezes_or_is_marked_down_closes_and_reconnects_elsewhere(
    dataplane: Dataplane, fault: str
) -> None:
    ws = _open(dataplane, f"call-{fault}")
    assert ws.response is not None
    replica_id = ws.response.headers["X-Denv-Replica"]
    _event(ws)
    _turn(ws)
    replica = dataplane.replicas[replica_id]
    frozen = Frozen(replica) if fault == "freeze" else None
    if frozen is not None:
        frozen.__enter__()
    else:
        dataplane.agent.set_reply(replica_id, "down #xid 79")
    try:
        close_s, closed = _closed_after(ws, 5.0)
        assert closed.rcvd is None  # 1006: the balancer drops the connection
        reconnect_start = time.monotonic()
        with _open(dataplane, f"call-{fault}") as again:
            assert again.response is not None
            assert again.response.headers["X-Denv-Replica"] != replica_id
            _event(again)
            assert _turn(again)[-1]["response"]["status"] == "completed"
        reconnect_ms = (time.monotonic() - reconnect_start) * 1000
    finally:
        if frozen is not None:
            frozen.thaw()
        dataplane.agent.set_reply(replica_id, "up ready 100%")
    print(f"{fault}: closed after {close_s * 1000:.0f} ms; reconnect + turn {reconnect_ms:.0f} ms")
    # Marked down by the agent within one agent-inter (200 ms); a freeze by the health checks:
    # at most inter (1 s) to the next check, then two failed checks of timeout check (0.5 s)
    # a fastinter (0.25 s) apart, 2.25 s.
    assert close_s < (2.5 if fault == "freeze" else 1.0)
    assert reconnect_ms < 1000


def test_a_drain_keeps_open_sessions_and_sends_new_ones_elsewhere(dataplane: Dataplane) -> None:
    with _open(dataplane, "call-drain") as ws:
        assert ws.response is not None
        replica_id = ws.response.headers["X-Denv-Replica"]
        _event(ws)
        dataplane.agent.set_reply(replica_id, "drain")
        dataplane.wait_until(
            lambda: dataplane.status()[replica_id].startswith("DRAIN"), 3, "drained"
        )
        with _open(dataplane, "call-drain") as other:
            assert other.response is not None
            assert other.response.headers["X-Denv-Replica"] != replica_id
        assert _turn(ws)[-1]["response"]["replica"] == replica_id
    dataplane.agent.set_reply(replica_id, "up ready 100%")


@pytest.mark.timing
def test_open_sessions_survive_a_balancer_reload(dataplane: Dataplane) -> None:
    assert dataplane.haproxy is not None
    sessions = [_open(dataplane, f"call-reload-{n}") for n in range(5)]
    try:
        for ws in sessions:
            _event(ws)
        dataplane.haproxy.reload()
        time.sleep(0.5)  # the new worker takes the listeners; the old one keeps the sessions
        for ws in sessions:
            assert _turn(ws)[-1]["response"]["status"] == "completed"
        with _open(dataplane, "call-after-reload") as fresh:
            _event(fresh)
            assert _turn(fresh)[-1]["response"]["status"] == "completed"
    finally:
        for ws in sessions:
            ws.close()
    turns = sum(r.stats()["realtime_turns_completed"] for r in dataplane.replicas.values())
    assert turns == 6


def test_a_reconnect_fails_over_only_to_the_sites_the_recipe_allows(dataplane: Dataplane) -> None:
    # voice prefers home-a and home-b, may fail over to fallback, and may never use llm's site.
    home = ["voice.home-a.n0.0", "voice.home-b.n1.0"]
    ws = _open(dataplane, "call-sites")
    assert ws.response is not None
    assert ws.response.headers["X-Denv-Replica"] in home
    _event(ws)
    try:
        for replica_id in home:
            dataplane.agent.set_reply(replica_id, "down #xid 79")
        _closed_after(ws, 5.0)
        dataplane.wait_until(
            lambda: all(dataplane.status()[r] != "UP" for r in home), 3, "both home sites down"
        )
        with _open(dataplane, "call-sites") as again:
            assert again.response is not None
            assert again.response.headers["X-Denv-Replica"] == "voice.fallback.n2.0"
            _event(again)
            assert _turn(again)[-1]["response"]["status"] == "completed"
        dataplane.agent.set_reply("voice.fallback.n2.0", "down #xid 79")
        dataplane.wait_until(
            lambda: dataplane.status()["voice.fallback.n2.0"] != "UP", 3, "fallback down"
        )
        with pytest.raises(InvalidStatus) as refused:
            _open(dataplane, "call-sites")
        # No allowed site is left: refused, not served by llm's replica on another site.
        assert refused.value.response.status_code == 503
        assert dataplane.replicas["llm.elsewhere.n3.0"].stats()["realtime_turns_completed"] == 0
    finally:
        for replica_id in [*home, "voice.fallback.n2.0"]:
            dataplane.agent.set_reply(replica_id, "up ready 100%")
    dataplane.wait_until(dataplane.all_up, 5, "every replica back up")
    with _open(dataplane, "call-sites") as back:
        assert back.response is not None
        assert back.response.headers["X-Denv-Replica"] in home


def test_the_openai_sdk_realtime_client_hears_a_turn_in_the_current_event_set(
    dataplane: Dataplane,
) -> None:
    """The SDK's own realtime client (GA event types) through the endpoint: every event of a
    turn is typed as what it is, the audio arrives, and the response's metadata comes back."""
    ws_url = dataplane.url.replace("http://", "ws://") + "/v1"
    client = openai.OpenAI(
        base_url=f"{dataplane.url}/v1", api_key="unused", websocket_base_url=ws_url
    )
    with client.realtime.connect(
        model="voice", extra_headers={"X-Denv-Session": "sdk-call"}
    ) as connection:
        created = connection.recv()
        assert isinstance(created, SessionCreatedEvent)
        connection.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
        assert isinstance(connection.recv(), SessionUpdatedEvent)
        connection.response.create(response={"metadata": {"turn": "greeting"}})
        events = []
        for event in connection:
            events.append(event)
            if event.type == "response.done":
                break
    kinds = [event.type for event in events]
    # The order of a turn as OpenAI's realtime API sends it.
    assert kinds[:3] == [
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-5:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.done",
    ]
    audio = [event for event in events if isinstance(event, ResponseAudioDeltaEvent)]
    assert len(audio) == FAST_REPLICA.tokens == kinds.count("response.output_audio.delta")
    assert base64.b64decode(audio[1].delta) == audio_frame(1)
    (added,) = [e for e in events if isinstance(e, ResponseOutputItemAddedEvent)]
    assert {e.item_id for e in audio} == {added.item.id}
    (transcript,) = [e for e in events if isinstance(e, ResponseAudioTranscriptDoneEvent)]
    assert transcript.transcript.startswith("tok0 ")
    done = events[-1]
    assert isinstance(done, ResponseDoneEvent)
    assert done.response.status == "completed"
    assert done.response.metadata == {"turn": "greeting"}
    assert done.response.output and done.response.output[0].id == added.item.id
