"""The voice protocols of the simulated replica: streamed speech, transcription of an upload,
and realtime sessions over WebSocket (RFC 6455, the few frames a realtime turn needs).

Audio is PCM16 mono at 24 kHz, sent in 20 ms frames (480 samples, 960 bytes), as OpenAI's
realtime API and `response_format=pcm` speech send it. Timing follows the replica's config: the
first audio frame `ttft_ms` after the request (or after `response.create`), then one frame
every `itl_ms`, `tokens` frames per answer. Standard library only.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

SAMPLE_RATE = 24_000
FRAME_MS = 20
FRAME_SAMPLES = SAMPLE_RATE * FRAME_MS // 1000
FRAME_BYTES = FRAME_SAMPLES * 2  # PCM16 mono
_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_MAX_FRAME_BYTES = 16 * 1024 * 1024
# Subprotocols a realtime client may offer (OpenAI's browser form sends its key and beta flag
# as subprotocols too); the answer names `realtime` when offered.
REALTIME_SUBPROTOCOL = "realtime"


class OpCode:
    TEXT = 0x1
    BINARY = 0x2
    CLOSE = 0x8
    PING = 0x9
    PONG = 0xA


def audio_frame(index: int) -> bytes:
    """20 ms of a 440 Hz tone, continuous across frames: real PCM any player can play."""
    start = index * FRAME_SAMPLES
    samples = (
        int(8000 * math.sin(2 * math.pi * 440 * (start + n) / SAMPLE_RATE))
        for n in range(FRAME_SAMPLES)
    )
    return struct.pack(f"<{FRAME_SAMPLES}h", *samples)


def wav_header() -> bytes:
    """A WAV header for a stream of unknown length (sizes 0xFFFFFFFF, as streaming TTS sends)."""
    byte_rate = SAMPLE_RATE * 2
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, SAMPLE_RATE, byte_rate, 2, 16)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


@dataclass(frozen=True)
class Upload:
    """One file part of a multipart form, and the form's plain fields."""

    fields: dict[str, str]
    filename: str
    audio: bytes


def parse_multipart(content_type: str, body: bytes) -> Upload:
    """The form fields and the `file` part; ValueError when the body is not such a form."""
    boundary = ""
    for param in content_type.split(";")[1:]:
        name, _, value = param.strip().partition("=")
        if name.lower() == "boundary":
            boundary = value.strip('"')
    if not content_type.lower().startswith("multipart/form-data") or not boundary:
        raise ValueError("send multipart/form-data with a boundary")
    fields: dict[str, str] = {}
    filename, audio = "", b""
    found_file = False
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, sep, content = part.partition(b"\r\n\r\n")
        if not sep:
            raise ValueError("a form part has no header end")
        content = content.removesuffix(b"\r\n")
        disposition = ""
        for line in head.decode("latin-1").split("\r\n"):
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-disposition":
                disposition = value
        params = {}
        for item in disposition.split(";")[1:]:
            key, _, value = item.strip().partition("=")
            params[key.lower()] = value.strip('"')
        if params.get("name") == "file":
            filename, audio, found_file = params.get("filename", ""), content, True
        elif "name" in params:
            fields[params["name"]] = content.decode("utf-8", "replace")
    if not found_file:
        raise ValueError("the form has no file part")
    return Upload(fields, filename, audio)


def transcript_text(upload: Upload) -> str:
    seconds = len(upload.audio) / (SAMPLE_RATE * 2)
    return f"simulated transcript of {upload.filename or 'audio'} ({seconds:.2f} s of audio)"


def websocket_accept(key: str) -> str:
    return base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()


def handshake_response(headers: dict[str, str], extra: dict[str, str]) -> bytes | None:
    """The 101 answer to a WebSocket upgrade, or None when the request is not one."""
    key = headers.get("sec-websocket-key")
    upgrade = headers.get("upgrade", "").lower()
    if not key or upgrade != "websocket":
        return None
    lines = [
        "HTTP/1.1 101 Switching Protocols",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Accept: {websocket_accept(key)}",
        *(f"{name}: {value}" for name, value in extra.items()),
    ]
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
    if REALTIME_SUBPROTOCOL in offered:
        lines.append(f"Sec-WebSocket-Protocol: {REALTIME_SUBPROTOCOL}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def apply_mask(payload: bytes, mask: bytes) -> bytes:
    """`payload` XOR the repeated 4-byte `mask` (masking and unmasking are the same)."""
    if not mask or not payload:
        return payload
    key = (mask * (len(payload) // 4 + 1))[: len(payload)]
    masked = int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")
    return masked.to_bytes(len(payload), "big")


def encode_frame(opcode: int, payload: bytes, mask: bytes = b"") -> bytes:
    """A final frame: unmasked as a server sends it, or masked by the 4-byte `mask` as a client
    must send it (RFC 6455 5.3)."""
    length = len(payload)
    masked = 0x80 if mask else 0
    if length < 126:
        head = struct.pack("!BB", 0x80 | opcode, masked | length)
    elif length < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, masked | 126, length)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, masked | 127, length)
    return head + mask + apply_mask(payload, mask)


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One whole message (fragments joined); IncompleteReadError when the peer is gone."""
    opcode, message = 0, b""
    while True:
        first, second = await reader.readexactly(2)
        length = second & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", await reader.readexactly(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", await reader.readexactly(8))
        if length > _MAX_FRAME_BYTES:
            raise ValueError("frame too large")
        mask = await reader.readexactly(4) if second & 0x80 else b""
        payload = await reader.readexactly(length)
        payload = apply_mask(payload, mask)
        frame_opcode = first & 0x0F
        if frame_opcode >= 0x8:  # control frames come whole, between fragments too
            return frame_opcode, payload
        if frame_opcode:
            opcode = frame_opcode
        message += payload
        if first & 0x80:
            return opcode, message


def realtime_event(kind: str, seq: int, **fields: Any) -> bytes:
    event = {"type": kind, "event_id": f"event_{seq}", **fields}
    return encode_frame(OpCode.TEXT, json.dumps(event, separators=(",", ":")).encode())
