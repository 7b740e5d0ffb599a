"""Bounded silence on the voice paths, through a real HAProxy, with the official `openai` SDK and
raw httpx as callers: a speech stream whose replica freezes, dies or is marked down ends within
its budget and never delivers stale audio; a transcription sent to a frozen or hung replica is
answered by another within the first-byte budget."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal

import openai
import pytest
from denv_agent.verdict import Verdict

from benchmarks.lab.dataplane import AGENT_UP, Dataplane, Frozen, SimulatedReplica, session_replica
from denv_iac.core.stack.model import FIRST_TOKEN_TIMEOUT_MS, STALL_TIMEOUT_MS
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.wire.audio import FRAME_BYTES, wav

Client = Literal["sdk", "httpx"]
CLIENTS: tuple[Client, ...] = ("sdk", "httpx")
SESSION = {"X-Denv-Session": "voice-call-3"}
# 40 frames of 20 ms audio, 50 ms apart: an utterance still speaking when the fault comes.
LONG_SPEECH = ReplicaSimConfig("template", ttft_ms=20, itl_ms=50, tokens=40)
WHOLE_UTTERANCE = LONG_SPEECH.tokens * FRAME_BYTES
FIRST_BYTE_S = FIRST_TOKEN_TIMEOUT_MS / 1000
STALL_S = STALL_TIMEOUT_MS / 1000
# HAProxy's timer wheel, a healthy replica's own first byte (20 ms) and two shared cores.
SLACK_S = 0.1
# How long a test waits on anything before calling it lost: far past every budget.
BOUND_S = 10.0
DOWN = Verdict("down", 0, ("xid 79",)).reply
# Under tune.bufsize (64 KiB): buffered whole, so it can be sent again. 1 s of 24 kHz PCM16.
SMALL_UPLOAD = wav(1.0)
# Past it: part of the body has gone to the replica before it could answer.
LARGE_UPLOAD = wav(3.0)


@pytest.fixture
def plane(start_dataplane: Callable[..., Dataplane]) -> Dataplane:
    return start_dataplane(sim=LONG_SPEECH)


def _sdk(plane: Dataplane) -> openai.OpenAI:
    # No SDK retries and a long timeout: what the endpoint does is what is measured.
    return openai.OpenAI(
        base_url=f"{plane.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=BOUND_S * 3,
        default_headers=SESSION,
    )


class _Utterance:
    """One streamed speech request in a thread: each audio chunk and when it came, what the
    client raised, and when the stream ended."""

    def __init__(self, plane: Dataplane, client: Client) -> None:
        self.replica: str | None = None
        self.received: list[tuple[float, int]] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.sent_at: float | None = None  # its client built, the request about to go
        self.first_audio = threading.Event()
        self._plane, self._client = plane, client
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _chunks(self) -> Iterator[bytes]:
        body = {
            "model": "voice",
            "input": "Hello there",
            "voice": "alloy",
            "response_format": "pcm",
        }
        if self._client == "sdk":
            sdk = _sdk(self._plane)
            self.sent_at = time.monotonic()
            with sdk.audio.speech.with_streaming_response.create(
                model="voice", input="Hello there", voice="alloy", response_format="pcm"
            ) as response:
                self.replica = response.headers.get("x-denv-replica")
                yield from response.iter_bytes()
        else:
            with self._plane.client(timeout_s=BOUND_S * 3) as client:
                self.sent_at = time.monotonic()
                with client.stream(
                    "POST", "/v1/audio/speech", json=body, headers=SESSION
                ) as response:
                    self.replica = response.headers.get("x-denv-replica")
                    yield from response.iter_bytes()

    def _run(self) -> None:
        try:
            for chunk in self._chunks():
                self.received.append((time.monotonic(), len(chunk)))
                self.first_audio.set()
        except Exception as error:  # what the client lets out is the point of the test
            self.error = error
        self.ended_at = time.monotonic()

    @property
    def audio_bytes(self) -> int:
        return sum(size for _, size in self.received)

    def wait_for_audio(self) -> None:
        assert self.first_audio.wait(BOUND_S), "no audio arrived"

    def join(self, timeout_s: float) -> _Utterance:
        self._thread.join(timeout=timeout_s)
        assert not self._thread.is_alive(), f"the stream did not end within {timeout_s} s"
        return self

    def assert_cut(self, victim: SimulatedReplica) -> None:
        """Cut mid-utterance: some audio from the victim, not all of it, and a transport error
        (the SDK's HTTP stack or httpx: matched by name, not by class)."""
        assert self.replica == victim.replica_id
        assert 0 < self.audio_bytes < WHOLE_UTTERANCE
        assert self.error is not None
        assert type(self.error).__name__ in ("RemoteProtocolError", "ReadError"), repr(self.error)


@pytest.mark.parametrize("client", CLIENTS)
def test_speech_from_a_frozen_replica_ends_within_the_stall_budget_and_no_stale_audio_follows(
    plane: Dataplane, client: Client
) -> None:
    victim = session_replica(plane, SESSION)
    utterance = _Utterance(plane, client)
    utterance.wait_for_audio()
    frozen = Frozen(victim)
    try:
        frozen_at = frozen.__enter__()
        # Waited past the budget: on the old long timer the stream was still silent here.
        utterance.join(STALL_S + SLACK_S + 1.0)
    finally:
        thawed_at = frozen.thaw()
    assert utterance.ended_at is not None
    assert utterance.ended_at - frozen_at < STALL_S + SLACK_S
    utterance.assert_cut(victim)
    # The stream ended before the thaw: no byte of it arrived after, stale or not.
    assert utterance.ended_at < thawed_at
    assert all(at < thawed_at for at, _ in utterance.received)


@pytest.mark.parametrize("client", CLIENTS)
def test_speech_whose_replica_dies_ends_at_once(plane: Dataplane, client: Client) -> None:
    victim = session_replica(plane, SESSION)
    utterance = _Utterance(plane, client)
    utterance.wait_for_audio()
    killed_at = time.monotonic()
    victim.kill()
    utterance.join(BOUND_S)
    assert utterance.ended_at is not None and utterance.ended_at - killed_at < SLACK_S
    utterance.assert_cut(victim)


@pytest.mark.parametrize("client", CLIENTS)
def test_speech_whose_replica_is_marked_down_ends_with_the_mark_down(
    plane: Dataplane, client: Client
) -> None:
    victim = session_replica(plane, SESSION)
    utterance = _Utterance(plane, client)
    utterance.wait_for_audio()
    try:
        plane.agent.set_reply(victim.replica_id, DOWN)  # the GPU fell off the bus
        plane.wait_until(
            lambda: plane.status()[victim.replica_id].startswith("DOWN"), BOUND_S, "marked down"
        )
        down_at = time.monotonic()
        # A healthy replica process, still speaking: only the mark-down can end this stream.
        utterance.join(BOUND_S)
    finally:
        plane.agent.set_reply(victim.replica_id, AGENT_UP)
    assert utterance.ended_at is not None and utterance.ended_at - down_at < SLACK_S
    utterance.assert_cut(victim)


@pytest.mark.parametrize("client", CLIENTS)
def test_speech_asked_of_a_frozen_replica_is_spoken_whole_by_another(
    plane: Dataplane, client: Client
) -> None:
    """No audio within the first-byte budget: nothing reached the caller, so the balancer asks
    another replica, and the caller hears the whole utterance once."""
    victim = session_replica(plane, SESSION)
    _Utterance(plane, client).join(BOUND_S)  # the client's modules loaded before the clock
    frozen = Frozen(victim)
    try:
        frozen.__enter__()
        utterance = _Utterance(plane, client).join(BOUND_S)
    finally:
        frozen.thaw()
    assert utterance.error is None, repr(utterance.error)
    assert utterance.replica and utterance.replica != victim.replica_id
    assert utterance.audio_bytes == WHOLE_UTTERANCE
    assert utterance.sent_at is not None
    assert utterance.received[0][0] - utterance.sent_at < FIRST_BYTE_S + SLACK_S


class _Transcriber:
    """One client, built and used once (its connection open, its modules loaded: the SDK's
    first upload costs it some 100 ms) before a test starts its clock."""

    def __init__(self, plane: Dataplane, client: Client) -> None:
        self._sdk = _sdk(plane) if client == "sdk" else None
        self._http = plane.client(timeout_s=BOUND_S * 3)
        status, replica, text = self(SMALL_UPLOAD)
        assert status == 200 and replica, text

    def __call__(self, audio: bytes) -> tuple[int, str, str]:
        """Status, serving replica and transcript (or error body) of one transcription."""
        if self._sdk is not None:
            try:
                raw = self._sdk.audio.transcriptions.with_raw_response.create(
                    model="voice", file=("turn.wav", audio, "audio/wav")
                )
            except openai.APIStatusError as error:
                return error.status_code, "", error.response.text
            return raw.status_code, raw.headers.get("x-denv-replica", ""), raw.parse().text
        response = self._http.post(
            "/v1/audio/transcriptions",
            data={"model": "voice"},
            files={"file": ("turn.wav", audio, "audio/wav")},
            headers=SESSION,
        )
        body = response.json()
        text = body.get("text", json.dumps(body))
        return response.status_code, response.headers.get("x-denv-replica", ""), text

    def close(self) -> None:
        self._http.close()
        if self._sdk is not None:
            self._sdk.close()


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("fault", ["frozen", "hung"])
def test_a_transcription_on_a_silent_replica_is_answered_by_another_within_the_first_byte_budget(
    plane: Dataplane, client: Client, fault: str
) -> None:
    victim = session_replica(plane, SESSION)
    transcribe = _Transcriber(plane, client)
    frozen = Frozen(victim)
    try:
        if fault == "frozen":
            frozen.__enter__()
        else:
            victim.fault("hang")  # a zombie: the API reads requests and never answers
        started = time.monotonic()
        status, replica, text = transcribe(SMALL_UPLOAD)
        elapsed = time.monotonic() - started
    finally:
        if fault == "frozen":
            frozen.thaw()
        else:
            victim.fault("none")
        transcribe.close()
    assert status == 200, text
    assert replica and replica != victim.replica_id
    assert text.startswith("simulated transcript of turn.wav (1.00 s of audio)")
    assert elapsed < FIRST_BYTE_S + SLACK_S


def test_a_transcription_larger_than_the_buffer_gets_a_504_within_the_budget(
    plane: Dataplane,
) -> None:
    """HAProxy can send a request again only while it holds its whole body (tune.bufsize): a
    larger upload to a frozen replica is not retried, but the caller still waits one budget."""
    assert len(LARGE_UPLOAD) > 65536
    victim = session_replica(plane, SESSION)
    transcribe = _Transcriber(plane, "httpx")
    try:
        with Frozen(victim):
            started = time.monotonic()
            status, _, text = transcribe(LARGE_UPLOAD)
            elapsed = time.monotonic() - started
        assert status == 504, text
        assert '"replica_timeout"' in text
        assert elapsed < FIRST_BYTE_S + SLACK_S
        # Served again once thawed.
        status, replica, _ = transcribe(LARGE_UPLOAD)
        assert status == 200 and replica == victim.replica_id
    finally:
        transcribe.close()
