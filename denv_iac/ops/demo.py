"""`make demo`: the core promise, shown for real on this machine.

Traffic on every pool flows through the local endpoint, each pool in its own protocol (chat;
speech on `tts`, transcription on `stt`; realtime sessions on `voice` too) while, in turn, a
voice replica's process dies mid-stream and in the middle of realtime turns, comes back, and a
node's GPU reports XID 79 (fallen off the bus). The realtime sessions cut by the death see their
socket close and reconnect at once, and are served by another replica. The summary counts
requests lost although a healthy replica existed (a failed reconnect among them), and streams
or sessions replayed on another replica (checked against every replica's own request log): both
must be 0.
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from denv_agent.control import inject_fault

from denv_iac.local.replica_model import control_headers
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_report import FIGURES, LoadReport, Protocol, StreamResult
from denv_iac.ops.voice_failover import FailoverReport, realtime_failover

Say = Callable[[str], None]
VOICE = "voice"  # the pool whose replica dies, and which also carries realtime sessions
# The example stack's speech and transcription pools, loaded in their own protocol; every
# other pool gets streamed chat.
PROTOCOL_OF_POOL: dict[str, Protocol] = {"tts": "speech", "stt": "transcription"}
REALTIME_WORKERS = 2
FAILOVER_SESSIONS = 4


@dataclass(frozen=True)
class DemoResult:
    requests: int
    aborted: int
    lost: int
    replayed: int
    retried: int  # resent before their first byte: safe, shown so that it is seen
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    realtime_cut: int  # realtime sessions cut by the replica's death, each reconnected
    realtime_reconnect_max_ms: float | None  # from the close the client saw to the new session

    @property
    def line(self) -> str:
        return (
            f"requests={self.requests} aborted_streams={self.aborted} "
            f"ttft_p50_ms={self.ttft_p50_ms} ttft_p90_ms={self.ttft_p90_ms} "
            f"realtime_sessions_cut={self.realtime_cut} "
            f"realtime_reconnect_max_ms={self.realtime_reconnect_max_ms} "
            f"lost_requests={self.lost} replayed_streams={self.replayed} "
            f"retried_before_first_byte={self.retried}"
        )

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.replayed == 0 and self.requests > 0


def inject_xid(state: RunState, node: str, gpu: int, xid: int) -> None:
    inject_fault(state.agent_of(node).url, state.control_token, gpu=gpu, xid=xid)


def kill_replica(state: RunState, replica_id: str, client: httpx.Client | None = None) -> None:
    """The replica's process exits at once. Pass a client made beforehand where the moment
    matters: a new one costs a few hundred milliseconds (its TLS context)."""
    replica = next(r for r in state.replicas if r.id == replica_id)
    url = f"{replica.url}/control/fault"
    headers = control_headers(state.control_token)
    if client is None:
        httpx.post(url, json={"mode": "exit"}, headers=headers, timeout=5)
    else:
        client.post(url, json={"mode": "exit"}, headers=headers)


def replica_fault(state: RunState, replica_id: str, mode: str, k: int = 0) -> None:
    """Sets a simulated replica's fault (`POST /control/fault`); mode `none` clears it."""
    replica = next(r for r in state.replicas if r.id == replica_id)
    set_fault(replica.url, state.control_token, mode, k)


def set_fault(replica_url: str, token: str, mode: str, k: int = 0) -> None:
    """Sets the fault of the simulated replica at `replica_url` that obeys `token`."""
    httpx.post(
        f"{replica_url}/control/fault",
        json={"mode": mode, "k": k},
        headers=control_headers(token),
        timeout=5,
    ).raise_for_status()


def seen_by_replicas(state: RunState) -> dict[str, list[str]]:
    """Request id -> the live replicas that received it, once per receipt."""
    seen: dict[str, list[str]] = {}
    for replica in state.replicas:
        try:
            stats = httpx.get(f"{replica.url}/stats", timeout=5).json()
        except httpx.HTTPError:
            continue
        for request_id, count in stats["by_request_id"].items():
            seen.setdefault(request_id, []).extend([replica.id] * int(count))
    return seen


def count_replayed(results: list[StreamResult], seen: dict[str, list[str]]) -> int:
    """Streams whose client may have heard two generations, by the replicas' own logs: an
    aborted stream received by a live replica other than the one that served it (the replica it
    died on may be gone, and its log with it), or received twice by its own.

    A stream that completed cannot have been replayed, however many replicas received it: the
    balancer resends a request only before its first response byte (a failed connect, a replica
    silent past its first-token budget or marked down while the request waited), and never
    continues a started answer from another replica, so its client heard one generation.
    `count_retried` counts those."""
    return sum(1 for r in results if r.error == "aborted" and _sent_again(r, seen))


def _sent_again(result: StreamResult, seen: dict[str, list[str]]) -> bool:
    receipts = seen.get(result.request_id, [])
    return len(receipts) > 1 or any(other != result.replica for other in receipts)


def count_retried(results: list[StreamResult], seen: dict[str, list[str]]) -> int:
    """Requests the balancer resent before any byte reached their client: received more than
    once, yet not replayed. Safe by the streaming contract; counted to be seen."""
    return sum(1 for r in results if r.error != "aborted" and len(seen.get(r.request_id, [])) > 1)


async def _faults(
    cluster: LocalCluster, state: RunState, say: Say, api_key: str | None
) -> FailoverReport:
    voice = [r for r in state.replicas if r.pool == VOICE]
    await asyncio.sleep(2.0)
    say(
        f"t=2s  {FAILOVER_SESSIONS} realtime sessions on {VOICE}: the replica serving most of "
        "them dies (process exit) mid-turn, with streams in flight"
    )
    with httpx.Client(timeout=5) as client:
        # On an event loop of its own: the load's workers would delay its reads, and its
        # close and reconnect times are the figures shown.
        failover = await asyncio.to_thread(
            asyncio.run,
            realtime_failover(
                state.endpoint,
                VOICE,
                lambda replica_id: kill_replica(state, replica_id, client),
                lambda: seen_by_replicas(state),
                sessions=FAILOVER_SESSIONS,
                api_key=api_key,
            ),
        )
    figures = failover.figures()
    say(
        f"      {failover.victim} died: {figures['cut']} sessions cut"
        f" ({figures['cut_idle']} between turns; the client sees the socket close:"
        f" {figures['cut_as'] or 'none'}), reconnected to another replica"
        f" {figures['reconnected_elsewhere']}, within {figures['reconnect_max_ms']} ms of the"
        f" close; replayed {figures['replayed']}, failed reconnects"
        f" {figures['failed_reconnects']}"
    )
    await asyncio.sleep(1.0)
    say(f"t=4s  replica {failover.victim} restarted; it rejoins once its health checks pass")
    await asyncio.to_thread(cluster.restart_replica, failover.victim)
    await asyncio.sleep(3.0)
    second = next((r for r in voice if r.id != failover.victim), voice[-1])
    say(f"t=7s  node {second.site}/{second.node} GPU {second.gpu} reports XID 79")
    await asyncio.to_thread(inject_xid, state, f"{second.site}/{second.node}", second.gpu, 79)
    return failover


async def _traffic(
    cluster: LocalCluster, state: RunState, say: Say, duration_s: float, api_key: str | None
) -> tuple[list[LoadReport], FailoverReport]:
    async def load(pool: str, protocol: Protocol, concurrency: int, turns: int) -> LoadReport:
        return await run_load(
            state.endpoint,
            pool,
            protocol=protocol,
            concurrency=concurrency,
            duration_s=duration_s,
            session_turns=turns,
            api_key=api_key,
        )

    loads = [load(r.name, PROTOCOL_OF_POOL.get(r.name, "chat"), 8, 4) for r in cluster.stack.pools]
    loads.append(load(VOICE, "realtime", REALTIME_WORKERS, 0))
    faults = asyncio.create_task(_faults(cluster, state, say, api_key))
    reports = await asyncio.gather(*loads)
    return list(reports), await faults


def run_demo(
    cluster: LocalCluster, say: Say, duration_s: float = 10.0, api_key: str | None = None
) -> DemoResult:
    """The demo's traffic and faults on a running local stack; `api_key` is sent to the
    endpoint (a stack with `balancer.api_key_digests` answers nothing else)."""
    state = cluster.state
    assert state is not None
    reports, failover = asyncio.run(_traffic(cluster, state, say, duration_s, api_key))
    results = [r for report in reports for r in report.results]
    aborted = {r.request_id for r in results if r.error == "aborted"}
    figures = failover.figures()
    lost = sum(1 for r in results if r.error and r.error != "aborted")
    lost += int(str(figures["failed_reconnects"])) + int(str(figures["stalled"]))
    seen = seen_by_replicas(state)
    replayed = count_replayed(results, seen) + failover.replayed
    chat = [r for report in reports if report.protocol == "chat" for r in report.results]
    merged = LoadReport(chat, max(report.wall_s for report in reports))
    for report in reports:
        s = report.summary()
        key, short = FIGURES[report.protocol].key, FIGURES[report.protocol].short
        say(
            f"pool {report.pool} ({report.protocol}): {s['requests']} requests, errors"
            f" {s['errors'] or 'none'}, {short} p50 {s[f'{key}_p50_ms']} ms"
            f" p90 {s[f'{key}_p90_ms']} ms, served by {s['replicas']}"
        )
    reconnect = figures["reconnect_max_ms"]
    return DemoResult(
        len(results),
        len(aborted),
        lost,
        replayed,
        count_retried(results, seen),
        merged.ttft_ms(50),
        merged.ttft_ms(90),
        int(str(figures["cut"])),
        reconnect if isinstance(reconnect, float) else None,
    )
