"""The load generator's connections: an endpoint's URL taken apart, and one worker's keep-alive
HTTP/1.1 connection (h11), which a realtime session turns into a WebSocket.
"""

import asyncio
import ssl
import urllib.parse
from collections.abc import AsyncIterator

import h11
from websockets.frames import Opcode
from websockets.protocol import Side

from denv_iac.wire.websocket import WebSocket

CONNECT_TIMEOUT_S = 5.0


class Endpoint:
    """Where the load goes: an http(s) URL, its host, port and path prefix."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url} is not an http(s) URL")
        self.url = url
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        default = (self.port == 443) if self.tls else (self.port == 80)
        name = f"[{self.host}]" if ":" in self.host else self.host
        self.authority = name if default else f"{name}:{self.port}"


class PeerClosed(Exception):
    """The peer closed or reset the connection, or broke HTTP/1.1."""


_READ_BYTES = 64 * 1024


class Connection:
    """One worker's keep-alive HTTP/1.1 connection.

    A load generator's own overhead lands in every figure it reports. A general-purpose client
    pool costs a busy event loop a lot per request (at 64 streams on two cores it added hundreds
    of milliseconds to the measured first token, and made fast 503s take seconds), so each
    worker keeps one plain connection and reads the response as it arrives. h11 (sans-IO) does
    the HTTP/1.1: framing, chunked bodies, keep-alive and the switch to a WebSocket.
    """

    def __init__(self, endpoint: Endpoint, timeout_s: float, connect_timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._http: h11.Connection | None = None
        self._ws: WebSocket | None = None
        self._ssl = ssl.create_default_context() if endpoint.tls else None

    @property
    def is_open(self) -> bool:
        return self._writer is not None

    async def open(self) -> None:
        async with asyncio.timeout(self.connect_timeout_s):
            self._reader, self._writer = await asyncio.open_connection(
                self.endpoint.host, self.endpoint.port, ssl=self._ssl
            )
        self._http = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        self._http = None
        self._ws = None

    async def send(
        self, path: str, headers: dict[str, str], body: bytes | None, method: str = "POST"
    ) -> None:
        """A request; a None body sends none and no Content-Length (a WebSocket upgrade)."""
        assert self._writer is not None and self._http is not None
        http = self._http
        if http.our_state is h11.DONE and http.their_state is h11.DONE:
            http.start_next_cycle()
        if http.our_state is not h11.IDLE or http.their_state is not h11.IDLE:
            raise PeerClosed  # the last response was not read to its end: the connection is spent
        fields = [("Host", self.endpoint.authority), *headers.items()]
        if body is not None:
            fields.append(("Content-Length", str(len(body))))
        target = f"{self.endpoint.prefix}{path}"
        events: list[h11.Event] = [h11.Request(method=method, target=target, headers=fields)]
        events += [h11.Data(data=body)] if body else []
        self._writer.write(b"".join(http.send(e) or b"" for e in [*events, h11.EndOfMessage()]))
        await self._writer.drain()

    def upgrade(self) -> None:
        """The connection carries a WebSocket from here on (after a 101 answer), as its client;
        what the peer sent past the answer is its first WebSocket bytes."""
        assert self._reader is not None and self._writer is not None and self._http is not None
        received, _ = self._http.trailing_data
        self._ws = WebSocket(self._reader, self._writer, Side.CLIENT, received)

    async def send_text(self, payload: bytes) -> None:
        """One WebSocket text message (masked, as a client's frames must be)."""
        assert self._ws is not None
        await self._ws.send_text(payload)

    async def message(self) -> tuple[Opcode, bytes]:
        """The next WebSocket message, whole: TEXT or BINARY, or CLOSE when the peer closed.
        Pings are answered on the way."""
        assert self._ws is not None
        ws = self._ws
        try:
            async with asyncio.timeout(self.timeout_s):
                return await ws.receive()
        except (ConnectionError, ssl.SSLError) as error:
            raise PeerClosed from error

    async def close_websocket(self) -> None:
        """A clean close: the close frame (1000), when the session is still open."""
        if self._ws is not None:
            await self._ws.close(1000)

    async def _event(self) -> h11.Event:
        """The response's next event, reading as needed (each read within the timeout). A reset
        reads as the end of the connection: it ends a body framed by the close, and breaks any
        other (`PeerClosed`)."""
        assert self._reader is not None and self._http is not None
        reader, http = self._reader, self._http
        while True:
            try:
                event = http.next_event()
            except h11.RemoteProtocolError as error:
                raise PeerClosed from error
            if event is h11.NEED_DATA:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        data = await reader.read(_READ_BYTES)
                except (ConnectionError, ssl.SSLError):
                    data = b""
                http.receive_data(data)
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                raise PeerClosed
            else:
                assert isinstance(event, h11.Event)
                return event

    async def head(self) -> tuple[int, dict[str, str]]:
        """The status and headers (names lower-cased) of the response; a 101 answer counts as
        one, other informational answers (100, 103) are skipped."""
        while True:
            event = await self._event()
            if isinstance(event, h11.Response) or (
                isinstance(event, h11.InformationalResponse) and event.status_code == 101
            ):
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
                return event.status_code, headers

    async def body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body as it arrives: each chunk whole when chunked, the whole body when its length
        is given, each read when it ends at EOF. At its end the connection is closed unless it
        can carry the next request."""
        assert self._http is not None
        http = self._http
        framed = "transfer-encoding" in headers or "content-length" in headers
        parts: list[bytes] = []
        while not isinstance(event := await self._event(), h11.EndOfMessage):
            if isinstance(event, h11.Data):
                parts.append(bytes(event.data))
                if event.chunk_end or not framed:
                    yield b"".join(parts)
                    parts = []
        if parts:
            yield b"".join(parts)
        if http.our_state is not h11.DONE or http.their_state is not h11.DONE:
            self.close()
