"""The load client's voice protocols, pure parts: figures per protocol, the endpoint against the
direct path, the transcription upload, the transcript answer, and the client's WebSocket frames."""

import asyncio
import io
import socket
import struct
import wave

import pytest
from websockets.frames import Close, Frame, Opcode
from websockets.protocol import Protocol as WsProtocol
from websockets.protocol import Side

from denv_iac.local.voice_sim import WavToPcm
from denv_iac.ops.loadgen_protocols import transcript_of
from denv_iac.ops.loadgen_report import LoadReport, Protocol, StreamResult, Via
from denv_iac.ops.loadgen_requests import transcription_request
from denv_iac.wire.audio import SAMPLE_RATE, wav
from denv_iac.wire.multipart import parse_multipart
from denv_iac.wire.websocket import WebSocket, WebSocketClosed


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
        assert audio.getframerate() == SAMPLE_RATE
        assert audio.getnframes() == SAMPLE_RATE
    path, headers, body = transcription_request("stt")
    upload = parse_multipart(headers["Content-Type"], body)
    assert path == "/v1/audio/transcriptions"
    assert upload.fields == {"model": "stt"} and upload.filename == "bench.wav"
    assert upload.audio == wav(1.0)


Peer = tuple[WebSocket, WsProtocol, asyncio.StreamReader, asyncio.StreamWriter]


async def _pair(side: Side) -> Peer:
    """A WebSocket on one end of a socket pair, and on the other a bare sans-IO peer of the
    other side, whose bytes the test writes and reads itself."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    peer_reader, peer_writer = await asyncio.open_connection(sock=theirs)
    peer = WsProtocol(Side.CLIENT if side is Side.SERVER else Side.SERVER)
    return WebSocket(reader, writer, side), peer, peer_reader, peer_writer


async def _peer_frames(peer: WsProtocol, reader: asyncio.StreamReader) -> list[Frame]:
    """The frames the peer receives until the WebSocket's side has sent something."""
    frames: list[Frame] = []
    while not frames:
        data = await reader.read(65536)
        if data:
            peer.receive_data(data)
        else:
            peer.receive_eof()
        frames = [e for e in peer.events_received() if isinstance(e, Frame)]
    return frames


@pytest.mark.parametrize("size", [0, 5, 125, 126, 65535, 65536, 70_001])
def test_a_masked_client_frame_reads_back_whole(size: int) -> None:
    payload = bytes(range(256)) * (size // 256 + 1)
    payload = payload[:size]

    async def main() -> tuple[bytes, tuple[Opcode, bytes]]:
        ws, peer, _, writer = await _pair(Side.SERVER)
        peer.send_binary(payload)
        frame = b"".join(peer.data_to_send())
        writer.write(frame)
        await writer.drain()
        return frame, await ws.receive()

    frame, message = asyncio.run(asyncio.wait_for(main(), 5))
    assert frame[1] & 0x80  # the mask bit: a server must refuse an unmasked client frame
    assert payload not in frame or size < 4
    assert message == (Opcode.BINARY, payload)


@pytest.mark.parametrize("side", [Side.SERVER, Side.CLIENT])
def test_a_message_fragmented_around_a_ping_arrives_whole_and_the_ping_is_answered(
    side: Side,
) -> None:
    """RFC 6455 5.4: control frames may come between the fragments of a message."""

    async def main() -> tuple[tuple[Opcode, bytes], list[Frame]]:
        ws, peer, reader, writer = await _pair(side)
        peer.send_text(b'{"type":', fin=False)
        peer.send_ping(b"between")
        peer.send_continuation(b'"response', fin=False)
        peer.send_continuation(b'.create"}', fin=True)
        for chunk in peer.data_to_send():
            writer.write(chunk)
            await writer.drain()
        message = await ws.receive()
        return message, await _peer_frames(peer, reader)

    message, answers = asyncio.run(asyncio.wait_for(main(), 5))
    assert message == (Opcode.TEXT, b'{"type":"response.create"}')
    assert [(f.opcode, f.data) for f in answers] == [(Opcode.PONG, b"between")]


def test_an_unmasked_client_frame_is_refused_with_a_protocol_error_close() -> None:
    async def main() -> list[Frame]:
        ws, peer, reader, writer = await _pair(Side.SERVER)
        writer.write(bytes([0x81, 5]) + b"hello")  # a final text frame, no mask
        await writer.drain()
        with pytest.raises(WebSocketClosed):
            await ws.receive()
        return await _peer_frames(peer, reader)

    answers = asyncio.run(asyncio.wait_for(main(), 5))
    assert [f.opcode for f in answers] == [Opcode.CLOSE]
    assert Close.parse(answers[0].data).code == 1002


def test_a_close_from_the_peer_is_answered_and_ends_the_session() -> None:
    async def main() -> tuple[tuple[Opcode, bytes], list[Frame]]:
        ws, peer, reader, writer = await _pair(Side.CLIENT)
        peer.send_close(1000)
        writer.write(b"".join(peer.data_to_send()))
        await writer.drain()
        message = await ws.receive()
        answers = await _peer_frames(peer, reader)
        with pytest.raises(WebSocketClosed):
            await ws.receive()
        return message, answers

    message, answers = asyncio.run(asyncio.wait_for(main(), 5))
    assert message[0] is Opcode.CLOSE and Close.parse(message[1]).code == 1000
    assert [f.opcode for f in answers] == [Opcode.CLOSE]


def _wav_stream(rate: int, samples: list[int]) -> bytes:
    """A streamed WAV as espeak-ng writes one: sizes unknown, PCM16 mono at `rate`."""
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
    head = b"RIFF" + b"\xff" * 4 + b"WAVEfmt " + fmt + b"data" + b"\xff" * 4
    return head + struct.pack(f"<{len(samples)}h", *samples)


@pytest.mark.parametrize("piece", [1, 3, 44, 1001, 1 << 20])
def test_wav_to_pcm_resamples_to_24_khz_whatever_the_pieces(piece: int) -> None:
    """One second at 22.05 kHz is one second at 24 kHz; a ramp stays a ramp (linear
    interpolation); the header and odd bytes may be split anywhere."""
    ramp = list(range(22_050))
    stream = _wav_stream(22_050, ramp)
    convert = WavToPcm()
    pcm = b"".join(convert.feed(stream[at : at + piece]) for at in range(0, len(stream), piece))
    out = struct.unpack(f"<{len(pcm) // 2}h", pcm)
    assert abs(len(out) - 24_000) <= 1
    step = 22_050 / 24_000
    assert all(abs(value - k * step) <= 1 for k, value in enumerate(out))


def test_wav_to_pcm_refuses_what_is_not_pcm16_mono() -> None:
    stereo = bytearray(_wav_stream(22_050, [0] * 10))
    stereo[22:24] = struct.pack("<H", 2)
    with pytest.raises(ValueError, match="PCM16 mono"):
        WavToPcm().feed(bytes(stereo))
