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

This module runs the load (workers, closed and open loops); the modules `loadgen_*` beside it
hold its parts: the report, the connections, the requests, the protocol readers and the
open-loop arrivals.
"""

import asyncio
import time
from collections.abc import Callable, Iterator

from denv_iac.ops.loadgen_arrivals import Arrival, arrivals
from denv_iac.ops.loadgen_protocols import (
    RealtimeSession,
    exchange,
    read_chat,
    read_speech,
    read_transcript,
)
from denv_iac.ops.loadgen_report import LoadReport, Protocol, StreamResult, Via
from denv_iac.ops.loadgen_requests import chat_request, speech_request, transcription_request
from denv_iac.ops.loadgen_transport import CONNECT_TIMEOUT_S, Connection, Endpoint

RETRYABLE = ("connect", "no_response")  # nothing was answered: safe to send elsewhere


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
            "chat": (chat_request(self.pool, self.max_tokens), read_chat),
            "speech": (speech_request(self.pool), read_speech),
            "transcription": (transcription_request(self.pool), read_transcript),
        }[self.protocol]
        return await exchange(
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
