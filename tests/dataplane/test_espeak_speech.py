"""Real synthesized speech end to end: replicas whose /v1/audio/speech is espeak-ng, through a
real HAProxy, called with the official SDK."""

from __future__ import annotations

import io
import struct
import urllib.request
import wave
from collections.abc import Callable, Iterator

import openai
import pytest

from benchmarks.lab.dataplane import Dataplane
from denv_iac.local.replica_model import ReplicaSimConfig

pytestmark = pytest.mark.needs_espeak

ESPEAK = ReplicaSimConfig("template", ttft_ms=20, itl_ms=5, tokens=8, speech_engine="espeak-ng")


@pytest.fixture
def sdk(start_dataplane: Callable[..., Dataplane]) -> Iterator[openai.OpenAI]:
    plane = start_dataplane(sim=ESPEAK)
    client = openai.OpenAI(base_url=f"{plane.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


def test_speech_is_espeak_ng_s_wav_streamed_through_the_balancer(sdk: openai.OpenAI) -> None:
    text = "The balancer carries real speech."
    with sdk.audio.speech.with_streaming_response.create(
        model="voice", voice="alloy", input=text, response_format="wav"
    ) as response:
        assert response.headers["x-denv-replica"].startswith("voice.")
        assert response.headers["content-type"] == "audio/wav"
        audio = b"".join(response.iter_bytes())
    # espeak-ng streams: the header's sizes say "unknown"; its format is what counts.
    with wave.open(io.BytesIO(audio)) as header:
        audio_format = (header.getframerate(), header.getnchannels(), header.getsampwidth())
    assert audio_format == (22050, 1, 2)
    pcm = audio[44 : len(audio) // 2 * 2]
    samples = struct.unpack(f"<{len(pcm) // 2}h", pcm)
    seconds = len(samples) / 22050
    assert 1.0 < seconds < 6.0, seconds  # six words of speech
    assert max(abs(s) for s in samples) > 3000  # a voice, not silence


def test_pcm_is_espeak_ng_s_speech_at_24_khz(sdk: openai.OpenAI) -> None:
    """`pcm` is OpenAI's raw 24 kHz PCM16: espeak-ng's 22.05 kHz samples, resampled, the same
    length of speech as its WAV."""
    text = "The balancer carries real speech."
    wav_answer = sdk.audio.speech.create(
        model="voice", voice="alloy", input=text, response_format="wav"
    )
    pcm_answer = sdk.audio.speech.create(
        model="voice", voice="alloy", input=text, response_format="pcm"
    )
    assert pcm_answer.response.headers["content-type"] == "audio/pcm"
    pcm, wav_samples = pcm_answer.content, (len(wav_answer.content) - 44) // 2
    assert not pcm.startswith(b"RIFF") and len(pcm) % 2 == 0
    assert abs(len(pcm) // 2 / 24_000 - wav_samples / 22_050) < 0.001  # seconds of speech
    samples = struct.unpack(f"<{len(pcm) // 2}h", pcm)
    assert max(abs(s) for s in samples) > 3000


@pytest.mark.parametrize("response_format", ["mp3", "opus", "aac", "flac"])
def test_a_format_not_served_is_refused_in_openai_s_error_shape(
    sdk: openai.OpenAI, response_format: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.audio.speech.create(
            model="voice",
            voice="alloy",
            input="hi",
            response_format=response_format,  # type: ignore[arg-type]
        )
    error = refused.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert error["code"] == "unsupported_response_format"
    assert "send one of pcm, wav" in error["message"]


def _generation_tokens(replica_url: str) -> float:
    page = urllib.request.urlopen(f"{replica_url}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in page.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


def test_speech_is_the_engines_progress_while_it_streams(
    start_dataplane: Callable[..., Dataplane],
) -> None:
    """The agent calls an engine with requests running and no progress for its stall budget
    stalled, and the balancer then cuts its streams: a sentence espeak-ng takes over a second to
    write on a busy CPU must read as progress, as a token does, not as a wedged engine."""
    plane = start_dataplane(sim=ESPEAK)
    client = openai.OpenAI(base_url=f"{plane.url}/v1", api_key="unused", max_retries=0)
    with client.audio.speech.with_streaming_response.create(
        model="voice", voice="alloy", input="Progress is audio written.", response_format="wav"
    ) as response:
        replica = plane.replicas[response.headers["x-denv-replica"]]
        pieces = response.iter_bytes()
        next(pieces)
        while_streaming = _generation_tokens(replica.url)
        b"".join(pieces)
    client.close()
    assert while_streaming >= 1
