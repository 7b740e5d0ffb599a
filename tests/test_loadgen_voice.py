"""The load client's voice protocols, pure parts: figures per protocol, the endpoint against the
direct path, the transcription upload, the transcript answer, and the client's WebSocket frames."""

import asyncio
import io
import wave

import pytest

from denv_iac.local import voice_sim
from denv_iac.ops.loadgen import (
    LoadReport,
    Protocol,
    StreamResult,
    Via,
    transcript_of,
    transcription_request,
    wav,
)


def result(first_ms: float | None, via: Via = "endpoint", error: str = "") -> StreamResult:
    return StreamResult("r", 0.0, 200, error, "", first_ms, 100.0, 3, (), via)


@pytest.mark.parametrize(
    ("protocol", "key", "rate"),
    [
        ("chat", "ttft", "tokens_per_s"),
        ("speech", "first_audio", "audio_bytes_per_s"),
        ("transcription", "transcript", "transcripts_per_s"),
        ("realtime", "first_audio", "audio_deltas_per_s"),
    ],
)
def test_each_protocol_names_its_figure(protocol: Protocol, key: str, rate: str) -> None:
    report = LoadReport([result(10.0), result(20.0), result(None, error="aborted")], 1.0, protocol)
    summary = report.summary()
    assert summary[f"{key}_p50_ms"] == 10.0 and summary[f"{key}_p99_ms"] == 20.0
    assert summary[rate] == 6.0 and summary["errors"] == {"aborted": 1}
    assert "direct" not in summary and "ratio_p50" not in summary


def test_the_endpoint_is_compared_with_the_direct_path_of_the_same_run() -> None:
    through = [result(v) for v in (40.5, 41.0, 41.5, 42.0, 60.0)]
    direct = [result(v, "direct") for v in (40.0, 40.2, 40.4, 40.6, 50.0)]
    failed = [result(None, "direct", "connect")]
    report = LoadReport([*through, *direct, *failed], 1.0, "speech")
    summary = report.summary()
    # Percentiles of each path on its own; the endpoint's count only its own requests.
    assert summary["requests"] == 5 and summary["first_audio_p50_ms"] == 41.5
    assert summary["direct"] == {
        "requests": 6,
        "ok": 5,
        "errors": {"connect": 1},
        "first_audio_p50_ms": 40.4,
        "first_audio_p90_ms": 50.0,
        "first_audio_p99_ms": 50.0,
    }
    assert summary["added_p50_ms"] == 1.1 and summary["added_p99_ms"] == 10.0
    assert summary["ratio_p50"] == round(41.5 / 40.4, 3)


def test_no_ratio_without_a_completed_direct_answer() -> None:
    report = LoadReport([result(41.0), result(None, "direct", "connect")], 1.0, "realtime")
    assert report.added_ms(50) is None and report.ratio(50) is None


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (b'{"text": "hello there"}', "hello there"),
        (b"hello there\n", "hello there"),  # response_format=text
        (b'{"text": 3}', ""),
        (b'{"error": "no"}', ""),
        (b"[1, 2]", ""),
        (b"", ""),
    ],
)
def test_transcript_of_an_answer(body: bytes, text: str) -> None:
    assert transcript_of(body) == text


def test_the_upload_is_a_playable_wav_in_a_form_the_simulator_reads() -> None:
    with wave.open(io.BytesIO(wav(1.0))) as audio:
        assert (audio.getnchannels(), audio.getsampwidth()) == (1, 2)
        assert audio.getframerate() == voice_sim.SAMPLE_RATE
        assert audio.getnframes() == voice_sim.SAMPLE_RATE
    path, headers, body = transcription_request("stt")
    upload = voice_sim.parse_multipart(headers["Content-Type"], body)
    assert path == "/v1/audio/transcriptions"
    assert upload.fields == {"model": "stt"} and upload.filename == "bench.wav"
    assert upload.audio == wav(1.0)


@pytest.mark.parametrize("size", [0, 5, 125, 126, 65535, 65536, 70_001])
def test_a_masked_client_frame_reads_back_whole(size: int) -> None:
    payload = bytes(range(256)) * (size // 256 + 1)
    payload = payload[:size]
    frame = voice_sim.encode_frame(voice_sim.OpCode.TEXT, payload, b"\x01\x80\xfe\x7f")
    assert frame[1] & 0x80  # the mask bit: a server must refuse an unmasked client frame
    assert payload not in frame or size < 4

    async def read() -> tuple[int, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(frame)
        reader.feed_eof()
        return await voice_sim.read_frame(reader)

    assert asyncio.run(read()) == (voice_sim.OpCode.TEXT, payload)


def test_masking_twice_gives_the_payload_back() -> None:
    mask = b"\xa5\x5a\x00\xff"
    masked = voice_sim.apply_mask(b"hello realtime", mask)
    assert masked != b"hello realtime"
    assert voice_sim.apply_mask(masked, mask) == b"hello realtime"
    assert masked[0] == ord("h") ^ 0xA5 and masked[4] == ord("o") ^ 0xA5
