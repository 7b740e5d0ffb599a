"""Realtime voice sessions (WebSocket) through a real HAProxy to the simulated replicas."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from denv_iac.local.voice_sim import FRAME_BYTES, audio_frame

from .dataplane_harness import FAST_REPLICA, Dataplane


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
    audio = [base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta"]
    assert len(audio) == FAST_REPLICA.tokens
    assert all(len(frame) == FRAME_BYTES for frame in audio)
    assert audio[1] == audio_frame(1)
    text = [e for e in events if e["type"] == "response.audio_transcript.done"]
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
                if _event(ws)["type"] == "response.audio.delta":
                    deltas += 1
                    last = time.monotonic()
        close_ms = (time.monotonic() - last) * 1000
    assert deltas == 3
    assert closed.value.rcvd is None  # no close frame: the client sees 1006, abnormal closure
    assert close_ms < FAST_REPLICA.itl_ms + 200
    assert replica.stats()["realtime_turns_aborted"] == 1
    assert sum(r.stats()["realtime_sessions"] for r in dataplane.replicas.values()) == 1


def test_a_session_idle_between_turns_stays_open(dataplane: Dataplane) -> None:
    with _open(dataplane, "call-3") as ws:
        _event(ws)
        assert _turn(ws)[-1]["type"] == "response.done"
        time.sleep(2.5)  # a caller thinking: longer than any pool's silence budget
        assert _turn(ws)[-1]["type"] == "response.done"
