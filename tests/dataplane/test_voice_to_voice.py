"""One voice-to-voice turn end to end through the benchmark's pipeline, quickly: a Pipecat
pipeline (STT, LLM, TTS through a real HAProxy to simulated replicas speaking with espeak-ng) fed
a spoken WAV. The benchmark runs the same pipeline with real engines in every stage."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from itertools import product

import pytest

from benchmarks import voice_pipeline
from benchmarks.lab.dataplane import Dataplane, PoolLayout, session_replica
from benchmarks.voice_to_voice import SESSION, STAGES, Turn, spoken_wav, turn_figures
from denv_iac.local.replica_model import ReplicaSimConfig

pytestmark = pytest.mark.needs_espeak

SIM = ReplicaSimConfig("template", ttft_ms=20, itl_ms=5, tokens=4, speech_engine="espeak-ng")
ANSWER = ["tok0", "tok1", "tok2", "tok3"]  # the simulated LLM's four tokens, as the TTS gets them
SITES = ("home-a", "home-b")
POOLS = tuple(PoolLayout(pool, ((10, SITES),)) for pool in STAGES.values())
REPLICAS = tuple(
    f"{layout.name}.{site}.n{index}.0" for index, (layout, site) in enumerate(product(POOLS, SITES))
)


def test_one_spoken_turn_comes_back_as_the_whole_answer_spoken(
    start_dataplane: Callable[..., Dataplane],
) -> None:
    plane = start_dataplane(pools=POOLS, replica_ids=REPLICAS, sim=SIM)
    pcm, rate = spoken_wav("Is the pharmacy open?")

    async def one_turn() -> Turn:
        async with voice_pipeline.VoicePipeline(
            dict.fromkeys(STAGES.values(), plane.url), SESSION, rate, max_tokens=len(ANSWER)
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
    assert [text.split() for text in turn.spoken] == [ANSWER]
    assert "".join(turn.answer).split() == ANSWER
    figures = turn_figures(turn, answer_words=4)
    assert figures["first_audio_ms"] is not None and figures["first_audio_ms"] > 0
    assert figures["spoken_fraction"] == 1.0 and figures["repeated"] == 0.0
    assert figures["heard_s"] is not None and figures["heard_s"] > 1.0  # four words of speech
    for pool in ("stt", "llm", "tts"):  # the conversation's replica of each pool served it
        served = session_replica(plane, SESSION, pool)
        assert served.stats()["requests"] >= 2
