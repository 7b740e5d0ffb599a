"""`make demo`: the core promise, shown for real on this machine.

Voice and side traffic flows through the local endpoint while, in turn, a voice replica's
process dies mid-stream, comes back, and a node's GPU reports XID 79 (fallen off the bus). The
summary counts requests lost although a healthy replica existed, and streams replayed on
another replica (checked against every replica's own request log): both must be 0.
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from denv_agent.control import inject_fault

from denv_iac.local.runner import LocalCluster, RunState
from denv_iac.ops.loadgen import LoadReport, StreamResult, run_load

Say = Callable[[str], None]


@dataclass(frozen=True)
class DemoResult:
    requests: int
    aborted: int
    lost: int
    replayed: int
    retried: int  # resent before their first byte: safe, shown so that it is seen
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None

    @property
    def line(self) -> str:
        return (
            f"requests={self.requests} aborted_streams={self.aborted} "
            f"ttft_p50_ms={self.ttft_p50_ms} ttft_p90_ms={self.ttft_p90_ms} "
            f"lost_requests={self.lost} replayed_streams={self.replayed} "
            f"retried_before_first_byte={self.retried}"
        )

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.replayed == 0 and self.requests > 0


def inject_xid(state: RunState, node: str, gpu: int, xid: int) -> None:
    inject_fault(state.agent_of(node).url, state.control_token, gpu=gpu, xid=xid)


def kill_replica(state: RunState, replica_id: str) -> None:
    replica = next(r for r in state.replicas if r.id == replica_id)
    httpx.post(f"{replica.url}/control/fault", json={"mode": "exit"}, timeout=5)


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


async def _faults(cluster: LocalCluster, state: RunState, say: Say) -> None:
    voice = [r for r in state.replicas if r.pool == "voice"]
    first, second = voice[0], voice[-1]
    await asyncio.sleep(2.0)
    say(f"t=2s  replica {first.id} dies (process exit) with streams in flight")
    await asyncio.to_thread(kill_replica, state, first.id)
    await asyncio.sleep(2.0)
    say(f"t=4s  replica {first.id} restarted; it rejoins once its health checks pass")
    await asyncio.to_thread(cluster.restart_replica, first.id)
    await asyncio.sleep(3.0)
    say(f"t=7s  node {second.site}/{second.node} GPU {second.gpu} reports XID 79")
    await asyncio.to_thread(inject_xid, state, f"{second.site}/{second.node}", second.gpu, 79)


async def _traffic(
    cluster: LocalCluster, state: RunState, say: Say, duration_s: float
) -> list[LoadReport]:
    pools = [r.name for r in cluster.stack.recipes]
    loads = [
        run_load(state.endpoint, pool, concurrency=8, duration_s=duration_s, session_turns=4)
        for pool in pools
    ]
    faults = asyncio.create_task(_faults(cluster, state, say))
    reports = await asyncio.gather(*loads)
    await faults
    return reports


def run_demo(cluster: LocalCluster, say: Say, duration_s: float = 10.0) -> DemoResult:
    state = cluster.state
    assert state is not None
    reports = asyncio.run(_traffic(cluster, state, say, duration_s))
    results = [r for report in reports for r in report.results]
    aborted = {r.request_id for r in results if r.error == "aborted"}
    lost = sum(1 for r in results if r.error and r.error != "aborted")
    seen = seen_by_replicas(state)
    replayed = count_replayed(results, seen)
    merged = LoadReport(results, max(report.wall_s for report in reports))
    for report, recipe in zip(reports, cluster.stack.recipes, strict=True):
        s = report.summary()
        say(
            f"pool {recipe.name}: {s['requests']} requests, errors {s['errors'] or 'none'}, "
            f"TTFT p50 {s['ttft_p50_ms']} ms p90 {s['ttft_p90_ms']} ms, served by {s['replicas']}"
        )
    return DemoResult(
        len(results),
        len(aborted),
        lost,
        replayed,
        count_retried(results, seen),
        merged.ttft_ms(50),
        merged.ttft_ms(90),
    )
