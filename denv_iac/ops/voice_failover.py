"""Realtime session failover, measured from the client's side: open sessions, kill the replica
that serves the most of them mid-turn, and reconnect each session it cut at once.

The contract (docs/balancer.md): a session stays on one replica for its life and is never moved
or replayed; when its replica dies the client sees the socket close, and a reconnect with the
same `X-Denv-Session` is served by a healthy replica. Counted here:

- cut: the dead replica's sessions, and how the client saw it (`aborted`: the socket went
  without a close frame, 1006; `closed`: a close frame came); `cut_idle` of them between turns,
  where a busy client had read the whole turn before the kill landed;
- stalled: sessions cut without any close, found only by the client's own timeout: the failure
  the contract rules out;
- replayed: cut sessions whose opening request (its `X-Request-Id`) reached any replica other
  than the one it was opened on, by the replicas' own logs;
- failed_reconnects, and reconnect_ms: from the moment the client saw the close to
  `session.created` on the new socket.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from denv_iac.ops.loadgen_protocols import RealtimeSession
from denv_iac.ops.loadgen_report import percentile
from denv_iac.ops.loadgen_transport import CONNECT_TIMEOUT_S, Connection, Endpoint

Seen = Callable[[], dict[str, list[str]]]  # request id -> the replicas that received it


@dataclass(frozen=True)
class SessionOutcome:
    session: str
    request_id: str  # of the opening request
    replica: str
    cut: str  # "" when the turn at the kill completed; else the error the client saw
    cut_at: float | None  # perf_counter() when the client saw it
    idle: bool  # cut between turns: its last turn had ended before the kill landed
    reconnect_error: str  # "" when the reconnect was served
    reconnect_ms: float | None
    reconnect_replica: str
    turn_after_error: str  # the first turn on the new socket


@dataclass(frozen=True)
class FailoverReport:
    victim: str
    killed_at: float  # perf_counter() when the kill was issued
    outcomes: tuple[SessionOutcome, ...]
    replayed: int

    def figures(self) -> dict[str, object]:
        cut = [o for o in self.outcomes if o.cut]
        reconnects = [o.reconnect_ms for o in cut if o.reconnect_ms is not None]
        closes = [(o.cut_at - self.killed_at) * 1000 for o in cut if o.cut_at is not None]
        worst_close = max(closes, default=None)
        worst = max(reconnects, default=None)
        p50 = percentile(reconnects, 50)
        return {
            "sessions": len(self.outcomes),
            "cut": len(cut),
            "cut_as": dict(sorted(Counter(o.cut for o in cut).items())),
            "cut_idle": sum(1 for o in cut if o.idle),
            "stalled": sum(1 for o in cut if o.cut == "timeout"),
            "replayed": self.replayed,
            "failed_reconnects": sum(1 for o in cut if o.reconnect_error or o.turn_after_error),
            "reconnected_elsewhere": sum(
                1 for o in cut if o.reconnect_replica and o.reconnect_replica != self.victim
            ),
            "close_after_kill_max_ms": None if worst_close is None else round(worst_close, 2),
            "reconnect_p50_ms": None if p50 is None else round(p50, 2),
            "reconnect_max_ms": None if worst is None else round(worst, 2),
        }


def count_replayed(outcomes: tuple[SessionOutcome, ...], seen: dict[str, list[str]]) -> int:
    """Cut sessions whose opening request reached a replica other than its own, or twice."""
    replayed = 0
    for outcome in outcomes:
        receipts = seen.get(outcome.request_id, [])
        if outcome.cut and (len(receipts) > 1 or any(r != outcome.replica for r in receipts)):
            replayed += 1
    return replayed


async def realtime_failover(
    url: str,
    pool: str,
    kill: Callable[[str], None],
    seen: Seen,
    *,
    sessions: int = 8,
    timeout_s: float = 5.0,
    api_key: str | None = None,
    ends_sessions: bool = True,
) -> FailoverReport:
    """`sessions` sessions through `url`, each one turn warm; then a turn on all of them, and
    `kill(replica)` ends the replica serving the most once each of its sessions heard audio:
    mid-turn, whatever the pace of the replica. A fault that must not end any session (a
    balancer reload) passes `ends_sessions=False`: then a session is cut only if its turn is."""
    endpoint = Endpoint(url)
    run = time.monotonic_ns()
    clients = {
        f"failover-{run}-{n}": RealtimeSession(
            Connection(endpoint, timeout_s, CONNECT_TIMEOUT_S), pool, api_key
        )
        for n in range(sessions)
    }
    warm = await asyncio.gather(*(c.turn(n, 0.0, "endpoint") for n, c in clients.items()))
    if failed := [r.error for r in warm if r.error]:
        raise RuntimeError(f"sessions failed to open before the kill: {Counter(failed)}")
    victim = Counter(c.replica for c in clients.values()).most_common(1)[0][0]
    heard = {name: asyncio.Event() for name in clients}
    killed_at: list[float] = []

    async def kill_victim() -> None:
        on_victim = [heard[n] for n, c in clients.items() if c.replica == victim]
        await asyncio.wait([asyncio.create_task(e.wait()) for e in on_victim], timeout=timeout_s)
        killed_at.append(time.perf_counter())
        await asyncio.to_thread(kill, victim)

    async def turn_and_reconnect(client: RealtimeSession, name: str) -> SessionOutcome:
        request_id, replica = client.request_id, client.replica
        result = await client.turn(name, 0.0, "endpoint", heard[name])
        cut, idle = result.error, False
        if not cut and replica == victim and ends_sessions:
            # The turn ended before the kill landed (a busy client reads late): the session
            # is idle on a dead replica, and must see its socket close all the same.
            cut, idle = await client.until_closed(), True
        if not cut:
            await client.close()
            return SessionOutcome(name, request_id, replica, "", None, False, "", None, "", "")
        seen_at = time.perf_counter()
        error = await client.open(name)
        reconnect_ms = (time.perf_counter() - seen_at) * 1000 if not error else None
        after = "" if error else (await client.turn(name, 0.0, "endpoint")).error
        new_replica = client.replica
        await client.close()
        return SessionOutcome(
            name, request_id, replica, cut, seen_at, idle, error, reconnect_ms, new_replica, after
        )

    killer = asyncio.create_task(kill_victim())
    outcomes = await asyncio.gather(*(turn_and_reconnect(c, n) for n, c in clients.items()))
    await killer
    replayed = count_replayed(tuple(outcomes), await asyncio.to_thread(seen))
    return FailoverReport(victim, killed_at[0], tuple(outcomes), replayed)
