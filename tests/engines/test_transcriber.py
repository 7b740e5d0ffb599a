"""The transcription replica, pocketsphinx behind OpenAI's transcription API, as the local runner
starts it from a recipe's command and as the openai SDK calls it: the words of a spoken sentence
come back (as JSON or text), the audio at any rate and channel count is heard as the model
hears it, and bad input is one line."""

import io
import re
import sys
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from benchmarks.voice_to_voice import spoken_wav
from denv_iac.local.command_replica import CommandConfig, CommandReplica
from denv_iac.local.processes import free_port
from denv_iac.local.transcriber import MODEL_RATE, model_pcm

pytestmark = pytest.mark.needs_espeak

SAID = "What time does the pharmacy on Main Street open tomorrow?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = CommandConfig(
        replica_id="stt.local.node-a.0",
        recipe="stt",
        command=(
            sys.executable,
            "-m",
            "denv_iac.local.transcriber",
            "--host",
            "{host}",
            "--port",
            "{port}",
        ),
        host="127.0.0.1",
        port=free_port(),
        health_path="/health",
        ready_timeout_s=60.0,
        workdir=str(Path(__file__).resolve().parents[2]),
    )
    replica = CommandReplica(config, tmp_path_factory.mktemp("stt") / "stt.log")
    replica.spawn()
    replica.wait_ready()
    yield f"http://127.0.0.1:{config.port}"
    replica.stop()


def wav(samples: np.ndarray, rate: int) -> bytes:
    """PCM16 samples (one column a channel) as a WAV file."""
    out = io.BytesIO()
    with wave.open(out, "wb") as audio:
        audio.setnchannels(samples.shape[1] if samples.ndim == 2 else 1)
        audio.setsampwidth(2)
        audio.setframerate(rate)
        audio.writeframes(samples.astype("<i2").tobytes())
    return out.getvalue()


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def recall(heard: str) -> float:
    said = words(SAID)
    return sum(word in words(heard) for word in said) / len(said)


def test_spoken_sentence_comes_back_with_most_words_right(server: str) -> None:
    pcm, rate = spoken_wav(SAID)
    mono = np.frombuffer(pcm, "<i2")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    heard = client.audio.transcriptions.create(model="stt", file=("said.wav", wav(mono, rate)))
    assert recall(heard.text) >= 0.6, heard.text
    # As plain text, when asked.
    text = client.audio.transcriptions.create(
        model="stt", file=("said.wav", wav(mono, rate)), response_format="text"
    )
    assert str(text).strip() == heard.text


def test_audio_is_heard_as_the_model_hears_it_mono_at_16_khz() -> None:
    second = np.arange(48_000) % 100 * 100
    pcm = model_pcm(wav(np.column_stack([second, second]), 48_000))
    assert len(pcm) == MODEL_RATE * 2  # one second of PCM16
    assert model_pcm(wav(np.zeros(MODEL_RATE), MODEL_RATE)) == bytes(MODEL_RATE * 2)
    eight_bit = io.BytesIO()
    with wave.open(eight_bit, "wb") as audio:
        audio.setnchannels(1)
        audio.setsampwidth(1)
        audio.setframerate(8000)
        audio.writeframes(bytes(800))
    with pytest.raises(ValueError, match="8-bit samples; send 16-bit PCM"):
        model_pcm(eight_bit.getvalue())


@pytest.mark.parametrize(
    ("files", "data", "expected"),
    [
        (
            {"file": ("a.wav", b"not audio")},
            {"model": "stt"},
            "invalid upload: the file is not a WAV",
        ),
        ({"model": (None, b"stt")}, {}, "invalid upload: the form has no file part"),
    ],
)
def test_bad_input_is_one_line(
    server: str, files: dict[str, tuple[str | None, bytes]], data: dict[str, str], expected: str
) -> None:
    answer = httpx.post(f"{server}/v1/audio/transcriptions", files=files, data=data)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert message.startswith(expected) and "\n" not in message
