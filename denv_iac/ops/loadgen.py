"""OpenAI-compatible load through an endpoint, measured per request, for each protocol voice uses.

- chat: streamed `POST /v1/chat/completions`; the figure is the time to the first token.
- speech: streamed `POST /v1/audio/speech` (PCM); the time to the first audio byte.
- transcription: a multipart `POST /v1/audio/transcriptions` of a short PCM16 WAV; the time to
  the whole transcript.
- realtime: one `GET /v1/realtime` WebSocket session per worker, a turn per request
  (`response.create`); the time from the turn's request to its first audio delta.

Each request (each realtime session) carries its own `X-Request-Id`, so a run can be checked
against the replicas' own logs: a stream that was replayed elsewhere would show up there twice.
With direct URLs, every worker alternates one request through the endpoint and one straight to
a replica, so drift and noise hit both paths alike and the balancer's share is their difference.
"""

import asyncio
import base64
import contextlib
import io
import json
import math
import os
import random
import ssl
import statistics
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import h11
from websockets.frames import Opcode
from websockets.protocol import Side

from denv_iac.local import voice_sim

Protocol = Literal["chat", "speech", "transcription", "realtime"]
PROTOCOLS: tuple[Protocol, ...] = ("chat", "speech", "transcription", "realtime")


@dataclass(frozen=True)
class Figure:
    """How a protocol's figures are named: in a summary (`{key}_p50_ms`), for people (and in a
    plot, `short`), the unit counted per answer (`{units}_per_s`) and the gap between two of
    them (`{gap}_mean_ms`)."""

    key: str
    label: str
    short: str
    units: str
    gap: str


FIGURES: dict[Protocol, Figure] = {
    "chat": Figure("ttft", "time to first token", "TTFT", "tokens", "itl"),
    "speech": Figure(
        "first_audio", "time to first audio byte", "first audio", "audio_bytes", "chunk_gap"
    ),
    "transcription": Figure("transcript", "time to transcript", "transcript", "transcripts", "gap"),
    "realtime": Figure(
        "first_audio", "time to first audio byte", "first audio", "audio_deltas", "delta_gap"
    ),
}
Via = Literal["endpoint", "direct"]
REPLICA_HEADER = "x-denv-replica"
RETRYABLE = ("connect", "no_response")  # nothing was answered: safe to send elsewhere
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class StreamResult:
    request_id: str
    started_s: float  # since the run started
    status: int  # 0 when no HTTP response arrived
    # "" for a completed answer; else aborted (cut off), closed (a realtime session closed by
    # its peer mid-turn), connect, no_response, timeout, http_<status>, bad_answer, no_audio
    # (a realtime turn that ended without an audio delta)
    error: str
    replica: str
    # The protocol's figure (FIGURES): first token, first audio byte, or the whole transcript.
    ttft_ms: float | None
    total_ms: float
    tokens: int  # tokens, audio bytes (speech), audio deltas (realtime), 1 per transcript
    gaps_ms: tuple[float, ...] = ()
    via: Via = "endpoint"

    @property
    def ok(self) -> bool:
        return not self.error


QUANTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class LoadReport:
    results: list[StreamResult] = field(default_factory=list)
    wall_s: float = 0.0
    protocol: Protocol = "chat"
    pool: str = ""

    def errors(self, via: Via = "endpoint") -> Counter[str]:
        return Counter(r.error for r in self.results if r.error and r.via == via)

    def has_direct(self) -> bool:
        return any(r.via == "direct" for r in self.results)

    def ttft_ms(self, q: float, via: Via = "endpoint") -> float | None:
        """Percentile `q` of the protocol's figure over the completed answers, to 0.01 ms."""
        firsts = [
            r.ttft_ms for r in self.results if r.ok and r.ttft_ms is not None and r.via == via
        ]
        value = percentile(firsts, q)
        return None if value is None else round(value, 2)

    def added_ms(self, q: float) -> float | None:
        """What the endpoint adds to percentile `q` over the direct path of the same run."""
        through, direct = self.ttft_ms(q), self.ttft_ms(q, "direct")
        return None if through is None or direct is None else round(through - direct, 2)

    def ratio(self, q: float) -> float | None:
        through, direct = self.ttft_ms(q), self.ttft_ms(q, "direct")
        return None if through is None or not direct else round(through / direct, 3)

    def summary(self) -> dict[str, object]:
        """The endpoint's figures; with a direct path, the direct ones and the difference too."""
        mine = [r for r in self.results if r.via == "endpoint"]
        gaps = [g for r in mine if r.ok for g in r.gaps_ms]
        tokens = sum(r.tokens for r in mine if r.ok)
        figure = FIGURES[self.protocol]
        figures: dict[str, object] = {
            "protocol": self.protocol,
            "requests": len(mine),
            "ok": sum(1 for r in mine if r.ok),
            "errors": dict(sorted(self.errors().items())),
            **{f"{figure.key}_p{q}_ms": self.ttft_ms(q) for q in QUANTILES},
            f"{figure.gap}_mean_ms": round(statistics.fmean(gaps), 2) if gaps else None,
            f"{figure.units}_per_s": round(tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "replicas": dict(
                sorted(Counter(r.replica for r in mine if r.ok and r.replica).items())
            ),
        }
        if self.has_direct():
            direct = [r for r in self.results if r.via == "direct"]
            figures["direct"] = {
                "requests": len(direct),
                "ok": sum(1 for r in direct if r.ok),
                "errors": dict(sorted(self.errors("direct").items())),
                **{f"{figure.key}_p{q}_ms": self.ttft_ms(q, "direct") for q in QUANTILES},
            }
            figures |= {f"added_p{q}_ms": self.added_ms(q) for q in QUANTILES}
            figures["ratio_p50"] = self.ratio(50)
        return figures


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


class _Closed(Exception):
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
        self._ws: voice_sim.WebSocket | None = None
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
            raise _Closed  # the last response was not read to its end: the connection is spent
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
        self._ws = voice_sim.WebSocket(self._reader, self._writer, Side.CLIENT, received)

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
            raise _Closed from error

    async def close_websocket(self) -> None:
        """A clean close: the close frame (1000), when the session is still open."""
        if self._ws is not None:
            await self._ws.close(1000)

    async def _event(self) -> h11.Event:
        """The response's next event, reading as needed (each read within the timeout). A reset
        reads as the end of the connection: it ends a body framed by the close, and breaks any
        other (`_Closed`)."""
        assert self._reader is not None and self._http is not None
        reader, http = self._reader, self._http
        while True:
            try:
                event = http.next_event()
            except h11.RemoteProtocolError as error:
                raise _Closed from error
            if event is h11.NEED_DATA:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        data = await reader.read(_READ_BYTES)
                except (ConnectionError, ssl.SSLError):
                    data = b""
                http.receive_data(data)
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                raise _Closed
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


async def _body_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")


@dataclass
class _Timing:
    """What a response's reader saw: the first unit, each later one's gap, the end."""

    start: float
    first: float | None = None
    last: float | None = None
    ended: float | None = None
    units: int = 0
    gaps: list[float] = field(default_factory=list)

    def unit(self, count: int = 1) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append((now - self.last) * 1000)
        self.last = now
        self.units += count

    def result(
        self, request_id: str, t0: float, status: int, error: str, replica: str, via: Via
    ) -> StreamResult:
        first = (self.first - self.start) * 1000 if self.first is not None else None
        total = ((self.ended or time.perf_counter()) - self.start) * 1000
        return StreamResult(
            request_id,
            self.start - t0,
            status,
            error,
            replica,
            first,
            total,
            self.units,
            tuple(self.gaps),
            via,
        )


BodyReader = Callable[[AsyncIterator[bytes], _Timing], Awaitable[str]]


async def _read_chat(body: AsyncIterator[bytes], timing: _Timing) -> str:
    outcome = "aborted"  # a stream that ends without [DONE] is an abort, never a success
    async for line in _body_lines(body):
        if timing.ended is not None or not line.startswith("data:"):
            continue  # after [DONE]: read to the end, so the connection can be kept
        payload = line[5:].strip()
        if payload == "[DONE]":
            timing.ended, outcome = time.perf_counter(), ""
        elif _has_content(payload):
            timing.unit()
    return outcome


async def _read_speech(body: AsyncIterator[bytes], timing: _Timing) -> str:
    async for chunk in body:
        if chunk:
            timing.unit(len(chunk))
    timing.ended = time.perf_counter()
    return "" if timing.units else "bad_answer"


async def _read_transcript(body: AsyncIterator[bytes], timing: _Timing) -> str:
    text = b"".join([chunk async for chunk in body])
    timing.ended = time.perf_counter()
    if not transcript_of(text):
        return "bad_answer"
    timing.first = timing.ended  # the figure is the whole transcript: it is useful only whole
    timing.units = 1
    return ""


def transcript_of(body: bytes) -> str:
    """The text of a transcription answer: JSON `{"text": ...}`, or plain text."""
    try:
        answer = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()
    text = answer.get("text") if isinstance(answer, dict) else None
    return text if isinstance(text, str) else ""


def speech_request(pool: str) -> tuple[str, dict[str, str], bytes]:
    body = {"model": pool, "input": "Hello, how can I help?", "voice": "alloy"}
    body["response_format"] = "pcm"
    return "/v1/audio/speech", {"Content-Type": "application/json"}, json.dumps(body).encode()


def wav(seconds: float) -> bytes:
    """A PCM16 mono 24 kHz WAV of the simulator's tone: the upload a transcription bench sends."""
    frames = round(seconds * 1000 / voice_sim.FRAME_MS)
    audio = b"".join(voice_sim.audio_frame(index) for index in range(frames))
    out = io.BytesIO()
    header = voice_sim.wav_header()  # sizes filled in: a file, not a stream
    out.write(header[:4] + (36 + len(audio)).to_bytes(4, "little") + header[8:-4])
    out.write(len(audio).to_bytes(4, "little") + audio)
    return out.getvalue()


UPLOAD = wav(1.0)
BOUNDARY = "denv-bench-boundary"


def transcription_request(pool: str) -> tuple[str, dict[str, str], bytes]:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{pool}\r\n'.encode(),
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="bench.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n".encode()
        + UPLOAD
        + b"\r\n",
        f"--{BOUNDARY}--\r\n".encode(),
    ]
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    return "/v1/audio/transcriptions", headers, b"".join(parts)


def chat_request(pool: str, max_tokens: int | None) -> tuple[str, dict[str, str], bytes]:
    request: dict[str, object] = {
        "model": pool,
        "stream": True,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    if max_tokens:
        request["max_tokens"] = max_tokens
    headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
    return "/v1/chat/completions", headers, json.dumps(request).encode()


def _common_headers(request_id: str, session: str | None, api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": "denv-bench", "X-Request-Id": request_id}
    if session:
        headers["X-Denv-Session"] = session
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def _exchange(
    connection: Connection,
    request: tuple[str, dict[str, str], bytes],
    read: BodyReader,
    *,
    session: str | None,
    api_key: str | None,
    t0: float,
    via: Via,
    request_id: str | None = None,
) -> StreamResult:
    """One request on the worker's connection; `read` consumes a 200 answer's body. Its
    `X-Request-Id` is `request_id`, or a new one."""
    request_id = request_id or uuid.uuid4().hex
    path, extra, body = request
    headers = {**_common_headers(request_id, session, api_key), **extra}
    timing = _Timing(time.perf_counter())
    status, replica = 0, ""

    def result(error: str) -> StreamResult:
        return timing.result(request_id, t0, status, error, replica, via)

    # A kept-alive connection the server has since closed fails before any byte of the
    # response: sent again once, on a new connection, as every HTTP client does.
    for reused in (connection.is_open, False):
        try:
            if not connection.is_open:
                await connection.open()
            await connection.send(path, headers, body)
            status, response = await connection.head()
            break
        except (OSError, TimeoutError) as error:
            connection.close()
            if not reused:
                return result("timeout" if isinstance(error, TimeoutError) else "connect")
        except _Closed:
            connection.close()
            if not reused:
                return result("no_response")
    replica = response.get(REPLICA_HEADER, "")
    try:
        if status != 200:
            async for _ in connection.body(response):
                pass
            timing.ended = time.perf_counter()
            outcome = f"http_{status}"
        else:
            outcome = await read(connection.body(response), timing)
    except TimeoutError:
        connection.close()
        return result("timeout")
    except _Closed:
        connection.close()
        return result("aborted")
    return result(outcome)


async def stream_once(
    connection: Connection,
    pool: str,
    *,
    session: str | None = None,
    api_key: str | None = None,
    max_tokens: int | None = None,
    t0: float = 0.0,
    via: Via = "endpoint",
    request_id: str | None = None,
) -> StreamResult:
    """One streamed chat completion."""
    request = chat_request(pool, max_tokens)
    return await _exchange(
        connection,
        request,
        _read_chat,
        session=session,
        api_key=api_key,
        t0=t0,
        via=via,
        request_id=request_id,
    )


def _has_content(payload: str) -> bool:
    try:
        chunk = json.loads(payload)
        delta = chunk["choices"][0].get("delta", {})
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return False
    return bool(delta.get("content"))


# A realtime turn's audio: the current (GA) event, and the beta one that engines deployed
# before it may still send; the simulated replica sends the GA event only.
AUDIO_DELTA_EVENTS = ("response.output_audio.delta", "response.audio.delta")


class RealtimeSession:
    """One realtime WebSocket session on a worker's connection: opened on first use, one turn
    per `turn()`; after a close (by either side) the next turn opens a new session."""

    def __init__(self, connection: Connection, pool: str, api_key: str | None) -> None:
        self.connection, self.pool, self.api_key = connection, pool, api_key
        self.request_id = ""
        self.replica = ""
        self.status = 0

    @property
    def is_open(self) -> bool:
        return self.connection.is_open

    async def open(self, session: str | None) -> str:
        """The handshake and `session.created`: "" when served, else the error's kind."""
        self.request_id, self.replica, self.status = uuid.uuid4().hex, "", 0
        key = base64.b64encode(os.urandom(16)).decode()
        headers = {
            **_common_headers(self.request_id, session, self.api_key),
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Key": key,
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Protocol": voice_sim.REALTIME_SUBPROTOCOL,
        }
        path = f"/v1/realtime?model={urllib.parse.quote(self.pool)}"
        try:
            await self.connection.open()
            await self.connection.send(path, headers, None, method="GET")
            self.status, response = await self.connection.head()
            if self.status != 101:
                return self._give_up(f"http_{self.status}")
            if response.get("sec-websocket-accept") != voice_sim.websocket_accept(key):
                return self._give_up("bad_answer")
            self.replica = response.get(REPLICA_HEADER, "")
            self.connection.upgrade()
            while (event := await self._event()) is not None:
                if event.get("type") == "session.created":
                    return ""
            return self._give_up("closed")
        except TimeoutError:
            return self._give_up("timeout")
        except OSError:
            return self._give_up("connect")
        except _Closed:
            return self._give_up("no_response")

    def _give_up(self, error: str) -> str:
        self.connection.close()
        return error

    async def _event(self) -> dict[str, object] | None:
        """The next event of the session; None when the peer sent a close."""
        while True:
            opcode, payload = await self.connection.message()
            if opcode == Opcode.CLOSE:
                return None
            if opcode == Opcode.TEXT:
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    return event

    async def turn(
        self, session: str | None, t0: float, via: Via, heard: asyncio.Event | None = None
    ) -> StreamResult:
        """One turn: `response.create` to `response.done`; its figure is the first audio, and
        `heard` is set when it comes. A turn done without audio is `no_audio`."""
        timing = _Timing(time.perf_counter())
        if not self.is_open and (error := await self.open(session)):
            return timing.result(self.request_id, t0, self.status, error, self.replica, via)
        timing.start = time.perf_counter()
        outcome = "aborted"
        try:
            create = json.dumps({"type": "response.create"}).encode()
            await self.connection.send_text(create)
            while (event := await self._event()) is not None:
                kind = event.get("type")
                if kind in AUDIO_DELTA_EVENTS:
                    timing.unit()
                    if heard is not None:
                        heard.set()
                elif kind == "response.done":
                    # A turn is a success only if it was heard.
                    timing.ended = time.perf_counter()
                    outcome = "" if timing.units else "no_audio"
                    break
                elif kind == "error":
                    timing.ended, outcome = time.perf_counter(), "bad_answer"
                    break
            else:
                outcome = "closed"  # a close frame mid-turn: the peer ended the session
        except TimeoutError:
            outcome = "timeout"
        except _Closed:
            outcome = "aborted"  # the socket went without a close frame (1006)
        if outcome:
            self.connection.close()
        return timing.result(self.request_id, t0, self.status, outcome, self.replica, via)

    async def until_closed(self) -> str:
        """Wait, idle, for the session to end: `closed` (a close frame came), `aborted` (the
        socket went without one) or `timeout` (still open after the connection's timeout)."""
        try:
            while await self._event() is not None:
                pass
            outcome = "closed"
        except TimeoutError:
            outcome = "timeout"
        except _Closed:
            outcome = "aborted"
        self.connection.close()
        return outcome

    async def close(self) -> None:
        """A clean close: the close frame (1000), then the socket."""
        if self.is_open:
            with contextlib.suppress(OSError):
                await self.connection.close_websocket()
        self.connection.close()


class _Worker:
    """One worker's client of one URL: its connection, and its realtime session if any."""

    def __init__(
        self,
        endpoint: Endpoint,
        protocol: Protocol,
        pool: str,
        api_key: str | None,
        timeout_s: float,
        via: Via,
        max_tokens: int | None = None,
    ) -> None:
        self.connection = Connection(endpoint, timeout_s, CONNECT_TIMEOUT_S)
        self.protocol, self.pool, self.api_key, self.via = protocol, pool, api_key, via
        self.max_tokens = max_tokens
        self.realtime = RealtimeSession(self.connection, pool, api_key)

    async def request(self, session: str | None, new_session: bool, t0: float) -> StreamResult:
        if self.protocol == "realtime":
            if new_session:
                await self.realtime.close()
            return await self.realtime.turn(session, t0, self.via)
        request, read = {
            "chat": (chat_request(self.pool, self.max_tokens), _read_chat),
            "speech": (speech_request(self.pool), _read_speech),
            "transcription": (transcription_request(self.pool), _read_transcript),
        }[self.protocol]
        return await _exchange(
            self.connection,
            request,
            read,
            session=session,
            api_key=self.api_key,
            t0=t0,
            via=self.via,
        )

    async def close(self) -> None:
        await self.realtime.close()


@dataclass(frozen=True)
class Arrival:
    """One request of an open-loop run: when it is sent (seconds since the run started) and the
    conversation it belongs to (`session`, None for a request of its own)."""

    at_s: float
    session: str | None = None


# An open-loop run keeps this many conversations going at once: a session arrival is a turn of
# one of them, so a conversation's turns are spread over the run rather than back to back.
OPEN_SESSIONS = 8


def arrivals(
    rate: float,
    *,
    requests: int | None = None,
    duration_s: float | None = None,
    session_share: float = 0.0,
    session_turns: int = 0,
    open_sessions: int = OPEN_SESSIONS,
    seed: int = 0,
) -> Iterator[Arrival]:
    """Poisson arrivals at `rate` requests/s, until `requests` of them or `duration_s`, whichever
    comes first; the same seed gives the same run. A share `session_share` of them are turns of
    conversations of `session_turns` turns each: `open_sessions` go on at once, each turn goes to
    one of them at random, and a conversation that had its last turn gives way to a new one."""
    problems = open_loop_problems(rate, session_share, session_turns)
    if problems:
        raise ValueError("; ".join(problems))
    if requests is None and duration_s is None:
        raise ValueError("give duration_s or requests")
    draw = random.Random(seed)
    live: list[list[int]] = []  # [conversation number, turns taken]
    started = 0
    at_s, count = 0.0, 0
    while requests is None or count < requests:
        at_s += draw.expovariate(rate)
        if duration_s is not None and at_s >= duration_s:
            return
        count += 1
        if draw.random() >= session_share:
            yield Arrival(at_s)
            continue
        if len(live) < open_sessions:
            live.append([started, 0])
            started += 1
        slot = draw.randrange(len(live))
        conversation = live[slot]
        conversation[1] += 1
        yield Arrival(at_s, f"o{seed}-c{conversation[0]}")
        if conversation[1] >= session_turns:
            live[slot] = [started, 0]
            started += 1


def open_loop_problems(rate: float, session_share: float, session_turns: int) -> list[str]:
    """What is wrong with an open-loop run's settings, one line each, naming the fix."""
    problems = []
    if not (math.isfinite(rate) and rate > 0):
        problems.append(f"rate: {rate} is not a positive number of requests/s; e.g. 5")
    if not 0.0 <= session_share <= 1.0:
        problems.append(f"session share: {session_share} is not between 0 and 1; e.g. 0.5")
    elif session_share > 0 and session_turns < 1:
        problems.append("session share: needs turns per conversation (session turns), e.g. 4")
    return problems


class _Clients:
    """What one request goes out on: a client per endpoint URL (tried in order while nothing
    was answered) and, with direct URLs, one replica called straight; each keeps its connection
    (and realtime session) between the requests it carries."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        direct: Endpoint | None,
        protocol: Protocol,
        pool: str,
        api_key: str | None,
        timeout_s: float,
        max_tokens: int | None = None,
    ) -> None:
        # The key is the endpoint's: a replica called directly never sees it.
        self.through = [
            _Worker(e, protocol, pool, api_key, timeout_s, "endpoint", max_tokens)
            for e in endpoints
        ]
        self.direct = (
            []
            if direct is None
            else [_Worker(direct, protocol, pool, None, timeout_s, "direct", max_tokens)]
        )
        self.session: str | None = None

    async def send(
        self, session: str | None, new_session: bool, t0: float, direct_first: bool
    ) -> list[StreamResult]:
        """One request through the endpoint (and one to the replica); a result per path."""
        new_session = new_session or session != self.session
        self.session = session
        results = []
        for clients in [self.direct, self.through] if direct_first else [self.through, self.direct]:
            for client in clients:
                result = await client.request(session, new_session, t0)
                if result.error not in RETRYABLE:
                    break
            if clients:
                results.append(result)
        return results

    async def close(self) -> None:
        for client in [*self.through, *self.direct]:
            await client.close()


async def run_load(
    url: str,
    pool: str,
    *,
    protocol: Protocol = "chat",
    concurrency: int = 8,
    duration_s: float | None = None,
    requests: int | None = None,
    session_turns: int = 0,
    api_key: str | None = None,
    timeout_s: float = 30.0,
    fallback_urls: tuple[str, ...] = (),
    direct_urls: tuple[str, ...] = (),
    rate: float | None = None,
    session_share: float = 0.0,
    seed: int = 0,
    stop: asyncio.Event | None = None,
    max_tokens: int | None = None,
) -> LoadReport:
    """Closed-loop load by default: `concurrency` workers, each sending its next request when
    one ends. With `session_turns`, each worker is a conversation of that many turns sharing one
    `X-Denv-Session`, then starts a new conversation (a realtime worker opens a new session;
    without `session_turns` it keeps one session while it lasts).

    With `rate`, open-loop load instead (`arrivals`): Poisson arrivals at `rate` requests/s,
    seeded by `seed`, each request its own task, so a slow answer never delays the next arrival
    (`concurrency` does not apply); a share `session_share` of them are turns of conversations of
    `session_turns` turns. A request takes an idle connection, or opens one.

    With `fallback_urls`, a request that got no response at all (refused, reset before a byte)
    is sent to the next URL, as a client resolving several balancer addresses would. With
    `direct_urls` (replicas), every request is also sent straight to one of them, alternating
    which path goes first, without `api_key`: that key is the endpoint's, and a replica must
    never see it. The run ends when the requests or the duration are used up and every request
    sent has its answer (or its `timeout_s`). With `stop`, no request is sent once it is set
    (those under way end first). `max_tokens` bounds each chat answer (a real engine decodes
    to its end-of-text otherwise).
    """
    if duration_s is None and requests is None:
        raise ValueError("give duration_s or requests")
    if rate is None and session_share:
        raise ValueError("session_share needs an open-loop rate")
    report = LoadReport(protocol=protocol, pool=pool)
    endpoints = [Endpoint(u) for u in (url, *fallback_urls)]
    directs = [Endpoint(u) for u in direct_urls]
    made = [0]

    def clients() -> _Clients:
        direct = directs[made[0] % len(directs)] if directs else None
        made[0] += 1
        return _Clients(endpoints, direct, protocol, pool, api_key, timeout_s, max_tokens)

    t0 = time.perf_counter()
    if rate is None:
        await _closed_loop(
            report, clients, t0, concurrency, duration_s, requests, session_turns, stop
        )
    else:
        plan = arrivals(
            rate,
            requests=requests,
            duration_s=duration_s,
            session_share=session_share,
            session_turns=session_turns,
            seed=seed,
        )
        await _open_loop(report, clients, t0, plan, stop)
    report.wall_s = time.perf_counter() - t0
    return report


async def _closed_loop(
    report: LoadReport,
    clients: Callable[[], _Clients],
    t0: float,
    concurrency: int,
    duration_s: float | None,
    requests: int | None,
    session_turns: int,
    stop: asyncio.Event | None,
) -> None:
    deadline = t0 + duration_s if duration_s is not None else None
    budget = [requests] if requests is not None else None

    def more() -> bool:
        if stop is not None and stop.is_set():
            return False
        if deadline is not None and time.perf_counter() >= deadline:
            return False
        if budget is not None:
            if budget[0] <= 0:
                return False
            budget[0] -= 1
        return True

    async def worker(index: int) -> None:
        mine = clients()
        turn, conversation, sent = 0, 0, 0
        while more():
            session, new_session = None, False
            if session_turns:
                session = f"w{index}-c{conversation}"
                new_session = turn == 0
                turn += 1
                if turn >= session_turns:
                    turn, conversation = 0, conversation + 1
            report.results.extend(await mine.send(session, new_session, t0, sent % 2 == 1))
            sent += 1
        await mine.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))


async def _open_loop(
    report: LoadReport,
    clients: Callable[[], _Clients],
    t0: float,
    plan: Iterator[Arrival],
    stop: asyncio.Event | None,
) -> None:
    idle: list[_Clients] = []
    in_flight: set[asyncio.Task[None]] = set()

    async def one(arrival: Arrival, index: int) -> None:
        mine = idle.pop() if idle else clients()
        report.results.extend(await mine.send(arrival.session, False, t0, index % 2 == 1))
        idle.append(mine)

    for index, arrival in enumerate(plan):
        wait = t0 + arrival.at_s - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if stop is not None and stop.is_set():
            break
        task = asyncio.create_task(one(arrival, index))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.gather(*in_flight)
    for mine in idle:
        await mine.close()
