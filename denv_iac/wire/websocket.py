"""The realtime WebSocket: both sides of the HTTP upgrade, and the framing after it.

WebSocket framing (RFC 6455: masking, fragmented messages with control frames between their
fragments, pings, the closing handshake) is the `websockets` library's sans-IO protocol, started
open after the HTTP upgrade; `WebSocket` moves its bytes over an asyncio connection, for the
replica's `/v1/realtime` and the load generator's realtime client alike. The handshake's accept
key is the library's too.
"""

import asyncio
from collections import deque
from collections.abc import Mapping

from websockets.frames import Frame, Opcode
from websockets.protocol import SEND_EOF, Protocol, Side, State
from websockets.utils import accept_key

_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_READ_BYTES = 64 * 1024
# Subprotocols a realtime client may offer (OpenAI's browser form sends its key and beta flag
# as subprotocols too); the answer names `realtime` when offered.
REALTIME_SUBPROTOCOL = "realtime"


def upgrade_headers(key: str) -> dict[str, str]:
    """A client's upgrade to a realtime WebSocket: the headers that ask for it with `key` (a
    fresh `websockets.utils.generate_key()`), offering the realtime subprotocol."""
    return {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": key,
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Protocol": REALTIME_SUBPROTOCOL,
    }


def upgrade_accepted(key: str, headers: Mapping[str, str]) -> bool:
    """Whether a 101 answer's headers (names lower-cased) accept the upgrade that sent `key`
    (RFC 6455 4.2.2)."""
    return headers.get("sec-websocket-accept") == accept_key(key)


def handshake_headers(
    headers: Mapping[str, str], extra: Mapping[str, str]
) -> list[tuple[str, str]] | None:
    """The headers of the 101 answer to a WebSocket upgrade (request headers' names
    lower-cased), with `extra` headers, or None when the request is not one."""
    key = headers.get("sec-websocket-key")
    upgrade = headers.get("upgrade", "").lower()
    if not key or upgrade != "websocket":
        return None
    answer = [
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Accept", accept_key(key)),
        *extra.items(),
    ]
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
    if REALTIME_SUBPROTOCOL in offered:
        answer.append(("Sec-WebSocket-Protocol", REALTIME_SUBPROTOCOL))
    return answer


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
