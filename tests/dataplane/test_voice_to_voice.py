"""One voice-to-voice turn end to end, as the benchmark runs it: a Pipecat pipeline (STT, LLM,
TTS through a real HAProxy to simulated replicas speaking with espeak-ng) fed a spoken WAV."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from benchmarks import voice_pipeline
from benchmarks.voice_to_voice import ANSWER, SESSION, Turn, spoken_wav, turn_figures
from denv_iac.local.replica_sim import ReplicaSimConfig

from .dataplane_harness import Dataplane

pytestmark = pytest.mark.needs_espeak

SIM = ReplicaSimConfig("template", ttft_ms=20, itl_ms=5, tokens=4, speech_engine="espeak-ng")


def test_one_spoken_turn_comes_back_as_the_whole_answer_spoken(
    start_dataplane: Callable[..., Dataplane],
) -> None:
    plane = start_dataplane(
        pools=voice_pipeline.POOLS, replica_ids=voice_pipeline.REPLICAS, sim=SIM
    )
    pcm, rate = spoken_wav("Is the pharmacy open?")

    async def one_turn() -> Turn:
        async with voice_pipeline.VoicePipeline(
            dict.fromkeys(voice_pipeline.SERVICES, plane.url), SESSION, rate
        ) as voice:
            return await voice.turn(pcm)

    turn = asyncio.run(one_turn())
    assert turn.errors == [] and turn.ended_at is not None
    # Each service through the endpoint once, in a pipeline's order; the answer spoken whole.
    assert turn.requests == [
        "/v1/audio/transcriptions",
        "/v1/chat/completions",
        "/v1/audio/speech",
    ]
    assert [text.split() for text in turn.spoken] == [ANSWER.split()[:4]]
    figures = turn_figures(turn, answer_words=4)
    assert figures["first_audio_ms"] is not None and figures["first_audio_ms"] > 0
    assert figures["spoken_fraction"] == 1.0 and figures["repeated"] == 0.0
    assert figures["heard_s"] is not None and figures["heard_s"] > 1.0  # four words of speech
    for pool in ("stt", "llm", "tts"):  # the conversation's replica of each pool served it
        served = voice_pipeline.session_replica(plane, SESSION, pool)
        assert served.stats()["requests"] >= 2
