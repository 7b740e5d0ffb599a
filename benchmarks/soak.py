"""`make soak`: the local stack under steady load with periodic faults; memory must stay flat.

Every `fault_every_s` a fault cycle runs (a replica dies and is restarted; a GPU reports XID 79
and the fault is cleared as a repair would). The agents' and HAProxy's resident memory is
sampled along the way; the report compares the last quarter's mean with the second quarter's
(after warm-up), as a ratio, so a leak shows as growth and noise does not.
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from denv_agent.control import clear_faults, inject_fault

from benchmarks.reliability import STACK
from denv_iac.core.stack.reader import read_stack
from denv_iac.local.processes import free_port
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.demo import kill_replica
from denv_iac.ops.loadgen import run_load

RESULTS = Path(__file__).parent / "results" / "soak.json"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def haproxy_pids(master: int) -> list[int]:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return [master, *map(int, children)]


def sample(state: RunState) -> dict[str, float]:
    return {
        "agents_mb": sum(rss_mb(a.pid) for a in state.agents),
        "haproxy_mb": sum(rss_mb(p) for p in haproxy_pids(state.haproxy_pid)),
    }


async def _faults(
    cluster: LocalCluster,
    state: RunState,
    duration_s: float,
    every_s: float,
    samples: list[dict[str, float]],
) -> int:
    cycles = 0
    agent = f"http://127.0.0.1:{state.agent_of('local/node-b').http_port}"
    deadline = time.monotonic() + duration_s
    while time.monotonic() + every_s < deadline:
        await asyncio.sleep(every_s / 2)
        samples.append(sample(state))
        await asyncio.to_thread(kill_replica, state, "voice.local.node-a.0")
        await asyncio.sleep(1.0)
        await asyncio.to_thread(cluster.restart_replica, "voice.local.node-a.0")
        await asyncio.sleep(every_s / 2 - 1.0)
        await asyncio.to_thread(inject_fault, agent, state.control_token, gpu=0, xid=79)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(clear_faults, agent, state.control_token)
        cycles += 1
    return cycles


async def _soak(
    cluster: LocalCluster, state: RunState, duration_s: float, every_s: float
) -> tuple[int, int, int, list[dict[str, float]]]:
    samples: list[dict[str, float]] = []
    load = run_load(
        state.endpoint,
        "voice",
        concurrency=16,
        duration_s=duration_s,
        session_turns=4,
        timeout_s=10,
    )
    report, cycles = await asyncio.gather(
        load, _faults(cluster, state, duration_s, every_s, samples)
    )
    lost = sum(1 for r in report.results if r.error and r.error != "aborted")
    return len(report.results), lost, cycles, samples


def growth(samples: list[dict[str, float]], key: str) -> float:
    quarter = max(1, len(samples) // 4)
    early = statistics.fmean(s[key] for s in samples[quarter : 2 * quarter])
    late = statistics.fmean(s[key] for s in samples[-quarter:])
    return round(late / early, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Soak the local stack with periodic faults.")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds")
    parser.add_argument("--fault-every", type=float, default=20.0, help="seconds per cycle")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="denv-soak-") as tmp:
        cluster = LocalCluster(read_stack("soak", STACK), Path(tmp), free_port())
        state = cluster.up()
        try:
            requests, lost, cycles, samples = asyncio.run(
                _soak(cluster, state, args.duration, args.fault_every)
            )
        finally:
            cluster.down()
    figures = {
        "duration_s": args.duration,
        "requests": requests,
        "lost": lost,
        "fault_cycles": cycles,
        "samples": len(samples),
        "agents_mb_first": round(samples[0]["agents_mb"], 1) if samples else None,
        "agents_mb_last": round(samples[-1]["agents_mb"], 1) if samples else None,
        "haproxy_mb_first": round(samples[0]["haproxy_mb"], 1) if samples else None,
        "haproxy_mb_last": round(samples[-1]["haproxy_mb"], 1) if samples else None,
        "agents_mb_growth_ratio": growth(samples, "agents_mb") if len(samples) >= 4 else None,
        "haproxy_mb_growth_ratio": growth(samples, "haproxy_mb") if len(samples) >= 4 else None,
    }
    print(json.dumps(figures, indent=2))
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
    flat = all(
        (figures[k] or 1.0) <= 1.10 for k in ("agents_mb_growth_ratio", "haproxy_mb_growth_ratio")
    )
    return 0 if lost == 0 and flat else 1


if __name__ == "__main__":
    sys.exit(main())
