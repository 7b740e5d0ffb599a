"""Voice to voice: one spoken turn through the endpoint, timed as the caller feels it, with
every stage a real engine on the CPU.

A Pipecat pipeline, [OpenAISTTService, transcript-to-context, OpenAILLMService,
OpenAITTSService], every service pointed at one local endpoint (a real HAProxy running the
generated config) of stacks/Pulumi.local-voice.yaml under the local runner and its supervisor:
pools `stt`, `llm` and `tts` of two replicas each, and every request carrying the
conversation's X-Denv-Session. Engines, none simulated:
- transcription: pocketsphinx 5 with the en-us model its wheel ships
  (denv_iac.local.transcriber, the recipe's `command`), one utterance at a time per server;
- the answer: llama.cpp's llama-server serving SmolLM2-135M-Instruct (Q4_1) on one thread, two
  slots (the recipe's `command`, as stacks/Pulumi.local-llama.yaml runs it), temperature 0 and
  at most MAX_TOKENS tokens, so every turn gets the same bounded answer;
- speech: espeak-ng (`pcm`, resampled to 24 kHz by the replica as it streams).
Each turn is fed as a transport feeds it: VADUserStartedSpeakingFrame, a spoken WAV (espeak-ng's
Klatt voice saying USER_SAYS, made at bench time) in 20 ms InputAudioRawFrames,
VADUserStoppedSpeakingFrame. The clock starts when that last frame is queued (the VAD's own
stop_secs, Pipecat's default 0.2 s, comes on top and is not counted) and stops when the first
TTSAudioRawFrame reaches the end of the pipeline: what the caller would hear first. The
transcript-to-context step stands in for Pipecat's user context aggregator, without its turn-end
wait.

These are CPU figures, on whatever machine runs the bench (two shared cores where the README's
were taken). A GPU changes the engines' share, not the endpoint's: a GPU recogniser (Whisper on
vLLM or faster-whisper) transcribes a few seconds of speech in tens of milliseconds where
pocketsphinx takes most of a second here, a GPU LLM of useful size makes its first sentence in
about 100-300 ms, and a neural TTS its first audio in about 100-200 ms; the balancer's added
time per request (under 1 ms, measured alone) stays what it is.

Figures:
- first_audio_p50_ms / _p90_ms over TURNS turns through the endpoint; direct_first_audio_p50_ms
  / _p90_ms, the same pipeline calling the conversation's replica of each pool directly, turn for
  turn alternating with it, and endpoint_added_p50_ms / first_audio_ratio between the two.
- where the turn's time goes, p50 over the turns through the endpoint, each with its share of
  that turn's first audio: pipeline_ms (end of speech until the transcription request leaves
  Pipecat), stt_ms (until the chat request leaves: the upload and its decoding), llm_ms (until
  the first speech request leaves: the answer's first sentence, as sentence aggregation waits
  for it), tts_ms (until the first audio); espeak_first_byte_ms, espeak-ng's own start-up run
  directly; answer_words, the words of the answer.
- llm_killed_* and tts_killed_*: the same turn while the conversation's LLM replica is killed
  (SIGKILL; the supervisor starts it again) once its answer has started reaching the pipeline,
  or its TTS replica is killed then (before the turn's speech request, which the endpoint
  retries on the other replica: nothing reached the caller). For each, over FAULT_TRIALS turns:
  first_audio_ms (the worst), heard_s (audio the caller hears in that turn), spoken_fraction
  (words sent to the TTS, of the whole answer of a turn with no fault), repeated (requests sent
  twice in one turn: a caller hearing something twice), errors (turns the framework reported an
  error in), next_turn_first_audio_ms (the next turn, at once, on the same conversation).
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import wave
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from denv_iac.haproxy.runtime import server_stats
from denv_iac.local.processes import free_port
from denv_iac.local.run_state import ReplicaState, RunState
from denv_iac.local.runner import LocalCluster, supervised
from denv_iac.ops.llama import build_engine
from denv_iac.ops.loadgen_report import percentile
from denv_iac.stacks_dir import load_stack
from denv_iac.wire.audio import SAMPLE_RATE

PCM_BYTES_PER_S = SAMPLE_RATE * 2  # what Pipecat's OpenAI TTS hands on: 24 kHz PCM16
STACK = "local-voice"
MAX_TOKENS = 24  # the answer: a sentence or two, so that a turn is bounded
TURNS = 20
FAULT_TRIALS = 3
SESSION = {"X-Denv-Session": "voice-to-voice-call"}
USER_SAYS = "What time does the pharmacy on Main Street open tomorrow?"
# The caller's voice: espeak-ng's American English with its Klatt voice at 150 words a minute,
# the one of its voices pocketsphinx's en-us model hears best (7 of these 10 words; the default
# voice, 1 to 3).
CALLER_VOICE = ("-v", "en-us+klatt", "-s", "150")
SPEECH = "/v1/audio/speech"
STAGES = {
    "/v1/audio/transcriptions": "stt",
    "/v1/chat/completions": "llm",
    SPEECH: "tts",
}


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
    answer: list[str] = field(default_factory=list)  # the LLM's text, as it reached the pipeline


def turn_figures(turn: Turn, answer_words: int) -> dict[str, float | None]:
    """One turn's accounting: first audio after the end of speech (None: the caller heard
    nothing), seconds of audio heard, the share of the answer's words sent to the TTS, requests
    sent more than once (the same path, and for speech the same text), and whether the framework
    reported an error."""
    heard = sum(size for _, size in turn.audio)
    texts = iter(turn.spoken)  # a speech request's text: an answer of two sentences is two
    sent = Counter((path, next(texts) if path in SPEECH else "") for path in turn.requests)
    words = sum(len(text.split()) for text in turn.spoken)
    return {
        "first_audio_ms": (turn.audio[0][0] - turn.speech_end_at) * 1000 if turn.audio else None,
        "heard_s": heard / PCM_BYTES_PER_S,
        "spoken_fraction": words / answer_words if answer_words else 0.0,
        "repeated": float(sum(count - 1 for count in sent.values())),
        "errors": 1.0 if turn.errors else 0.0,
    }


def stage_ms(turn: Turn) -> dict[str, float]:
    """Where one turn's time went, in ms, from the end of speech to the first audio: each stage
    until the next service's first request of the turn left the client (pipeline: Pipecat's own
    segment handling; stt: the transcription; llm: the answer's first sentence, as sentence
    aggregation waits for it; tts: the first audio). A stage the turn never reached is absent."""
    left: dict[str, float] = {}
    for path, at in zip(turn.requests, turn.sent_at, strict=True):
        left.setdefault(STAGES.get(path, path), at)
    marks = [("pipeline", turn.speech_end_at)]
    for stage in ("stt", "llm", "tts"):
        if stage not in left:
            break
        marks.append((stage, left[stage]))
    else:
        if turn.audio:
            marks.append(("", turn.audio[0][0]))
    return {stage: (then - at) * 1000 for (stage, at), (_, then) in pairwise(marks)}


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
    engine = build_engine(Path(__file__).parent)
    stack = load_stack(engine.project / "stacks", STACK)
    with tempfile.TemporaryDirectory(prefix="denv-voice-to-voice-bench-") as workdir:
        cluster = LocalCluster(stack, Path(workdir), free_port(), project=engine.project)
        with supervised(cluster):
            return asyncio.run(_measure(cluster))


def _state(cluster: LocalCluster) -> RunState:
    assert cluster.state is not None
    return cluster.state


def session_replica(cluster: LocalCluster, pool: str) -> ReplicaState:
    """The replica of `pool` that serves the conversation now: the balancer names it on the
    answer to a small request of the conversation's (a tenth of a second of silence to
    transcribe, one token, the word "yes" spoken)."""
    state = _state(cluster)
    silence = io.BytesIO()
    with wave.open(silence, "wb") as audio:
        audio.setnchannels(1)
        audio.setsampwidth(2)
        audio.setframerate(16_000)
        audio.writeframes(bytes(3_200))
    requests: dict[str, dict[str, Any]] = {
        "stt": {"data": {"model": pool}, "files": {"file": ("silence.wav", silence.getvalue())}},
        "llm": {
            "json": {
                "model": pool,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "Hi"}],
            }
        },
        "tts": {"json": {"model": pool, "input": "yes", "response_format": "pcm"}},
    }
    path = next(path for path, stage in STAGES.items() if stage == pool)
    answer = httpx.post(f"{state.endpoint}{path}", headers=SESSION, timeout=30, **requests[pool])
    answer.raise_for_status()
    served = answer.headers["X-Denv-Replica"]
    return next(replica for replica in state.replicas if replica.id == served)


def _kill(replica: ReplicaState) -> None:
    """SIGKILL, to the replica's whole process group when it leads one (a recipe's command)."""
    if replica.group:
        os.killpg(replica.pid, signal.SIGKILL)
    else:
        os.kill(replica.pid, signal.SIGKILL)


def _all_in_rotation(cluster: LocalCluster) -> None:
    """Until every replica is back in rotation (a killed one restarted by the supervisor)."""
    state = _state(cluster)
    wanted = {replica.id for replica in state.replicas}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = server_stats(Path(state.admin_socket))
        if wanted <= {name for name, row in rows.items() if row["status"] == "UP"}:
            return
        time.sleep(0.05)
    raise RuntimeError("a killed replica was not back in rotation within 60 s")


async def _measure(cluster: LocalCluster) -> dict[str, float]:
    from benchmarks.voice_pipeline import VoicePipeline

    pcm, rate = spoken_wav(USER_SAYS)
    endpoint = dict.fromkeys(STAGES.values(), _state(cluster).endpoint)
    # The baseline: the same pipeline calling the conversation's replica of each pool directly.
    direct = {pool: session_replica(cluster, pool).url for pool in STAGES.values()}
    async with (
        VoicePipeline(endpoint, SESSION, rate, MAX_TOKENS) as voice,
        VoicePipeline(direct, SESSION, rate, MAX_TOKENS) as baseline,
    ):
        firsts: dict[str, list[float]] = {"endpoint": [], "direct": []}
        stages: dict[str, list[float]] = {}
        answer_words = 0
        for index in range(TURNS + 1):  # the first of each warms up: modules, connections
            for path, pipe in (("endpoint", voice), ("direct", baseline)):
                turn = await pipe.turn(pcm)
                answer_words = answer_words or len("".join(turn.answer).split())
                figures = turn_figures(turn, answer_words)
                if figures["first_audio_ms"] is None or figures["errors"]:
                    raise RuntimeError(
                        f"a turn with no fault failed ({path}): {turn.errors[:1]} {figures}"
                    )
                first = float(figures["first_audio_ms"])
                firsts[path].append(first)
                if path == "endpoint" and index:
                    for stage, ms in stage_ms(turn).items():
                        stages.setdefault(stage, []).append(ms)
                        stages.setdefault(f"{stage}_share", []).append(ms / first)
        through, baseline_firsts = firsts["endpoint"][1:], firsts["direct"][1:]
        p50, direct_p50 = percentile(through, 50), percentile(baseline_firsts, 50)
        assert p50 is not None and direct_p50 is not None
        out = {
            "turns": float(TURNS),
            "first_audio_p50_ms": p50,
            "first_audio_p90_ms": percentile(through, 90) or float("nan"),
            "direct_first_audio_p50_ms": direct_p50,
            "direct_first_audio_p90_ms": percentile(baseline_firsts, 90) or float("nan"),
            "endpoint_added_p50_ms": p50 - direct_p50,
            "first_audio_ratio": p50 / direct_p50,
            "answer_words": float(answer_words),
            "user_speech_s": len(pcm) / 2 / rate,
        }
        for stage in ("pipeline", "stt", "llm", "tts"):
            out[f"{stage}_p50_ms"] = percentile(stages.get(stage, []), 50) or float("nan")
            out[f"{stage}_share_p50"] = percentile(stages.get(f"{stage}_share", []), 50) or 0.0
        out["espeak_first_byte_ms"] = percentile(
            [espeak_first_byte_ms(USER_SAYS) for _ in range(5)], 50
        ) or float("nan")
        for prefix, pool in (("llm_killed", "llm"), ("tts_killed", "tts")):
            faulted, next_turns = [], []
            for _ in range(FAULT_TRIALS):
                victim = await asyncio.to_thread(session_replica, cluster, pool)
                turn = await voice.turn(pcm, kill=partial(_kill, victim))
                faulted.append(turn_figures(turn, answer_words))
                next_turns.append(turn_figures(await voice.turn(pcm), answer_words))
                await asyncio.to_thread(_all_in_rotation, cluster)
            out.update(summarize_faults(prefix, faulted, next_turns))
    return {key: round(value, 3) for key, value in out.items()}


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:40} {value}")
