"""LiveKit Agents' openai plugin and Pipecat's OpenAI services as the callers, standalone (no
LiveKit server, no transport), through a real HAProxy to the simulated replicas: what each
framework hears when a speech replica freezes or dies mid-utterance, whether a transcription
sent to a frozen replica is answered by another within its budget, and that chat streams and a
LiveKit realtime session's audio come through the endpoint. docs/streaming.md's settings for
voice teams come from these tests."""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from loguru import logger

from benchmarks.lab.dataplane import (
    FIRST_TOKEN_S,
    LONG_STREAMS,
    STALL_S,
    Dataplane,
    Frozen,
    SimulatedReplica,
    session_replica,
)
from benchmarks.lab.waiting import eventually_async
from denv_iac.wire.audio import FRAME_BYTES, wav
from tests.timing import RECOVERY_SLACK_S, assert_within

# Pipecat logs through loguru, at DEBUG by default and from its import on: every frame of every
# test, and a banner, on stderr.
logger.remove()

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # the frameworks' own imports
    from livekit import rtc
    from livekit.agents import APIConnectionError, APIConnectOptions, llm
    from livekit.plugins import openai as livekit_openai
    from pipecat.frames.frames import (
        ErrorFrame,
        Frame,
        LLMContextFrame,
        LLMFullResponseEndFrame,
        LLMTextFrame,
        TTSAudioRawFrame,
        TTSSpeakFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.services.openai.stt import OpenAISTTService
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.workers.runner import WorkerRunner

pytestmark = pytest.mark.timing

SESSION = {"X-Denv-Session": "framework-call-7"}
WHOLE_UTTERANCE = LONG_STREAMS.tokens * FRAME_BYTES
# A fault comes once this much audio has reached the caller: 10 of the 40 frames.
MID_UTTERANCE = WHOLE_UTTERANCE // 4
# How long a test waits on anything before calling it lost: far past every budget.
BOUND_S = 10.0
TEXT = "Hello there, how can I help?"
ONE_SECOND = 24_000  # samples of the 24 kHz PCM16 both frameworks send and expect


@pytest.fixture
def plane(start_dataplane: Callable[..., Dataplane]) -> Dataplane:
    return start_dataplane(sim=LONG_STREAMS)


class Heard:
    """What a framework handed its caller, and when: audio bytes, text, the error it raised or
    pushed, when it ended; and the replica of every answer (X-Denv-Replica, read by an httpx
    hook on the HTTP client the framework was given)."""

    def __init__(self) -> None:
        self.audio: list[tuple[float, int]] = []
        self.text = ""
        self.error: object = None
        self.ended_at: float | None = None
        self.sent_at: float | None = None  # the first request's, as it left the client
        self.replicas: list[str] = []

    async def on_request(self, _: httpx.Request) -> None:
        self.sent_at = self.sent_at or time.monotonic()

    async def on_response(self, response: httpx.Response) -> None:
        self.replicas.append(response.headers.get("x-denv-replica", ""))

    def http_client(self, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
        """The HTTP client both frameworks accept: the SDK's default one, with the hooks and
        `headers` (the one place Pipecat's speech and transcription take X-Denv-Session)."""
        return openai.DefaultAsyncHttpxClient(
            headers=headers,
            event_hooks={"request": [self.on_request], "response": [self.on_response]},
        )

    def heard_audio(self, size: int) -> None:
        self.audio.append((time.monotonic(), size))

    def end(self, error: object = None) -> None:
        if self.ended_at is None:
            self.error, self.ended_at = error, time.monotonic()

    @property
    def audio_bytes(self) -> int:
        return sum(size for _, size in self.audio)

    async def wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        await eventually_async(predicate, timeout_s, what, interval_s=0.005)


def run(coroutine: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coroutine, BOUND_S * 3))


# LiveKit Agents' openai plugin, driven as its AgentSession drives it.


def _livekit_client(plane: Dataplane, heard: Heard) -> openai.AsyncClient:
    """LiveKit's plugins take a ready client: where X-Denv-Session goes (default_headers)."""
    return openai.AsyncClient(
        base_url=f"{plane.url}/v1",
        api_key="unused",
        max_retries=0,
        default_headers=SESSION,
        http_client=heard.http_client(),  # the session header is default_headers' alone
    )


async def _livekit_speech(plane: Dataplane, heard: Heard, max_retry: int) -> None:
    tts = livekit_openai.TTS(
        model="voice", voice="alloy", response_format="pcm", client=_livekit_client(plane, heard)
    )
    try:
        stream = tts.synthesize(TEXT, conn_options=APIConnectOptions(max_retry=max_retry))
        async for audio in stream:
            heard.heard_audio(len(audio.frame.data.tobytes()))
        heard.end()
    except Exception as error:  # what the plugin lets out is the point of the test
        heard.end(error)
    finally:
        await tts.aclose()


# Pipecat's services, in a pipeline of their own run by Pipecat's runner.


class _Tap(FrameProcessor):
    """Records what passes it: audio and text going down, errors going up (Pipecat pushes a
    service's error frame upstream, towards the transport)."""

    def __init__(self, heard: Heard) -> None:
        super().__init__()
        self._heard = heard

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self._heard.heard_audio(len(frame.audio))
        elif isinstance(frame, LLMTextFrame):
            self._heard.text += frame.text
        elif isinstance(frame, LLMFullResponseEndFrame):
            self._heard.end()
        elif isinstance(frame, ErrorFrame):
            self._heard.end(frame.error)
        await self.push_frame(frame, direction)


async def _pipecat(
    service: FrameProcessor, heard: Heard, first: Frame, meanwhile: Callable[[], Awaitable[None]]
) -> None:
    """`first` through [tap, service, tap]; `meanwhile` runs alongside, then the pipeline is
    cancelled (as a transport's hang-up does)."""
    worker = PipelineWorker(Pipeline([_Tap(heard), service, _Tap(heard)]), enable_rtvi=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await worker.queue_frames([first])
    running = asyncio.create_task(runner.run())
    try:
        await meanwhile()
    finally:
        # Cancelled, not ended: an EndFrame waits out the TTS service's 3 s stop timer.
        await worker.cancel()
        await asyncio.wait_for(running, BOUND_S)


class _PipecatTTSInFrames(OpenAITTSService):
    """Pipecat's TTS reads `chunk_size` bytes (0.5 s of audio) before its first frame; this
    subclass reads one 20 ms frame at a time, as the audio arrives."""

    @property
    def chunk_size(self) -> int:
        return FRAME_BYTES


def _pipecat_tts(plane: Dataplane, heard: Heard, service: type = OpenAITTSService) -> Any:
    return service(
        api_key="unused",
        base_url=f"{plane.url}/v1",
        settings=OpenAITTSService.Settings(model="voice", voice="alloy"),
        http_client=heard.http_client(SESSION),
    )


async def _pipecat_speech(plane: Dataplane, heard: Heard, service: type) -> None:
    async def whole() -> None:
        # Every byte of the utterance, counted as it reaches the tap.
        await heard.wait(lambda: heard.audio_bytes >= WHOLE_UTTERANCE, BOUND_S, "all the audio")

    await _pipecat(_pipecat_tts(plane, heard, service), heard, TTSSpeakFrame(TEXT), whole)


SPEAKERS: dict[str, Callable[[Dataplane, Heard], Coroutine[Any, Any, None]]] = {
    "livekit-pcm": lambda plane, heard: _livekit_speech(plane, heard, max_retry=0),
    "pipecat-20ms-chunks": lambda plane, heard: _pipecat_speech(plane, heard, _PipecatTTSInFrames),
    "pipecat-default": lambda plane, heard: _pipecat_speech(plane, heard, OpenAITTSService),
}


@pytest.mark.parametrize("speaker", SPEAKERS)
def test_first_audio_reaches_the_framework_as_the_replica_sends_it(
    plane: Dataplane, speaker: str
) -> None:
    """The replica's first 20 ms frame leaves it 20 ms after the request. LiveKit (pcm) and
    Pipecat reading 20 ms chunks hand it on at once; Pipecat's default waits for 0.5 s of audio,
    25 of the replica's frames, which a replica speaking in real time takes 0.5 s to send."""
    _speak = SPEAKERS[speaker]
    run(_speak(plane, Heard()))  # modules loaded and the connection open, before the clock
    heard = Heard()
    run(_speak(plane, heard))
    assert heard.error is None, heard.error
    assert heard.sent_at is not None
    first_at, first_bytes = heard.audio[0]
    assert heard.audio_bytes >= WHOLE_UTTERANCE
    if speaker == "pipecat-default":
        assert first_bytes == 24_000  # 0.5 s of 24 kHz PCM16
        frames = first_bytes // FRAME_BYTES
        assert first_at - heard.sent_at > frames * LONG_STREAMS.itl_ms / 1000 - 0.1
    else:
        assert first_bytes <= FRAME_BYTES
        assert_within(
            first_at - heard.sent_at, LONG_STREAMS.ttft_ms / 1000, f"{speaker}'s first audio"
        )


# Speech: a replica frozen or killed mid-utterance.


def _assert_cut(heard: Heard, victim: SimulatedReplica) -> None:
    assert heard.replicas == [victim.replica_id]
    assert 0 < heard.audio_bytes < WHOLE_UTTERANCE


async def _freeze_mid_utterance(heard: Heard, victim: SimulatedReplica) -> tuple[float, float]:
    """Freezes the victim once audio flows, waits for the caller's stream to end, thaws, and
    waits a while longer for anything stale; the freeze and thaw times."""
    frozen = Frozen(victim)
    try:
        await heard.wait(lambda: heard.audio_bytes >= MID_UTTERANCE, BOUND_S, "audio flowing")
        frozen_at = frozen.__enter__()
        await heard.wait(lambda: heard.ended_at is not None, STALL_S + 1.0, "the stream's end")
    finally:
        thawed_at = frozen.thaw()
    await asyncio.sleep(0.5)  # the thawed replica's next frames are 50 ms apart
    return frozen_at, thawed_at


def _assert_ended_within_the_stall_budget(
    heard: Heard, victim: SimulatedReplica, times: tuple[float, float], who: str
) -> None:
    frozen_at, thawed_at = times
    assert heard.ended_at is not None and heard.error is not None
    assert_within(heard.ended_at - frozen_at, STALL_S, f"{who} speech on a frozen replica")
    _assert_cut(heard, victim)
    assert all(at < thawed_at for at, _ in heard.audio), "stale audio after the thaw"


def test_livekit_tts_on_a_frozen_replica_ends_within_the_stall_budget_with_no_stale_audio(
    plane: Dataplane,
) -> None:
    victim, heard = session_replica(plane, SESSION), Heard()

    async def scenario() -> None:
        speech = asyncio.ensure_future(_livekit_speech(plane, heard, max_retry=0))
        times = await _freeze_mid_utterance(heard, victim)
        await asyncio.wait_for(speech, BOUND_S)
        _assert_ended_within_the_stall_budget(heard, victim, times, "LiveKit")
        assert isinstance(heard.error, APIConnectionError), repr(heard.error)

    run(scenario())
    plane.wait_until(plane.all_up, BOUND_S, "every replica back")


def test_pipecat_tts_on_a_frozen_replica_ends_within_the_stall_budget_with_no_stale_audio(
    plane: Dataplane,
) -> None:
    victim, heard = session_replica(plane, SESSION), Heard()
    times: list[tuple[float, float]] = []

    async def freeze() -> None:
        times.append(await _freeze_mid_utterance(heard, victim))

    run(_pipecat(_pipecat_tts(plane, heard), heard, TTSSpeakFrame(TEXT), freeze))
    _assert_ended_within_the_stall_budget(heard, victim, times[0], "Pipecat")
    assert "incomplete chunked read" in str(heard.error)
    plane.wait_until(plane.all_up, BOUND_S, "every replica back")


async def _kill_mid_utterance(heard: Heard, victim: SimulatedReplica) -> float:
    """Kills the victim once audio flows and waits for the caller's stream to end; the kill time."""
    await heard.wait(lambda: heard.audio_bytes >= MID_UTTERANCE, BOUND_S, "audio flowing")
    killed_at = time.monotonic()
    victim.kill()
    await heard.wait(lambda: heard.ended_at is not None, BOUND_S, "the stream's end")
    return killed_at


def _restart(plane: Dataplane, victim: SimulatedReplica) -> None:
    victim.restart()
    plane.wait_until(plane.all_up, BOUND_S, "every replica back")


@pytest.mark.parametrize("max_retry", [0, 3], ids=["retries-off", "livekit-default-retries"])
def test_livekit_tts_whose_replica_dies_ends_at_once_or_speaks_the_start_again(
    plane: Dataplane, max_retry: int
) -> None:
    """Retries off: the stream ends at once. LiveKit's default (3 retries): the plugin sends the
    whole text again, another replica speaks it from the start, and the caller hears the
    beginning twice."""
    victim, heard = session_replica(plane, SESSION), Heard()

    async def scenario() -> float:
        speech = asyncio.ensure_future(_livekit_speech(plane, heard, max_retry))
        killed_at = await _kill_mid_utterance(heard, victim)
        await asyncio.wait_for(speech, BOUND_S)
        return killed_at

    try:
        killed_at = asyncio.run(scenario())
    finally:
        _restart(plane, victim)
    assert heard.ended_at is not None
    if max_retry == 0:
        assert heard.ended_at - killed_at < 0.1
        assert isinstance(heard.error, APIConnectionError), repr(heard.error)
        _assert_cut(heard, victim)
    else:
        assert heard.error is None, repr(heard.error)
        assert len(heard.replicas) == 2 and heard.replicas[0] == victim.replica_id
        assert heard.replicas[1] != victim.replica_id
        # The part heard before the kill, then the whole utterance again, from its start.
        before = sum(size for at, size in heard.audio if at < killed_at)
        assert 0 < before < WHOLE_UTTERANCE
        assert heard.audio_bytes - before >= WHOLE_UTTERANCE


def test_pipecat_tts_whose_replica_dies_ends_at_once(plane: Dataplane) -> None:
    victim, heard = session_replica(plane, SESSION), Heard()
    killed: list[float] = []

    async def kill() -> None:
        killed.append(await _kill_mid_utterance(heard, victim))

    try:
        run(_pipecat(_pipecat_tts(plane, heard), heard, TTSSpeakFrame(TEXT), kill))
    finally:
        _restart(plane, victim)
    assert heard.ended_at is not None and heard.ended_at - killed[0] < 0.1
    assert "incomplete chunked read" in str(heard.error)
    _assert_cut(heard, victim)


# Transcription: sent to a frozen replica, answered by another within the first-byte budget.


async def _livekit_transcribe(plane: Dataplane, heard: Heard) -> None:
    stt = livekit_openai.STT(model="voice", client=_livekit_client(plane, heard))
    one_second = rtc.AudioFrame(
        data=bytes(2 * ONE_SECOND),
        sample_rate=ONE_SECOND,
        num_channels=1,
        samples_per_channel=ONE_SECOND,
    )
    try:
        event = await stt.recognize(one_second, conn_options=APIConnectOptions(max_retry=0))
        heard.text = event.alternatives[0].text
        heard.end()
    except Exception as error:
        heard.end(error)
    finally:
        await stt.aclose()


async def _pipecat_transcribe(plane: Dataplane, heard: Heard) -> None:
    """Pipecat's segmented STT hands each spoken segment, as WAV, to run_stt: called here
    with one, as its VAD would."""
    stt = OpenAISTTService(
        api_key="unused",
        base_url=f"{plane.url}/v1",
        settings=OpenAISTTService.Settings(model="voice"),
        http_client=heard.http_client(SESSION),
    )
    async for frame in stt.run_stt(wav(1.0)):
        if isinstance(frame, ErrorFrame):
            heard.end(frame.error)
        elif frame is not None:
            heard.text = frame.text
            heard.end()


TRANSCRIBERS = {"livekit": _livekit_transcribe, "pipecat": _pipecat_transcribe}


@pytest.mark.parametrize("framework", TRANSCRIBERS)
def test_a_transcription_sent_to_a_frozen_replica_is_answered_by_another_within_its_budget(
    plane: Dataplane, framework: str
) -> None:
    transcribe = TRANSCRIBERS[framework]
    warm = Heard()  # modules loaded and the session's replica shown, before the clock
    run(transcribe(plane, warm))
    victim = plane.replicas[warm.replicas[0]]
    assert warm.error is None and victim is session_replica(plane, SESSION)
    heard = Heard()
    with Frozen(victim):
        run(transcribe(plane, heard))
    assert heard.error is None, heard.error
    assert heard.ended_at is not None and heard.sent_at is not None
    # From the request leaving the framework's HTTP client to the transcript in its hands.
    assert_within(heard.ended_at - heard.sent_at, FIRST_TOKEN_S, f"a {framework} transcription")
    assert len(heard.replicas) == 1 and heard.replicas[0] != victim.replica_id
    assert "(1.00 s of audio)" in heard.text
    plane.wait_until(plane.all_up, BOUND_S, "every replica back")


# Chat and realtime through the endpoint.


def test_livekit_llm_streams_a_whole_answer_from_the_conversations_replica(
    plane: Dataplane,
) -> None:
    heard = Heard()

    async def chat() -> None:
        model = livekit_openai.LLM(model="voice", client=_livekit_client(plane, heard))
        context = llm.ChatContext()
        context.add_message(role="user", content="Hello")
        async with model.chat(chat_ctx=context) as stream:
            async for chunk in stream:
                if chunk.delta and chunk.delta.content:
                    heard.text += chunk.delta.content
        heard.end()

    run(chat())
    assert heard.replicas == [session_replica(plane, SESSION).replica_id]
    assert heard.text.split() == [f"tok{i}" for i in range(LONG_STREAMS.tokens)]


def test_pipecat_llm_streams_a_whole_answer_from_the_conversations_replica(
    plane: Dataplane,
) -> None:
    """Pipecat's LLM service takes no HTTP client (an `http_client=` is swallowed unused): its
    headers go in `default_headers`, and the replica is read from the replicas' own counts."""
    heard = Heard()
    service = OpenAILLMService(
        api_key="unused",
        base_url=f"{plane.url}/v1",
        settings=OpenAILLMService.Settings(model="voice"),
        default_headers={**SESSION, "X-Request-Id": "pipecat-llm-turn"},
    )
    context = LLMContext(messages=[{"role": "user", "content": "Hello"}])

    async def answered() -> None:
        await heard.wait(lambda: heard.ended_at is not None, BOUND_S, "the answer")

    run(_pipecat(service, heard, LLMContextFrame(context=context), answered))
    assert heard.error is None, heard.error
    assert plane.total_requests("pipecat-llm-turn") == 1
    assert session_replica(plane, SESSION).stats()["by_request_id"]["pipecat-llm-turn"] == 1
    assert heard.text.split() == [f"tok{i}" for i in range(LONG_STREAMS.tokens)]


async def _livekit_realtime(
    plane: Dataplane, call: Callable[[Any], Coroutine[Any, Any, None]]
) -> None:
    """`call` on a LiveKit RealtimeSession through the endpoint. RealtimeModel builds its own
    headers: X-Denv-Session goes on the aiohttp session it is given."""
    async with aiohttp.ClientSession(headers=SESSION) as http:
        model = livekit_openai.realtime.RealtimeModel(
            model="voice", base_url=f"{plane.url}/v1", api_key="unused", http_session=http
        )
        session = model.session()
        try:
            await call(session)
        finally:
            await session.aclose()
            await model.aclose()


async def _realtime_turn(
    session: Any, heard: Heard, on_audio: Callable[[], None] = lambda: None
) -> None:
    """One generate_reply: its audio and transcript; the end is when the audio stream ends."""
    generation = await asyncio.wait_for(session.generate_reply(), BOUND_S)
    async for message in generation.message_stream:
        async for frame in message.audio_stream:
            heard.heard_audio(len(frame.data.tobytes()))
            on_audio()
        heard.text = "".join([piece async for piece in message.text_stream])
    heard.end()


def _realtime_turns(plane: Dataplane) -> dict[str, int]:
    return {
        r.replica_id: r.stats()["realtime_turns_completed"]
        for r in plane.replicas.values()
        if r.process.running
    }


def test_livekit_realtime_model_receives_a_turns_audio_through_the_endpoint(
    plane: Dataplane,
) -> None:
    heard = Heard()
    run(_livekit_realtime(plane, lambda session: _realtime_turn(session, heard)))
    assert heard.audio_bytes == WHOLE_UTTERANCE
    assert heard.text.split() == [f"tok{i}" for i in range(LONG_STREAMS.tokens)]
    replica = session_replica(plane, SESSION)
    assert {k: v for k, v in _realtime_turns(plane).items() if v} == {replica.replica_id: 1}


def test_livekit_realtime_session_whose_replica_dies_mid_turn_reconnects_elsewhere(
    plane: Dataplane,
) -> None:
    """The turn's audio stops at the kill (never replayed); LiveKit reconnects by itself, with
    the same X-Denv-Session, to a healthy replica, which serves the next turn whole."""
    victim = session_replica(plane, SESSION)
    cut, after = Heard(), Heard()
    killed: list[float] = []
    cut_seen: list[float] = []  # LiveKit's (recoverable) error events

    def kill_mid_turn() -> None:
        if cut.audio_bytes >= MID_UTTERANCE and not killed:
            killed.append(time.monotonic())
            victim.kill()

    async def call(session: Any) -> None:
        reconnected = asyncio.Event()
        session.on("session_reconnected", lambda _: reconnected.set())
        session.on("error", lambda _: cut_seen.append(time.monotonic()))
        await _realtime_turn(session, cut, kill_mid_turn)
        await asyncio.wait_for(reconnected.wait(), BOUND_S)
        await _realtime_turn(session, after)

    try:
        run(_livekit_realtime(plane, call))
        turns = _realtime_turns(plane)
    finally:
        _restart(plane, victim)
    # The endpoint closes the socket at once, and LiveKit sees it; it ends the turn only once
    # it has reconnected, after its first retry interval (0.1 s) and a new session's setup.
    assert cut_seen and cut.ended_at is not None
    assert_within(cut_seen[0] - killed[0], 0.0, "LiveKit sees its realtime socket closed")
    assert_within(
        cut.ended_at - killed[0], 0.1, "LiveKit ends the cut realtime turn", RECOVERY_SLACK_S
    )
    assert MID_UTTERANCE <= cut.audio_bytes < WHOLE_UTTERANCE
    assert after.audio_bytes == WHOLE_UTTERANCE
    assert {k: v for k, v in turns.items() if v} == {
        k: 1 for k in turns if k != victim.replica_id and turns[k]
    }
    assert sum(turns.values()) == 1
