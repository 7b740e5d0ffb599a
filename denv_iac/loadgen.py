"""OpenAI-compatible streaming load through an endpoint, measured per request.

Each request carries its own `X-Request-Id`, so a run can be checked against the replicas' own
logs: a stream that was replayed elsewhere would show up there twice.
"""

import asyncio
import json
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx

REPLICA_HEADER = "x-denv-replica"
RETRYABLE = ("connect", "no_response")  # nothing was answered: safe to send elsewhere


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


async def stream_once(
    client: httpx.AsyncClient,
    url: str,
    pool: str,
    *,
    session: str | None = None,
    api_key: str | None = None,
    max_tokens: int | None = None,
    t0: float = 0.0,
) -> StreamResult:
    request_id = uuid.uuid4().hex
    headers = {"X-Request-Id": request_id, "Accept": "text/event-stream"}
    if session:
        headers["X-Denv-Session"] = session
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body: dict[str, object] = {
        "model": pool,
        "stream": True,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    if max_tokens:
        body["max_tokens"] = max_tokens
    start = time.perf_counter()
    status, replica, tokens, first, last = 0, "", 0, None, None
    gaps: list[float] = []
    done = False

    def result(error: str) -> StreamResult:
        ttft = (first - start) * 1000 if first is not None else None
        total = (time.perf_counter() - start) * 1000
        return StreamResult(
            request_id, start - t0, status, error, replica, ttft, total, tokens, tuple(gaps)
        )

    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            status = response.status_code
            replica = response.headers.get(REPLICA_HEADER, "")
            if status != 200:
                await response.aread()
                return result(f"http_{status}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                if _has_content(payload):
                    if first is None:
                        first = now
                    elif last is not None:
                        gaps.append((now - last) * 1000)
                    last = now
                    tokens += 1
    except (httpx.ConnectError, httpx.ConnectTimeout):
        return result("connect")
    except httpx.TimeoutException:
        return result("timeout")
    except (httpx.RemoteProtocolError, httpx.ReadError):
        # Cut before any response: nothing started, so the client may send it elsewhere.
        return result("aborted" if status else "no_response")
    # A stream that ends without [DONE] is an abort the client can see, never a success.
    return result("" if done else "aborted")


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
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=5.0)
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

    async def worker(index: int, client: httpx.AsyncClient) -> None:
        turn, conversation = 0, 0
        while more():
            session = None
            if session_turns:
                session = f"w{index}-c{conversation}"
                turn += 1
                if turn >= session_turns:
                    turn, conversation = 0, conversation + 1
            for target in (url, *fallback_urls):
                result = await stream_once(
                    client, target, pool, session=session, api_key=api_key, t0=t0
                )
                if result.error not in RETRYABLE:
                    break
            report.results.append(result)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(i, client) for i in range(concurrency)))
    report.wall_s = time.perf_counter() - t0
    return report
