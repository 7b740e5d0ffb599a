"""Routing every API path by its body through a real HAProxy, driven by the official openai SDK:
the model field of JSON and of multipart uploads, aliases from a recipe's `models:` list, and the
balancer's own answers when a body cannot be routed."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from benchmarks.lab.dataplane import FAST_REPLICA, STANDARD_POOLS, Dataplane, PoolLayout
from denv_iac.wire.audio import FRAME_BYTES, audio_frame

WHISPER = "openai/whisper-large-v3"
SMALL_LLM = "small-llm:8b"
# Audio has NUL bytes; HAProxy's regex matching stops at the first one.
WAV = b"RIFF\x24\x08\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00" + bytes(2000)


@pytest.fixture
def plane(start_dataplane: Callable[..., Dataplane]) -> Dataplane:
    voice, llm = STANDARD_POOLS
    return start_dataplane(
        pools=(
            PoolLayout(voice.name, voice.tiers, models=(WHISPER, "tts-1")),
            PoolLayout(llm.name, llm.tiers, llm.session_affinity, models=(SMALL_LLM,)),
        )
    )


@pytest.fixture
def sdk(plane: Dataplane) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{plane.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


def _requests(plane: Dataplane) -> int:
    return sum(r.stats()["requests"] for r in plane.replicas.values())


def test_chat_is_routed_by_an_alias_and_streams(plane: Dataplane, sdk: openai.OpenAI) -> None:
    raw = sdk.chat.completions.with_raw_response.create(
        model=SMALL_LLM, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert raw.headers["x-denv-replica"].startswith("llm.")
    chunks = list(raw.parse())
    assert chunks and any(c.choices and c.choices[0].delta.content for c in chunks)


@pytest.mark.parametrize(
    ("call", "pool"),
    [
        (lambda c: c.completions.create(model=SMALL_LLM, prompt="hi"), "llm"),
        (lambda c: c.embeddings.create(model="llm", input="hi"), "llm"),
    ],
    ids=["completions", "embeddings"],
)
def test_text_paths_reach_the_pool_their_model_names(
    sdk: openai.OpenAI, call: Callable[[openai.OpenAI], object], pool: str
) -> None:
    # The simulator does not speak these paths: its own 404 proves the request got there.
    with pytest.raises(openai.NotFoundError) as caught:
        call(sdk)
    response = caught.value.response
    assert response.headers["x-denv-replica"].startswith(f"{pool}.")
    assert "no route" in response.text  # the replica's answer, not the balancer's


def test_speech_streams_audio_from_the_pool_its_alias_names(sdk: openai.OpenAI) -> None:
    with sdk.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="hello", response_format="pcm"
    ) as response:
        assert response.headers["x-denv-replica"].startswith("voice.")
        audio = b"".join(response.iter_bytes())
    assert len(audio) == FAST_REPLICA.tokens * FRAME_BYTES
    assert audio[:FRAME_BYTES] == audio_frame(0)


@pytest.mark.parametrize("model", [WHISPER, "voice"])
def test_uploads_are_transcribed_by_the_pool_their_model_field_names(
    sdk: openai.OpenAI, model: str
) -> None:
    raw = sdk.audio.transcriptions.with_raw_response.create(model=model, file=("a.wav", WAV))
    assert raw.headers["x-denv-replica"].startswith("voice.")
    assert "a.wav" in raw.parse().text
    translated = sdk.audio.translations.with_raw_response.create(model=model, file=("b.wav", WAV))
    assert translated.headers["x-denv-replica"].startswith("voice.")
    assert "b.wav" in translated.parse().text


def test_models_list_has_the_pools_and_their_aliases(sdk: openai.OpenAI) -> None:
    ids = [model.id for model in sdk.models.list()]
    assert ids == sorted(["llm", "voice", WHISPER, "tts-1", SMALL_LLM])


def test_a_body_too_large_to_route_gets_413_naming_the_header(plane: Dataplane) -> None:
    messages = [{"role": "user", "content": "x" * 100_000}]
    late_model = json.dumps({"messages": messages, "model": "voice", "max_tokens": 1})
    upload = {"file": ("a.wav", b"\x01" * 100_000), "model": (None, WHISPER)}
    with plane.client() as client:
        json_413 = client.post("/v1/chat/completions", content=late_model)
        multipart_413 = client.post("/v1/audio/transcriptions", files=upload)
        named = client.post(
            "/v1/chat/completions", content=late_model, headers={"X-Denv-Pool": "voice"}
        )
    for answer in (json_413, multipart_413):
        assert answer.status_code == 413
        assert answer.json()["error"]["code"] == "body_too_large_to_route"
        assert "X-Denv-Pool" in answer.json()["error"]["message"]
    assert named.status_code == 200 and named.headers["x-denv-replica"].startswith("voice.")
    assert _requests(plane) == 1


def test_bodies_that_name_no_pool_are_refused_by_the_balancer(plane: Dataplane) -> None:
    with plane.client() as client:
        not_json = client.post("/v1/chat/completions", content=b"model=voice")
        no_model_first = client.post(
            "/v1/audio/transcriptions", files={"file": ("a.wav", WAV), "model": (None, "voice")}
        )
        unknown = client.post(
            "/v1/audio/transcriptions", files={"model": (None, "nope"), "file": ("a.wav", WAV)}
        )
        json_unknown = client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
    assert no_model_first.status_code == 400
    assert no_model_first.json()["error"]["code"] == "missing_model"
    for answer in (unknown, json_unknown):
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
    assert _requests(plane) == 0


def test_chunked_upload_too_large_to_route_gets_413(plane: Dataplane) -> None:
    def body() -> Iterator[bytes]:
        yield b'{"messages":[{"role":"user","content":"'
        for _ in range(10):
            yield b"x" * 10_000
        yield b'"}],"model":"voice"}'

    with httpx.Client(base_url=plane.url, timeout=5) as client:
        answer = client.post("/v1/chat/completions", content=body())
    assert answer.status_code == 413
    assert _requests(plane) == 0


def test_speech_whose_replica_dies_mid_stream_is_cut_and_not_replayed(
    plane: Dataplane, sdk: openai.OpenAI
) -> None:
    for replica in plane.replicas.values():
        replica.fault("die_after_tokens", 3)
    received = b""
    # The SDK's raw audio stream surfaces its HTTP stack's error as is (no [DONE] to miss here:
    # the cut chunked body is the signal).
    speech = sdk.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="hello", response_format="pcm"
    )
    with pytest.raises(Exception) as cut, speech as response:
        for chunk in response.iter_bytes():
            received += chunk
    assert type(cut.value).__name__ == "RemoteProtocolError"
    assert "incomplete chunked read" in str(cut.value)
    assert len(received) == 3 * FRAME_BYTES
    assert sum(r.stats()["streams_aborted"] for r in plane.replicas.values()) == 1
