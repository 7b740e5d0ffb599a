"""The voice protocols of the simulated replica: streamed speech, transcription of an upload,
and realtime sessions over WebSocket.

WebSocket framing (RFC 6455: masking, fragmented messages with control frames between their
fragments, pings, the closing handshake) is the `websockets` library's sans-IO protocol, started
open after the HTTP upgrade; `WebSocket` moves its bytes over an asyncio connection, for the
replica's `/v1/realtime` and the load generator's realtime client alike.

Audio is PCM16 mono at 24 kHz, sent in 20 ms frames (480 samples, 960 bytes), as OpenAI's
realtime API and `response_format=pcm` speech send it. Timing follows the replica's config: the
first audio frame `ttft_ms` after the request (or after `response.create`), then one frame
every `itl_ms`, `tokens` frames per answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
from collections import deque
from dataclasses import dataclass
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from websockets.frames import Frame, Opcode
from websockets.protocol import SEND_EOF, Protocol, Side, State
from websockets.utils import accept_key

SAMPLE_RATE = 24_000
FRAME_MS = 20
FRAME_SAMPLES = SAMPLE_RATE * FRAME_MS // 1000
FRAME_BYTES = FRAME_SAMPLES * 2  # PCM16 mono
_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_READ_BYTES = 64 * 1024
# Subprotocols a realtime client may offer (OpenAI's browser form sends its key and beta flag
# as subprotocols too); the answer names `realtime` when offered.
REALTIME_SUBPROTOCOL = "realtime"


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
    """The form fields and the `file` part, read by the standard library's MIME parser;
    ValueError when the body is not such a form."""
    if (
        not content_type.lower().startswith("multipart/form-data")
        or "boundary=" not in content_type
    ):
        raise ValueError("send multipart/form-data with a boundary")
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1", "replace")
    form = BytesParser(policy=HTTP).parsebytes(head + body)
    if not isinstance(form, EmailMessage) or not form.is_multipart():
        raise ValueError("send multipart/form-data with a boundary")
    fields: dict[str, str] = {}
    upload: tuple[str, bytes] | None = None
    for part in form.iter_parts():
        name = part.get_param("name", header="content-disposition")
        content = part.get_payload(decode=True)
        if not isinstance(name, str) or not isinstance(content, bytes):
            continue
        if name == "file":
            upload = (part.get_filename() or "", content)
        else:
            fields[name] = content.decode("utf-8", "replace")
    if upload is None:
        raise ValueError("the form has no file part")
    return Upload(fields, *upload)


def transcript_text(upload: Upload) -> str:
    seconds = len(upload.audio) / (SAMPLE_RATE * 2)
    return f"simulated transcript of {upload.filename or 'audio'} ({seconds:.2f} s of audio)"


def websocket_accept(key: str) -> str:
    """The `Sec-WebSocket-Accept` answer to a client's `Sec-WebSocket-Key` (RFC 6455 4.2.2)."""
    return accept_key(key)


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


class WebSocketClosed(ConnectionError):
    """The session is over: the socket ended without a closing handshake, the peer broke the
    protocol, or its close frame was already received."""


class WebSocket:
    """One side of an open WebSocket connection (after the HTTP upgrade) over asyncio streams.

    The `websockets` sans-IO protocol does the framing: it unmasks and masks, answers pings and
    the peer's close frame, and refuses what RFC 6455 forbids; this class feeds it the bytes read,
    writes the bytes it has to send, and joins the fragments of a message. No task or thread of
    its own: a read happens only inside `receive()`, so a caller's timeout bounds it.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        side: Side,
        received: bytes = b"",
    ) -> None:
        """`received`: bytes of the connection already read past the HTTP upgrade's answer (the
        peer may send its first frames with it); they are parsed before anything else is read."""
        self.reader, self.writer = reader, writer
        self._received = received
        self.protocol = Protocol(side, state=State.OPEN, max_size=_MAX_MESSAGE_BYTES)
        self._frames: deque[Frame] = deque()
        self._opcode: Opcode | None = None
        self._parts: list[bytes] = []

    async def receive(self) -> tuple[Opcode, bytes]:
        """The next whole message: TEXT or BINARY with its fragments joined (control frames
        between them are answered on the way), or CLOSE with the peer's close payload, already
        answered. WebSocketClosed when the socket ends without a close frame or the peer breaks
        the protocol (a close frame naming the error has been sent then)."""
        while True:
            while self._frames:
                frame = self._frames.popleft()
                if frame.opcode is Opcode.CLOSE:
                    return Opcode.CLOSE, bytes(frame.data)
                if frame.opcode is Opcode.TEXT or frame.opcode is Opcode.BINARY:
                    self._opcode, self._parts = frame.opcode, [bytes(frame.data)]
                elif frame.opcode is Opcode.CONT:
                    self._parts.append(bytes(frame.data))
                else:
                    continue  # a ping (the protocol answered it) or a pong
                if frame.fin and self._opcode is not None:
                    opcode, parts = self._opcode, self._parts
                    self._opcode, self._parts = None, []
                    return opcode, b"".join(parts)
            if self.protocol.parser_exc is not None or self.protocol.close_rcvd is not None:
                raise WebSocketClosed(str(self.protocol.parser_exc or "closed"))
            if self._received:
                data, self._received = self._received, b""
            else:
                data = await self.reader.read(_READ_BYTES)
            if data:
                self.protocol.receive_data(data)
            else:
                self.protocol.receive_eof()
            self._frames.extend(e for e in self.protocol.events_received() if isinstance(e, Frame))
            await self._flush()

    async def send_text(self, data: bytes) -> None:
        """One text message (`data` is UTF-8), in one frame."""
        self.protocol.send_text(data)
        await self._flush()

    async def close(self, code: int = 1000) -> None:
        """Start the closing handshake (a close frame with `code`), when still open."""
        if self.protocol.state is State.OPEN:
            self.protocol.send_close(code)
            await self._flush()

    async def _flush(self) -> None:
        data = [chunk for chunk in self.protocol.data_to_send() if chunk != SEND_EOF]
        if data:
            self.writer.write(b"".join(data))
            await self.writer.drain()


def realtime_event(kind: str, seq: int, **fields: Any) -> bytes:
    """A realtime event as the UTF-8 JSON text of one message."""
    event = {"type": kind, "event_id": f"event_{seq}", **fields}
    return json.dumps(event, separators=(",", ":")).encode()


class WavToPcm:
    """A streamed WAV (PCM16 mono, any rate) in, OpenAI's `pcm` out: the header dropped and the
    samples resampled to 24 kHz by linear interpolation, piece by piece as they arrive (espeak-ng
    speaks at 22.05 kHz; a client asking for `pcm` plays what it gets at 24 kHz)."""

    def __init__(self, rate_out: int = SAMPLE_RATE) -> None:
        self._rate_out = rate_out
        self._head = b""  # the header, until its data chunk starts
        self._step: float | None = None  # input samples per output sample, once the header is read
        self._odd = b""  # half a sample carried to the next piece
        self._tail: list[int] = []  # input samples not yet passed
        self._pos = 0.0  # the next output sample's place in _tail

    def feed(self, piece: bytes) -> bytes:
        """The PCM this piece of the WAV stream makes; ValueError when it is not PCM16 mono."""
        if self._step is None:
            self._head += piece
            start = self._head.find(b"data")
            if len(self._head) < 44 or start < 0 or len(self._head) < start + 8:
                return b""
            channels, rate = struct.unpack_from("<HI", self._head, 22)
            bits = struct.unpack_from("<H", self._head, 34)[0]
            if self._head[:4] != b"RIFF" or channels != 1 or bits != 16:
                raise ValueError("expected a PCM16 mono WAV stream")
            self._step = rate / self._rate_out
            piece, self._head = self._head[start + 8 :], b""
        data = self._odd + piece
        whole = len(data) // 2 * 2
        self._odd = data[whole:]
        samples = self._tail + list(struct.unpack(f"<{whole // 2}h", data[:whole]))
        step, first = self._step, self._pos
        count = max(0, math.ceil((len(samples) - 1 - first) / step))
        places = [first + k * step for k in range(count)]
        out = [
            round(samples[i] + (samples[i + 1] - samples[i]) * (place - i))
            for place, i in zip(places, map(int, places), strict=True)
        ]
        pos = first + count * step
        passed = min(int(pos), len(samples))
        self._tail, self._pos = samples[passed:], pos - passed
        return struct.pack(f"<{len(out)}h", *out)
