"""The data plane through a real HAProxy running the generated config, against simulated replicas.

Figures (targets from the design's numbers):
- ttft_overhead_ratio, ttft_added_p50_ms, ttft_added_p99_ms: time to first streamed token
  through the balancer against the same replicas called directly, requests interleaved so
  that drift and noise hit both alike (<= 1.05, <= 1 ms at p50).
- streams_per_s: complete streams per second through the balancer at a fixed concurrency.
- xid_to_out_ms: the agent starts answering `down #xid 79`; how long HAProxy still routes new
  requests to that replica (<= 500 ms). Worst of the trials.
- first_after_death_errors, first_after_death_added_ms: a replica process is killed, and the
  next request of its session goes out at once: errors, and time to first token added over
  the steady state (0, <= 100 ms). Worst of the trials.
- abort_surfaced_ms: a replica is killed mid-stream; how long until the client sees the stream
  broken off (<= 1000 ms). Worst of the trials.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from denv_iac.local.replica_sim import ReplicaSimConfig
from tests.dataplane.dataplane_harness import AGENT_UP, STANDARD_POOLS, Dataplane

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
DEATH_TRIALS = 5
ABORT_TRIALS = 3


@dataclass
class StreamResult:
    status: int
    replica: str | None
    done: bool  # ended with data: [DONE] and the terminal chunk
    first_token_at: float | None  # perf_counter() times
    ended_at: float
    sent_at: float

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done

    @property
    def ttft_s(self) -> float:
        assert self.first_token_at is not None, "no token arrived"
        return self.first_token_at - self.sent_at


class Connection:
    """One keep-alive HTTP/1.1 connection with a minimal SSE reader: a timing client should
    cost as little as possible and the same on both paths."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def stream(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> StreamResult:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self._reader is not None
        payload = json.dumps({"stream": True, **body}).encode()
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        sent_at = time.perf_counter()
        self._writer.write(request)
        try:
            return await self._read_stream(self._reader, sent_at)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            self.close()
            return StreamResult(0, None, False, None, time.perf_counter(), sent_at)

    async def _read_stream(self, reader: asyncio.StreamReader, sent_at: float) -> StreamResult:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        replica = headers.get("x-denv-replica") or headers.get("x-denv-replica-self")
        if "content-length" in headers:  # an error answer, not a stream
            await reader.readexactly(int(headers["content-length"]))
            return StreamResult(status, replica, False, None, time.perf_counter(), sent_at)
        first_token_at = None
        done = False
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            data = await reader.readexactly(size + 2)
            if first_token_at is None and b'"content"' in data:
                first_token_at = time.perf_counter()
            done = done or b"data: [DONE]" in data
        await reader.readexactly(2)
        result = StreamResult(status, replica, done, first_token_at, time.perf_counter(), sent_at)
        if headers.get("connection", "").lower() == "close":
            self.close()
        return result

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def measure_ttft(plane: Dataplane) -> tuple[dict[str, float], float]:
    """Interleaved direct/balanced pairs; also returns the balanced p50 TTFT in seconds."""
    balanced = Connection(plane.settings.port)
    direct = {rid: Connection(plane.replicas[rid].process.port) for rid in HOME}
    body = {"model": "voice", "max_tokens": 2}
    via_balancer: list[float] = []
    via_direct: list[float] = []
    for n in range(TTFT_PAIRS):
        replica = HOME[n % len(HOME)]
        first, second = (direct[replica], balanced) if n % 2 else (balanced, direct[replica])
        for connection in (first, second):
            result = await connection.stream(body)
            assert result.ok, f"stream failed during the TTFT run: {result}"
            (via_balancer if connection is balanced else via_direct).append(result.ttft_s)
    for connection in (balanced, *direct.values()):
        connection.close()
    p50_b, p50_d = statistics.median(via_balancer), statistics.median(via_direct)
    p99_b, p99_d = _percentile(via_balancer, 0.99), _percentile(via_direct, 0.99)
    figures = {
        "ttft_overhead_ratio": p50_b / p50_d,
        "ttft_added_p50_ms": (p50_b - p50_d) * 1000,
        "ttft_added_p99_ms": (p99_b - p99_d) * 1000,
    }
    return figures, p50_b


async def measure_throughput(plane: Dataplane) -> float:
    deadline = time.perf_counter() + THROUGHPUT_SECONDS
    completed = 0

    async def worker() -> None:
        nonlocal completed
        connection = Connection(plane.settings.port)
        while time.perf_counter() < deadline:
            if (await connection.stream({"model": "voice", "max_tokens": 10})).ok:
                completed += 1
        connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(THROUGHPUT_CONCURRENCY)))
    return completed / (time.perf_counter() - started)


async def measure_xid_to_out(plane: Dataplane, victim: str) -> float:
    """Traffic spread over both home replicas; the victim's agent turns to down at t0."""
    routed: list[tuple[float, str | None]] = []
    stop_at = time.perf_counter() + 1.5
    flip_at = time.perf_counter() + 0.3

    async def worker() -> None:
        connection = Connection(plane.settings.port)
        while time.perf_counter() < stop_at:
            result = await connection.stream({"model": "voice", "max_tokens": 1})
            routed.append((result.sent_at, result.replica))
        connection.close()

    async def flip() -> None:
        await asyncio.sleep(flip_at - time.perf_counter())
        plane.agent.set_reply(victim, "down #xid 79 gpu fell off the bus")

    await asyncio.gather(flip(), *(worker() for _ in range(8)))
    last = max((sent for sent, replica in routed if replica == victim), default=flip_at)
    assert any(replica == victim for sent, replica in routed if sent < flip_at), "no baseline"
    return max(last - flip_at, 0.0)


async def measure_first_after_death(plane: Dataplane, session: str) -> StreamResult:
    headers = {"X-Denv-Session": session}
    connection = Connection(plane.settings.port)
    warm = await connection.stream({"model": "voice", "max_tokens": 1}, headers)
    assert warm.ok and warm.replica is not None
    plane.replicas[warm.replica].kill()
    result = await connection.stream({"model": "voice", "max_tokens": 2}, headers)
    connection.close()
    plane.replicas[warm.replica].restart()
    return result


async def measure_abort(plane: Dataplane, session: str) -> float:
    """Kill the replica while it streams; seconds until the client sees the stream broken."""
    connection = Connection(plane.settings.port)
    headers = {"X-Denv-Session": session}
    victim = (await connection.stream({"model": "voice", "max_tokens": 1}, headers)).replica
    assert victim is not None
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

    stream = connection.stream(
        {"model": "voice", "max_tokens": 200}, {**headers, "X-Request-Id": request_id}
    )
    result, _ = await asyncio.gather(stream, kill_after_tokens())
    connection.close()
    assert not result.done, "the stream finished although its replica died"
    others = [replica for rid, replica in plane.replicas.items() if rid != victim]
    assert all(request_id not in r.stats()["by_request_id"] for r in others), "replayed"
    plane.replicas[victim].restart()
    return result.ended_at - killed_at


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
    figures["streams_per_s"] = await measure_throughput(plane)

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
    served = [r.ttft_s for r in after_death if r.ok]
    figures["first_after_death_added_ms"] = (
        (max(served) - balanced_p50_s) * 1000 if served else float("nan")
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
