"""How the load generator reads each protocol's answer and times it: chat's server-sent events,
speech's audio bytes, a transcript, and a realtime WebSocket session's turns; and one request
on a worker's connection, classified into a result (a kept-alive connection the server closed
is tried again once, on a new one).
"""

import asyncio
import contextlib
import json
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from websockets.frames import Opcode
from websockets.utils import generate_key

from denv_iac.ops.loadgen_report import StreamResult, Via
from denv_iac.ops.loadgen_requests import chat_request
from denv_iac.ops.loadgen_transport import Connection, PeerClosed
from denv_iac.wire.websocket import upgrade_accepted, upgrade_headers

REPLICA_HEADER = "x-denv-replica"


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


async def read_chat(body: AsyncIterator[bytes], timing: _Timing) -> str:
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


async def read_speech(body: AsyncIterator[bytes], timing: _Timing) -> str:
    async for chunk in body:
        if chunk:
            timing.unit(len(chunk))
    timing.ended = time.perf_counter()
    return "" if timing.units else "bad_answer"


async def read_transcript(body: AsyncIterator[bytes], timing: _Timing) -> str:
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


def _common_headers(request_id: str, session: str | None, api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": "denv-bench", "X-Request-Id": request_id}
    if session:
        headers["X-Denv-Session"] = session
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def exchange(
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
        except PeerClosed:
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
    except PeerClosed:
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
    return await exchange(
        connection,
        request,
        read_chat,
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
        key = generate_key()
        headers = {
            **_common_headers(self.request_id, session, self.api_key),
            **upgrade_headers(key),
        }
        path = f"/v1/realtime?model={urllib.parse.quote(self.pool)}"
        try:
            await self.connection.open()
            await self.connection.send(path, headers, None, method="GET")
            self.status, response = await self.connection.head()
            if self.status != 101:
                return self._give_up(f"http_{self.status}")
            if not upgrade_accepted(key, response):
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
        except PeerClosed:
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
        except PeerClosed:
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
        except PeerClosed:
            outcome = "aborted"
        self.connection.close()
        return outcome

    async def close(self) -> None:
        """A clean close: the close frame (1000), then the socket."""
        if self.is_open:
            with contextlib.suppress(OSError):
                await self.connection.close_websocket()
        self.connection.close()
