"""The Pipecat pipeline of the voice-to-voice benchmark (see voice_to_voice): STT, LLM and TTS,
each through the endpoint (or a server of each), fed a turn as a transport and its VAD feed
one."""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["VoicePipeline"]

import httpx
import openai
from loguru import logger

from benchmarks.voice_to_voice import SPEECH, Turn

# Pipecat logs every frame through loguru at DEBUG from its import on.
logger.remove()

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # the framework's own imports
    from pipecat.frames.frames import (
        ErrorFrame,
        Frame,
        InputAudioRawFrame,
        LLMContextFrame,
        LLMTextFrame,
        TranscriptionFrame,
        TTSAudioRawFrame,
        TTSStoppedFrame,
        VADUserStartedSpeakingFrame,
        VADUserStoppedSpeakingFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.services.openai.stt import OpenAISTTService
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.workers.runner import WorkerRunner

FRAME_S = 0.02  # a transport's input audio frame
# How long a turn may take before it is called lost; a turn that reported an error is over
# once nothing more has come for QUIET_S (the framework may still speak a partial answer).
TURN_BOUND_S = 10.0
QUIET_S = 1.0


class _Tap(FrameProcessor):
    """Hands every frame passing it, either way, to `seen`."""

    def __init__(self, seen: Callable[[Frame], None]) -> None:
        super().__init__()
        self._seen = seen

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        self._seen(frame)
        await self.push_frame(frame, direction)


class _TranscriptToContext(FrameProcessor):
    """The user's transcript as the LLM's context, at once: in place of Pipecat's user context
    aggregator, whose turn-end wait is a client setting, not the endpoint's."""

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            context = LLMContext(messages=[{"role": "user", "content": frame.text}])
            frame = LLMContextFrame(context=context)
        await self.push_frame(frame, direction)


class _LLMService(OpenAILLMService):
    """Pipecat's OpenAI LLM service with an HTTP client of ours (it takes none): requests seen."""

    def __init__(self, http_client: openai.DefaultAsyncHttpxClient, **kwargs: Any) -> None:
        self._http_client = http_client
        super().__init__(**kwargs)

    def create_client(
        self,
        api_key: Any = None,
        base_url: Any = None,
        organization: Any = None,
        project: Any = None,
        default_headers: Any = None,
        **kwargs: Any,
    ) -> Any:
        return openai.AsyncOpenAI(
            api_key=api_key,
            base_url=base_url,
            organization=organization,
            project=project,
            default_headers=default_headers,
            http_client=self._http_client,
        )


class VoicePipeline:
    """One conversation's pipeline, running for all its turns."""

    def __init__(
        self,
        urls: dict[str, str],
        session: dict[str, str],
        sample_rate: int,
        max_tokens: int,
    ) -> None:
        """`urls`: each service's server, by pool (`stt`, `llm`, `tts`: the endpoint for all
        three, or a replica of each pool called directly). `max_tokens` bounds the answer, which
        is decoded greedily (temperature 0): every turn gets the same one."""
        self._urls = {pool: f"{url}/v1" for pool, url in urls.items()}
        self._session, self._rate, self._max_tokens = session, sample_rate, max_tokens
        self._turn = Turn(speech_end_at=0.0)
        self._last_frame_at = 0.0
        self._victim: Callable[[], None] | None = None
        self._killing: asyncio.Future[None] | None = None
        self._worker: PipelineWorker | None = None
        self._running: asyncio.Task[None] | None = None

    def _client(self) -> openai.DefaultAsyncHttpxClient:
        return openai.DefaultAsyncHttpxClient(
            headers=self._session, event_hooks={"request": [self._on_request]}
        )

    async def _on_request(self, request: httpx.Request) -> None:
        path = request.url.path
        self._turn.requests.append(path)
        self._turn.sent_at.append(time.monotonic())
        if path == SPEECH:
            self._turn.spoken.append(str(json.loads(request.content)["input"]))

    def _seen(self, frame: Frame) -> None:
        now = time.monotonic()
        self._last_frame_at = now
        turn = self._turn
        if isinstance(frame, TTSAudioRawFrame):
            turn.audio.append((now, len(frame.audio)))
        elif isinstance(frame, TTSStoppedFrame):
            turn.ended_at = turn.ended_at or now
        elif isinstance(frame, ErrorFrame):
            turn.errors.append(str(frame.error))

    def _after_llm(self, frame: Frame) -> None:
        """The answer's text, and the fault when asked: the victim is killed once the answer
        has started arriving."""
        if isinstance(frame, LLMTextFrame):
            self._turn.answer.append(frame.text)
            if self._victim is not None:
                kill, self._victim = self._victim, None
                self._turn.killed_at = time.monotonic()
                self._killing = asyncio.ensure_future(asyncio.to_thread(kill))
        self._seen(frame)

    async def __aenter__(self) -> VoicePipeline:
        stt = OpenAISTTService(
            api_key="unused",
            base_url=self._urls["stt"],
            settings=OpenAISTTService.Settings(model="stt"),
            http_client=self._client(),
        )
        llm = _LLMService(
            self._client(),
            api_key="unused",
            base_url=self._urls["llm"],
            settings=OpenAILLMService.Settings(
                model="llm", temperature=0.0, max_tokens=self._max_tokens
            ),
            default_headers=self._session,
        )
        tts = OpenAITTSService(
            api_key="unused",
            base_url=self._urls["tts"],
            settings=OpenAITTSService.Settings(model="tts", voice="alloy"),
            http_client=self._client(),
        )
        pipeline = Pipeline(
            [
                _Tap(self._seen),  # errors travel upstream, to here
                stt,
                _TranscriptToContext(),
                llm,
                _Tap(self._after_llm),
                tts,
                _Tap(self._seen),  # what the transport would play
            ]
        )
        self._worker = PipelineWorker(
            pipeline,
            params=PipelineParams(audio_in_sample_rate=self._rate),
            enable_rtvi=False,
            idle_timeout_secs=None,
        )
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(self._worker)
        self._running = asyncio.create_task(runner.run())
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        assert self._worker is not None and self._running is not None
        await self._worker.cancel()
        await asyncio.wait_for(self._running, TURN_BOUND_S)

    async def turn(self, pcm: bytes, kill: Callable[[], None] | None = None) -> Turn:
        """The user says `pcm`; what the caller gets back. `kill` is called mid-turn (see
        _after_llm)."""
        assert self._worker is not None
        step = round(self._rate * FRAME_S) * 2
        audio = [
            InputAudioRawFrame(audio=pcm[at : at + step], sample_rate=self._rate, num_channels=1)
            for at in range(0, len(pcm), step)
        ]
        self._turn = Turn(speech_end_at=0.0)
        await self._worker.queue_frames([VADUserStartedSpeakingFrame(), *audio])
        await asyncio.sleep(0.1)  # the speech reaches the STT's buffer
        self._victim = kill
        turn = self._turn
        turn.speech_end_at = self._last_frame_at = time.monotonic()
        await self._worker.queue_frames([VADUserStoppedSpeakingFrame()])
        while turn.ended_at is None:
            now = time.monotonic()
            if now - turn.speech_end_at > TURN_BOUND_S:
                break
            if turn.errors and now - self._last_frame_at > QUIET_S:
                break
            await asyncio.sleep(0.005)
        if self._killing is not None:
            await self._killing
            self._killing = None
        return turn
