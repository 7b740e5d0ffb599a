"""Voice through a real HAProxy running the generated config, against simulated replicas.

Figures (targets from the design's numbers):
- speech_first_audio_added_p50_ms, speech_first_audio_ratio, and the same for realtime: time to
  the first audio byte of streamed speech (`POST /v1/audio/speech`) and of a realtime turn
  (`response.create` to the first `response.output_audio.delta`), through the balancer against the
  same replicas called directly in the same run, each worker alternating the two paths
  (`denv bench --direct`) so that drift and noise hit both alike (<= 1 ms at p50, ratio <= 1.05).
  No p99 figure: on a shared two-core machine one scheduling hiccup among 150 requests moves it
  by a hundred milliseconds either way.
- failover_*: realtime sessions open through the balancer, each mid-turn, when the replica
  serving the most of them is killed; each cut session reconnects at once with its
  `X-Denv-Session`. failover_replayed: cut sessions whose opening request reached another
  replica (0); failover_stalled: sessions cut without any close, found only by the client's
  timeout (0); failover_failed_reconnects (0); failover_reconnect_max_ms: from the close the
  client saw to `session.created` on a healthy replica (<= 100 ms), the worst of every cut
  session of the trials, and failover_reconnect_p50_ms, their median.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dataplane_bench import on_dataplane
from benchmarks.lab.dataplane import Dataplane
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_report import LoadReport, Protocol, percentile
from denv_iac.ops.voice_failover import FailoverReport, realtime_failover

HOME = ("voice.home-a.n0.0", "voice.home-b.n1.0")
# A turn of 3 audio frames: first audio at 50 ms, then one frame every 20 ms, as a real voice
# model paces them.
REPLICA = ReplicaSimConfig("template", ttft_ms=50, itl_ms=20, tokens=3)
CONCURRENCY = 2
PAIRS = 150  # per protocol: each one request through the balancer and one direct
FAILOVER_TRIALS = 3
FAILOVER_SESSIONS = 8


async def measure_added(plane: Dataplane, protocol: Protocol) -> LoadReport:
    direct = tuple(plane.replicas[replica].url for replica in HOME)
    return await run_load(
        plane.url,
        "voice",
        protocol=protocol,
        concurrency=CONCURRENCY,
        requests=PAIRS,
        direct_urls=direct,
    )


def _seen(plane: Dataplane) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for replica_id, replica in plane.replicas.items():
        try:
            receipts = replica.stats()["by_request_id"]
        except httpx.HTTPError:  # the killed one: its log went with it
            continue
        for request_id, count in receipts.items():
            seen.setdefault(request_id, []).extend([replica_id] * int(count))
    return seen


async def measure_failover(plane: Dataplane) -> FailoverReport:
    return await realtime_failover(
        plane.url,
        "voice",
        lambda replica: plane.replicas[replica].kill(),
        lambda: _seen(plane),
        sessions=FAILOVER_SESSIONS,
    )


def run() -> dict[str, float]:
    return on_dataplane("voice", REPLICA, _measure)


async def _measure(plane: Dataplane) -> dict[str, float]:
    figures: dict[str, float] = {}
    for protocol in ("speech", "realtime"):
        report = await measure_added(plane, protocol)
        summary = report.summary()
        if summary["ok"] != PAIRS or report.errors("direct"):
            raise RuntimeError(f"{protocol}: requests failed: {summary}")
        added, ratio = report.added_ms(50), report.ratio(50)
        assert added is not None and ratio is not None
        figures[f"{protocol}_first_audio_p50_ms"] = report.ttft_ms(50) or 0.0
        figures[f"{protocol}_first_audio_added_p50_ms"] = added
        figures[f"{protocol}_first_audio_ratio"] = ratio

    trials = []
    reconnects: list[float] = []
    for _ in range(FAILOVER_TRIALS):
        failover = await measure_failover(plane)
        plane.replicas[failover.victim].restart()
        plane.wait_until(plane.all_up, timeout_s=10, what="every server up again")
        trials.append(failover.figures())
        reconnects += [o.reconnect_ms for o in failover.outcomes if o.reconnect_ms is not None]
    figures["failover_reconnect_p50_ms"] = percentile(reconnects, 50) or float("nan")
    figures["failover_sessions_cut"] = float(sum(int(str(t["cut"])) for t in trials))
    for key in ("replayed", "stalled", "failed_reconnects"):
        figures[f"failover_{key}"] = float(sum(int(str(t[key])) for t in trials))
    for key in ("close_after_kill_max_ms", "reconnect_max_ms"):
        values = [float(str(t[key])) for t in trials if t[key] is not None]
        figures[f"failover_{key}"] = max(values, default=float("nan"))
    return {key: round(value, 3) for key, value in figures.items()}


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:40} {value}")
