"""OpenAI-compatible streaming load through an endpoint, measured per request.

Each request carries its own `X-Request-Id`, so a run can be checked against the replicas' own
logs: a stream that was replayed elsewhere would show up there twice.
"""

import asyncio
import json
import ssl
import statistics
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

REPLICA_HEADER = "x-denv-replica"
RETRYABLE = ("connect", "no_response")  # nothing was answered: safe to send elsewhere
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class StreamResult:
    request_id: str
    started_s: float  # since the run started
    status: int  # 0 when no HTTP response arrived
    error: str  # "" for a completed stream; else aborted, connect, timeout, http_<status>
    replica: str
    ttft_ms: float | None
    total_ms: float
    tokens: int
    gaps_ms: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.error


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

    def errors(self) -> Counter[str]:
        return Counter(r.error for r in self.results if r.error)

    def ttft_ms(self, q: float) -> float | None:
        """TTFT percentile `q` of the completed streams, rounded to 0.01 ms."""
        ttfts = [r.ttft_ms for r in self.results if r.ok and r.ttft_ms is not None]
        value = percentile(ttfts, q)
        return None if value is None else round(value, 2)

    def summary(self) -> dict[str, object]:
        gaps = [g for r in self.results if r.ok for g in r.gaps_ms]
        tokens = sum(r.tokens for r in self.results if r.ok)

        return {
            "requests": len(self.results),
            "ok": sum(1 for r in self.results if r.ok),
            "errors": dict(sorted(self.errors().items())),
            "ttft_p50_ms": self.ttft_ms(50),
            "ttft_p90_ms": self.ttft_ms(90),
            "ttft_p99_ms": self.ttft_ms(99),
            "itl_mean_ms": round(statistics.fmean(gaps), 2) if gaps else None,
            "tokens_per_s": round(tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "replicas": dict(
                sorted(Counter(r.replica for r in self.results if r.ok and r.replica).items())
            ),
        }


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
    """The peer closed or reset the connection."""


class Connection:
    """One worker's keep-alive HTTP/1.1 connection.

    A load generator's own overhead lands in every figure it reports. A general-purpose client
    pool costs a busy event loop a lot per request (at 64 streams on two cores it added hundreds
    of milliseconds to the measured first token, and made fast 503s take seconds), so each
    worker keeps one plain connection and reads the response as it arrives.
    """

    def __init__(self, endpoint: Endpoint, timeout_s: float, connect_timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ssl = ssl.create_default_context() if endpoint.tls else None

    @property
    def is_open(self) -> bool:
        return self._writer is not None

    async def open(self) -> None:
        async with asyncio.timeout(self.connect_timeout_s):
            self._reader, self._writer = await asyncio.open_connection(
                self.endpoint.host, self.endpoint.port, ssl=self._ssl
            )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def send(self, path: str, headers: dict[str, str], body: bytes) -> None:
        assert self._writer is not None
        lines = [f"POST {self.endpoint.prefix}{path} HTTP/1.1", f"Host: {self.endpoint.authority}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines += [f"Content-Length: {len(body)}", "", ""]
        self._writer.write("\r\n".join(lines).encode("latin-1") + body)
        await self._writer.drain()

    async def _read(self, read: Callable[[], Awaitable[bytes]]) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):
                data = await read()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError) as error:
            raise _Closed from error
        if not data:
            raise _Closed
        return data

    async def line(self) -> bytes:
        assert self._reader is not None
        reader = self._reader
        data = await self._read(reader.readline)
        if not data.endswith(b"\n"):
            raise _Closed
        return data.rstrip(b"\r\n")

    async def exactly(self, size: int) -> bytes:
        assert self._reader is not None
        reader = self._reader
        return await self._read(lambda: reader.readexactly(size)) if size else b""

    async def head(self) -> tuple[int, dict[str, str]]:
        """The status and headers (names lower-cased) of the response."""
        status_line = await self.line()
        try:
            status = int(status_line.split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise _Closed from None
        headers = {}
        while line := await self.line():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked; ends at its end (or at EOF, when unframed)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await self.line()).split(b";")[0] or b"0", 16):
                yield await self.exactly(size)
                await self.line()
            while await self.line():  # trailers
                pass
        elif "content-length" in headers:
            yield await self.exactly(int(headers["content-length"]))
        else:
            assert self._reader is not None
            reader = self._reader
            try:
                while True:
                    yield await self._read(lambda: reader.read(65536))
            except _Closed:
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


async def stream_once(
    connection: Connection,
    pool: str,
    *,
    session: str | None = None,
    api_key: str | None = None,
    max_tokens: int | None = None,
    t0: float = 0.0,
) -> StreamResult:
    request_id = uuid.uuid4().hex
    headers = {
        "User-Agent": "denv-bench",
        "Accept": "text/event-stream",
        "Content-Type": "application/json",
        "X-Request-Id": request_id,
    }
    if session:
        headers["X-Denv-Session"] = session
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request: dict[str, object] = {
        "model": pool,
        "stream": True,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    if max_tokens:
        request["max_tokens"] = max_tokens
    body = json.dumps(request).encode()
    start = time.perf_counter()
    status, replica, tokens, first, last, ended = 0, "", 0, None, None, None
    gaps: list[float] = []

    def result(error: str) -> StreamResult:
        ttft = (first - start) * 1000 if first is not None else None
        total = ((ended or time.perf_counter()) - start) * 1000
        return StreamResult(
            request_id, start - t0, status, error, replica, ttft, total, tokens, tuple(gaps)
        )

    # A kept-alive connection the server has since closed fails before any byte of the
    # response: sent again once, on a new connection, as every HTTP client does.
    for reused in (connection.is_open, False):
        try:
            if not connection.is_open:
                await connection.open()
            await connection.send("/v1/chat/completions", headers, body)
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
            ended = time.perf_counter()
            outcome = f"http_{status}"
        else:
            outcome = "aborted"  # a stream that ends without [DONE] is an abort, never a success
            async for line in _body_lines(connection.body(response)):
                if ended is not None or not line.startswith("data:"):
                    continue  # after [DONE]: read to the end, so the connection can be kept
                payload = line[5:].strip()
                now = time.perf_counter()
                if payload == "[DONE]":
                    ended, outcome = now, ""
                elif _has_content(payload):
                    if first is None:
                        first = now
                    elif last is not None:
                        gaps.append((now - last) * 1000)
                    last = now
                    tokens += 1
    except TimeoutError:
        connection.close()
        return result("timeout")
    except _Closed:
        connection.close()
        return result("aborted")
    if response.get("connection", "").lower() == "close":
        connection.close()
    return result(outcome)


def _has_content(payload: str) -> bool:
    try:
        chunk = json.loads(payload)
        delta = chunk["choices"][0].get("delta", {})
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return False
    return bool(delta.get("content"))


async def run_load(
    url: str,
    pool: str,
    *,
    concurrency: int = 8,
    duration_s: float | None = None,
    requests: int | None = None,
    session_turns: int = 0,
    api_key: str | None = None,
    timeout_s: float = 30.0,
    fallback_urls: tuple[str, ...] = (),
) -> LoadReport:
    """Closed-loop load: `concurrency` workers, each sending its next request when one ends.

    With `session_turns`, each worker is a conversation of that many turns sharing one
    `X-Denv-Session`, then starts a new conversation. With `fallback_urls`, a request that got
    no response at all (refused, reset before a byte) is sent to the next URL, as a client
    resolving several balancer addresses would.
    """
    if duration_s is None and requests is None:
        raise ValueError("give duration_s or requests")
    report = LoadReport()
    endpoints = [Endpoint(u) for u in (url, *fallback_urls)]
    t0 = time.perf_counter()
    deadline = t0 + duration_s if duration_s is not None else None
    budget = [requests] if requests is not None else None

    def more() -> bool:
        if deadline is not None and time.perf_counter() >= deadline:
            return False
        if budget is not None:
            if budget[0] <= 0:
                return False
            budget[0] -= 1
        return True

    async def worker(index: int) -> None:
        connections = [Connection(e, timeout_s, CONNECT_TIMEOUT_S) for e in endpoints]
        turn, conversation = 0, 0
        while more():
            session = None
            if session_turns:
                session = f"w{index}-c{conversation}"
                turn += 1
                if turn >= session_turns:
                    turn, conversation = 0, conversation + 1
            for connection in connections:
                result = await stream_once(
                    connection, pool, session=session, api_key=api_key, t0=t0
                )
                if result.error not in RETRYABLE:
                    break
            report.results.append(result)
        for connection in connections:
            connection.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    report.wall_s = time.perf_counter() - t0
    return report
