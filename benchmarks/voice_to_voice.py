"""Voice to voice: one spoken turn through the endpoint, timed as the caller feels it.

A Pipecat pipeline, [OpenAISTTService, transcript-to-context, OpenAILLMService,
OpenAITTSService], every service pointed at one local endpoint (a real HAProxy running the
generated config) with pools `stt`, `llm` and `tts` of two simulated replicas each, and every
request carrying the conversation's X-Denv-Session. Each turn is fed as a transport feeds it:
VADUserStartedSpeakingFrame, a spoken WAV (espeak-ng's voice, made at bench time) in 20 ms
InputAudioRawFrames, VADUserStoppedSpeakingFrame. The clock starts when that last frame is
queued (the VAD's own stop_secs, Pipecat's default 0.2 s, comes on top and is not counted)
and stops when the first TTSAudioRawFrame reaches the end of the pipeline: what the caller
would hear first.

Engines: speech is espeak-ng, a real CPU engine (`pcm`, resampled to 24 kHz by the replica);
transcription and the LLM are simulated (the transcription answers after TTFT_MS, the answer
streams TOKENS words, one sentence, the first after TTFT_MS and then one every ITL_MS, so
Pipecat's sentence aggregation sends it to the TTS whole). The transcript-to-context step
stands in for Pipecat's user context aggregator, without its turn-end wait.

Figures:
- first_audio_p50_ms / _p90_ms over TURNS turns through the endpoint; direct_first_audio_p50_ms,
  the same pipeline calling the conversation's replica of each pool directly, turn for turn
  alternating with it, and endpoint_added_p50_ms / first_audio_ratio between the two.
- simulated_engine_ms, the simulated engines' share of each turn (transcription plus the whole
  answer); espeak_first_byte_ms, espeak-ng's own start-up run directly; stt_sent / llm_sent /
  tts_sent_p50_ms, when each service's request left Pipecat: where the turn's time goes.
- llm_killed_* and tts_killed_*: the same turn while the conversation's LLM replica dies
  once its answer has started reaching the pipeline, or its TTS replica dies then (before the
  turn's speech request, which the endpoint retries on the other replica: nothing reached the
  caller). For each, over FAULT_TRIALS turns: first_audio_ms (the worst), heard_s (audio the
  caller hears in that turn), spoken_fraction (words of the answer spoken), repeated (requests
  sent twice in one turn: a caller hearing something twice), errors (turns the framework
  reported an error in), next_turn_first_audio_ms (the next turn, at once, on the same
  conversation).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from denv_iac.local import voice_sim
from denv_iac.local.replica_sim import ReplicaSimConfig
from denv_iac.ops.loadgen import percentile

PCM_BYTES_PER_S = voice_sim.SAMPLE_RATE * 2  # what Pipecat's OpenAI TTS hands on: 24 kHz PCM16
TTFT_MS = 100.0
ITL_MS = 15.0
TOKENS = 12
TURNS = 20
FAULT_TRIALS = 3
SESSION = {"X-Denv-Session": "voice-to-voice-call"}
USER_SAYS = "What time does the pharmacy on Main Street open tomorrow?"
# The caller's voice: espeak-ng's American English with its Klatt voice at 150 words a minute,
# the one of its voices pocketsphinx's en-us model hears best (7 of these 10 words; the default
# voice, 1 to 3).
CALLER_VOICE = ("-v", "en-us+klatt", "-s", "150")
STAGES = {
    "/v1/audio/transcriptions": "stt",
    "/v1/chat/completions": "llm",
    "/v1/audio/speech": "tts",
}
# The simulated LLM's answer, as the TTS receives it.
ANSWER = " ".join(f"tok{i}" for i in range(TOKENS))


@dataclass
class Turn:
    """What one turn's caller got, on the monotonic clock."""

    speech_end_at: float
    audio: list[tuple[float, int]] = field(default_factory=list)  # (when, bytes) at 24 kHz
    requests: list[str] = field(default_factory=list)  # paths, as they left the client
    spoken: list[str] = field(default_factory=list)  # the texts sent to the TTS
    errors: list[str] = field(default_factory=list)
    ended_at: float | None = None  # the TTS said it stopped
    killed_at: float | None = None
    sent_at: list[float] = field(default_factory=list)  # when each of `requests` left


def turn_figures(turn: Turn, answer_words: int) -> dict[str, float | None]:
    """One turn's accounting: first audio after the end of speech (None: the caller heard
    nothing), seconds of audio heard, the share of the answer's words sent to the TTS, requests
    sent more than once, and whether the framework reported an error."""
    heard = sum(size for _, size in turn.audio)
    sent = Counter(turn.requests)
    words = sum(len(text.split()) for text in turn.spoken)
    return {
        "first_audio_ms": (turn.audio[0][0] - turn.speech_end_at) * 1000 if turn.audio else None,
        "heard_s": heard / PCM_BYTES_PER_S,
        "spoken_fraction": words / answer_words if answer_words else 0.0,
        "repeated": float(sum(count - 1 for count in sent.values())),
        "errors": 1.0 if turn.errors else 0.0,
    }


def stage_ms(turn: Turn) -> dict[str, float]:
    """When each service's first request of the turn left the client, in ms after the end of
    speech: where a turn's time goes (stt_sent: Pipecat's own segment handling; llm_sent: the
    transcription; tts_sent: the whole answer, as sentence aggregation waits for it)."""
    stages: dict[str, float] = {}
    for path, at in zip(turn.requests, turn.sent_at, strict=True):
        stage = f"{STAGES.get(path, path)}_sent"
        stages.setdefault(stage, (at - turn.speech_end_at) * 1000)
    return stages


def summarize_faults(
    prefix: str, faulted: list[dict[str, float | None]], next_turns: list[dict[str, float | None]]
) -> dict[str, float]:
    """The fault trials in a few numbers: the worst first audio (NaN: some turn was silent),
    the least audio heard and least of the answer spoken, and the totals of repeats and errors."""
    firsts = [f["first_audio_ms"] for f in faulted]
    nexts = [f["first_audio_ms"] for f in next_turns]
    return {
        f"{prefix}_first_audio_max_ms": _worst(firsts),
        f"{prefix}_silent_turns": float(sum(value is None for value in firsts)),
        f"{prefix}_heard_min_s": min(float(f["heard_s"] or 0.0) for f in faulted),
        f"{prefix}_spoken_fraction_min": min(float(f["spoken_fraction"] or 0.0) for f in faulted),
        f"{prefix}_repeated": sum(float(f["repeated"] or 0.0) for f in faulted),
        f"{prefix}_errors": sum(float(f["errors"] or 0.0) for f in faulted),
        f"{prefix}_next_turn_first_audio_max_ms": _worst(nexts),
    }


def _worst(values: list[float | None]) -> float:
    if not values or any(value is None for value in values):
        return float("nan")
    return max(float(value) for value in values if value is not None)


def spoken_wav(text: str) -> tuple[bytes, int]:
    """espeak-ng saying `text`: its PCM16 mono samples and their rate."""
    wav = subprocess.run(
        ["espeak-ng", *CALLER_VOICE, "--stdout", "--", text],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    start = wav.find(b"data") + 8
    rate = int.from_bytes(wav[24:28], "little")
    pcm = wav[start:]
    return pcm[: len(pcm) // 2 * 2], rate


def espeak_first_byte_ms(text: str) -> float:
    """espeak-ng's own time from start to its first byte of speech, run directly."""
    started = time.monotonic()
    with subprocess.Popen(
        ["espeak-ng", "--stdout", "--", text], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    ) as engine:
        assert engine.stdout is not None
        engine.stdout.read(1)
        first = time.monotonic() - started
        engine.stdout.read()
    return first * 1000


def run() -> dict[str, float]:
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed (make setup installs it)")
    from benchmarks import voice_pipeline
    from tests.dataplane.dataplane_harness import Dataplane

    sim = ReplicaSimConfig(
        "template", ttft_ms=TTFT_MS, itl_ms=ITL_MS, tokens=TOKENS, speech_engine="espeak-ng"
    )
    with tempfile.TemporaryDirectory(prefix="denv-voice-to-voice-bench-") as workdir:
        plane = Dataplane.start(
            Path(workdir),
            pools=voice_pipeline.POOLS,
            replica_ids=voice_pipeline.REPLICAS,
            sim=sim,
        )
        try:
            return asyncio.run(_measure(plane, voice_pipeline))
        finally:
            plane.close()


async def _measure(plane: Any, pipeline: Any) -> dict[str, float]:
    pcm, rate = spoken_wav(USER_SAYS)
    endpoint = dict.fromkeys(pipeline.SERVICES, plane.url)
    # The baseline: the same pipeline calling the conversation's replica of each pool directly.
    direct = {
        pool: pipeline.session_replica(plane, SESSION, pool).url for pool in pipeline.SERVICES
    }
    async with (
        pipeline.VoicePipeline(endpoint, SESSION, rate) as voice,
        pipeline.VoicePipeline(direct, SESSION, rate) as baseline,
    ):
        firsts: dict[str, list[float]] = {"endpoint": [], "direct": []}
        stages: dict[str, list[float]] = {}
        for index in range(TURNS + 1):  # the first of each warms up: modules, connections
            for path, pipe in (("endpoint", voice), ("direct", baseline)):
                turn = await pipe.turn(pcm)
                figures = turn_figures(turn, TOKENS)
                if path == "endpoint" and index:
                    for stage, ms in stage_ms(turn).items():
                        stages.setdefault(stage, []).append(ms)
                if figures["first_audio_ms"] is None or figures["errors"]:
                    raise RuntimeError(f"a turn with no fault failed ({path}): {figures}")
                firsts[path].append(float(figures["first_audio_ms"]))
        through, baseline_firsts = firsts["endpoint"][1:], firsts["direct"][1:]
        p50, direct_p50 = percentile(through, 50), percentile(baseline_firsts, 50)
        assert p50 is not None and direct_p50 is not None
        out = {
            "turns": float(TURNS),
            "first_audio_p50_ms": p50,
            "first_audio_p90_ms": percentile(through, 90) or float("nan"),
            "direct_first_audio_p50_ms": direct_p50,
            "endpoint_added_p50_ms": p50 - direct_p50,
            "first_audio_ratio": p50 / direct_p50,
            "simulated_engine_ms": TTFT_MS + TTFT_MS + (TOKENS - 1) * ITL_MS,
            "espeak_first_byte_ms": percentile([espeak_first_byte_ms(ANSWER) for _ in range(5)], 50)
            or float("nan"),
            "user_speech_s": len(pcm) / 2 / rate,
        }
        for stage in ("stt_sent", "llm_sent", "tts_sent"):
            out[f"{stage}_p50_ms"] = percentile(stages.get(stage, []), 50) or float("nan")
        for prefix, pool in (("llm_killed", "llm"), ("tts_killed", "tts")):
            faulted, next_turns = [], []
            for _ in range(FAULT_TRIALS):
                victim = pipeline.session_replica(plane, SESSION, pool)
                turn = await voice.turn(pcm, kill=victim)
                faulted.append(turn_figures(turn, TOKENS))
                next_turns.append(turn_figures(await voice.turn(pcm), TOKENS))
                await asyncio.to_thread(_restart, plane, victim)
            out.update(summarize_faults(prefix, faulted, next_turns))
    return {key: round(value, 3) for key, value in out.items()}


def _restart(plane: Any, victim: Any) -> None:
    victim.restart()
    plane.wait_until(plane.all_up, 10, "every replica back")


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:40} {value}")
