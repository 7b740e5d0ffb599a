"""The data plane through a real HAProxy running the generated config, against simulated replicas.

Figures (targets from the design's numbers):
- ttft_overhead_ratio, ttft_added_p50_ms, ttft_added_p99_ms: time to first streamed token
  through the balancer against the same replicas called directly, requests interleaved so
  that drift and noise hit both alike, each on a new connection (<= 1.05, <= 1 ms at p50).
  The tail beside nginx, one at a time and in bursts of new connections: tail_bench.py.
- streams_per_s: complete streams per second through the balancer at a fixed concurrency.
- streams_per_s_ratio: the same through the balancer against the same home replicas called
  directly by the same client, run after it: what the balancer costs in throughput, with the
  client's and the replicas' own costs (and the machine's load) on both sides.
- xid_to_out_ms: the agent starts answering `down #xid 79`; how long HAProxy still routes new
  requests to that replica (<= 500 ms). Worst of the trials.
- first_after_death_errors, first_after_death_added_ms: a replica process is killed, and the
  next request of its session goes out at once: errors, and time to first token added over
  the steady state (0; at most the tier's connect timeout, 8 ms for these local sites, plus
  the retry's own connect and the machine's scheduling). Worst of the trials, and
  first_after_death_added_p50_ms, their median.
- abort_surfaced_ms: a replica is killed mid-stream; how long until the client sees the stream
  broken off (<= 1000 ms). Worst of the trials.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lab.dataplane import AGENT_UP, STANDARD_POOLS, Dataplane
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.ops.loadgen_protocols import stream_once
from denv_iac.ops.loadgen_report import StreamResult
from denv_iac.ops.loadgen_transport import CONNECT_TIMEOUT_S, Connection, Endpoint

HOME = ("voice.home-a.n0.0", "voice.home-b.n1.0")
TTFT_PAIRS = 150
THROUGHPUT_CONCURRENCY = 128
# What the balancer costs is measured, not an engine's capacity: every stream gets a slot at once
# and the pace of a sequence decoding alone.
REPLICA = ReplicaSimConfig(
    "template", ttft_ms=50, itl_ms=10, tokens=20, slots=THROUGHPUT_CONCURRENCY, itl_growth=0.0
)
THROUGHPUT_SECONDS = 5.0
# These figures are the balancer's own cost, not a pool's capacity: each replica admits every
# stream of the throughput run, so none waits in the balancer's queue or spills to the next tier.
POOLS = tuple(
    dataclasses.replace(layout, max_concurrency=THROUGHPUT_CONCURRENCY) for layout in STANDARD_POOLS
)
XID_TRIALS = 3
DEATH_TRIALS = 9
ABORT_TRIALS = 3
# A read that waits longer fails the request as a timeout (none should come near it here).
TIMEOUT_S = 30.0


def _connection(port: int) -> Connection:
    """The load generator's client: one keep-alive connection, the same on both paths."""
    return Connection(Endpoint(f"http://127.0.0.1:{port}"), TIMEOUT_S, CONNECT_TIMEOUT_S)


async def _stream(
    connection: Connection,
    max_tokens: int,
    session: str | None = None,
    request_id: str | None = None,
) -> StreamResult:
    """One streamed chat completion; its times are perf_counter() readings (t0 = 0)."""
    return await stream_once(
        connection, "voice", session=session, max_tokens=max_tokens, request_id=request_id
    )


def _ttft_s(result: StreamResult) -> float:
    assert result.ttft_ms is not None, "no token arrived"
    return result.ttft_ms / 1000


def _ended_at(result: StreamResult) -> float:
    return result.started_s + result.total_ms / 1000


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def _stream_new_connection(port: int) -> StreamResult:
    """One streamed answer on a connection of its own, closed after: what a caller that does
    not keep connections alive sees, the connect and the endpoint's accept included."""
    connection = _connection(port)
    try:
        return await _stream(connection, 2)
    finally:
        connection.close()


async def measure_ttft(plane: Dataplane) -> tuple[dict[str, float], float]:
    """Interleaved direct/balanced pairs, each request on a new connection (as a caller without
    a connection pool sends it; a kept-alive connection never pays the accept nor the
    endpoint's per-connection work, and hid the tail); also returns the balanced p50 TTFT in
    seconds."""
    via_balancer: list[float] = []
    via_direct: list[float] = []
    for n in range(TTFT_PAIRS):
        direct = plane.replicas[HOME[n % len(HOME)]].process.port
        balanced = plane.settings.port
        first, second = (direct, balanced) if n % 2 else (balanced, direct)
        for port in (first, second):
            result = await _stream_new_connection(port)
            assert result.ok, f"stream failed during the TTFT run: {result}"
            (via_balancer if port == balanced else via_direct).append(_ttft_s(result))
    p50_b, p50_d = statistics.median(via_balancer), statistics.median(via_direct)
    p99_b, p99_d = _percentile(via_balancer, 0.99), _percentile(via_direct, 0.99)
    figures = {
        "ttft_overhead_ratio": p50_b / p50_d,
        "ttft_added_p50_ms": (p50_b - p50_d) * 1000,
        "ttft_added_p99_ms": (p99_b - p99_d) * 1000,
    }
    return figures, p50_b


async def measure_throughput(ports: list[int]) -> float:
    """Complete streams per second from THROUGHPUT_CONCURRENCY workers, spread over `ports`."""
    deadline = time.perf_counter() + THROUGHPUT_SECONDS
    completed = 0

    async def worker(port: int) -> None:
        nonlocal completed
        connection = _connection(port)
        while time.perf_counter() < deadline:
            if (await _stream(connection, 10)).ok:
                completed += 1
        connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(ports[n % len(ports)]) for n in range(THROUGHPUT_CONCURRENCY)))
    return completed / (time.perf_counter() - started)


async def measure_xid_to_out(plane: Dataplane, victim: str) -> float:
    """Traffic spread over both home replicas; the victim's agent turns to down at t0."""
    routed: list[tuple[float, str]] = []
    stop_at = time.perf_counter() + 1.5
    flip_at = time.perf_counter() + 0.3

    async def worker() -> None:
        connection = _connection(plane.settings.port)
        while time.perf_counter() < stop_at:
            result = await _stream(connection, 1)
            routed.append((result.started_s, result.replica))
        connection.close()

    async def flip() -> None:
        await asyncio.sleep(flip_at - time.perf_counter())
        plane.agent.set_reply(victim, "down #xid 79 gpu fell off the bus")

    await asyncio.gather(flip(), *(worker() for _ in range(8)))
    last = max((sent for sent, replica in routed if replica == victim), default=flip_at)
    assert any(replica == victim for sent, replica in routed if sent < flip_at), "no baseline"
    return max(last - flip_at, 0.0)


async def measure_first_after_death(plane: Dataplane, session: str) -> StreamResult:
    connection = _connection(plane.settings.port)
    warm = await _stream(connection, 1, session)
    assert warm.ok and warm.replica
    plane.replicas[warm.replica].kill()
    result = await _stream(connection, 2, session)
    connection.close()
    plane.replicas[warm.replica].restart()
    return result


async def measure_abort(plane: Dataplane, session: str) -> float:
    """Kill the replica while it streams; seconds until the client sees the stream broken."""
    connection = _connection(plane.settings.port)
    victim = (await _stream(connection, 1, session)).replica
    assert victim
    request_id = f"abort-{session}"
    killed_at = 0.0

    async def kill_after_tokens() -> None:
        nonlocal killed_at
        # On a busy machine the request may reach its replica late: wait for it there (the
        # replica's count holds other trials' requests too), then a few tokens.
        deadline = time.perf_counter() + 5
        while plane.replicas[victim].stats()["by_request_id"].get(request_id) != 1:
            assert time.perf_counter() < deadline, f"{request_id} never reached {victim}"
            await asyncio.sleep(0.005)
        await asyncio.sleep((REPLICA.ttft_ms + 3 * REPLICA.itl_ms) / 1000)
        plane.replicas[victim].kill()
        killed_at = time.perf_counter()

    stream = _stream(connection, 200, session, request_id)
    result, _ = await asyncio.gather(stream, kill_after_tokens())
    connection.close()
    assert not result.ok, "the stream finished although its replica died"
    others = [replica for rid, replica in plane.replicas.items() if rid != victim]
    assert all(request_id not in r.stats()["by_request_id"] for r in others), "replayed"
    plane.replicas[victim].restart()
    return _ended_at(result) - killed_at


def _wait_all_up(plane: Dataplane) -> None:
    plane.wait_until(plane.all_up, timeout_s=10, what="every server up again")


def on_dataplane(
    name: str,
    sim: ReplicaSimConfig,
    measure: Callable[[Dataplane], Coroutine[Any, Any, dict[str, float]]],
) -> dict[str, float]:
    """`measure` run on a local data plane of its own, removed after."""
    with tempfile.TemporaryDirectory(prefix=f"denv-{name}-bench-") as workdir:
        plane = Dataplane.start(Path(workdir), pools=POOLS, sim=sim)
        try:
            return asyncio.run(measure(plane))
        finally:
            plane.close()


def run() -> dict[str, float]:
    return on_dataplane("dataplane", REPLICA, _measure)


async def _measure(plane: Dataplane) -> dict[str, float]:
    figures, balanced_p50_s = await measure_ttft(plane)
    figures["streams_per_s"] = await measure_throughput([plane.settings.port])
    direct = await measure_throughput([plane.replicas[rid].process.port for rid in HOME])
    figures["streams_per_s_ratio"] = figures["streams_per_s"] / direct

    xid_s = []
    for trial in range(XID_TRIALS):
        victim = HOME[trial % len(HOME)]
        xid_s.append(await measure_xid_to_out(plane, victim))
        plane.agent.set_reply(victim, AGENT_UP)
        _wait_all_up(plane)
    figures["xid_to_out_ms"] = max(xid_s) * 1000

    after_death = []
    for trial in range(DEATH_TRIALS):
        after_death.append(await measure_first_after_death(plane, f"death-{trial}"))
        _wait_all_up(plane)
    figures["first_after_death_errors"] = float(sum(not r.ok for r in after_death))
    served = [_ttft_s(r) for r in after_death if r.ok]
    figures["first_after_death_added_ms"] = (
        (max(served) - balanced_p50_s) * 1000 if served else float("nan")
    )
    figures["first_after_death_added_p50_ms"] = (
        (statistics.median(served) - balanced_p50_s) * 1000 if served else float("nan")
    )

    aborts = []
    for trial in range(ABORT_TRIALS):
        aborts.append(await measure_abort(plane, f"abort-{trial}"))
        _wait_all_up(plane)
    figures["abort_surfaced_ms"] = max(aborts) * 1000
    return {key: round(value, 3) for key, value in figures.items()}


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:28} {value}")
