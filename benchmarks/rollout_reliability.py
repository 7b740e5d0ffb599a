"""A recipe change rolled under load with realtime sessions open, counted (part of `make
reliability`).

A fresh local stack (a voice pool of 3 replicas on 3 nodes, `min_warm: 2`, `spare: 1`) takes
closed-loop chat streams and realtime conversations (each a session of a few turns, then a new
one: a voice call far shorter than `drain_timeout_s`) through the endpoint, plus one long call:
a realtime session held open past the drain bound. Then its recipe changes (a new simulated
version) and `denv local roll`'s executor rolls it, one replica at a time: drain, wait for the
sessions (up to `drain_timeout_s`), restart, warm, back. Counted: requests and turns, lost (an
error before a byte: the client got nothing), cut (a stream or a session ended mid-answer),
the long calls cut past the drain bound (which the roll must count and name: its replica), the
pool's ready replicas (UP, not draining, in HAProxy) every 50 ms, the time to finish the roll,
and what a second roll of the same stack applies (nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.goodput import CUT
from benchmarks.lab.sampling import sampling
from benchmarks.reliability import fresh_stack
from denv_iac.core.balancer.tiers import TWIN_SUFFIXES
from denv_iac.core.stack.reader import read_stack
from denv_iac.haproxy.runtime import stats_command
from denv_iac.local.rollout import RollReport, ready_servers, roll, server_rows
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_protocols import RealtimeSession
from denv_iac.ops.loadgen_report import Protocol
from denv_iac.ops.loadgen_transport import CONNECT_TIMEOUT_S, Connection, Endpoint

RESULTS = Path(__file__).parent / "results" / "rollout_reliability.json"
POOL = "voice"
MIN_WARM = 2
DRAIN_TIMEOUT_S = 3
PACE = {"ttft_ms": 30, "itl_ms": 5, "tokens": 12, "slots": 64, "itl_growth": 0}
STACK: dict[str, Any] = {
    "denv:sites": [
        {
            "name": "local",
            "kind": "local",
            "nodes": [{"name": f"node-{n}", "gpu": "H100", "gpus": 1} for n in "abc"],
        }
    ],
    "denv:recipes": [
        {
            "name": POOL,
            "min_warm": MIN_WARM,
            "spare": 1,
            "sites": ["local"],
            "drain_timeout_s": DRAIN_TIMEOUT_S,
            "cold_start_budget_s": 10,
            "simulate": PACE,
        }
    ],
    "denv:balancer": {"sites": ["local"]},
}
SETTLE_S = 1.0  # load before the roll starts, and after it ends
READY_WITHIN_S = 15.0  # for the fresh stack to be at full strength
SAMPLE_EVERY_S = 0.05  # how often the pool's ready replicas are read from HAProxy


def changed_stack() -> dict[str, Any]:
    """The same stack with a new version of the pool's server."""
    config = copy.deepcopy(STACK)
    config["denv:recipes"][0]["simulate"] = {**PACE, "tokens": PACE["tokens"] - 1}
    return config


@dataclass(frozen=True)
class Load:
    # Moderate on purpose: the roll is measured, not capacity (on a shared 2-core machine, 16
    # workers left the replicas' own health checks timing out, and HAProxy took them down).
    chat_workers: int = 4
    realtime_workers: int = 4
    session_turns: int = 4  # turns per realtime conversation
    long_calls: int = 1  # realtime sessions held open past the drain bound


@dataclass
class Outcome:
    requests: int = 0  # chat streams and realtime turns through the endpoint
    realtime_turns: int = 0
    lost: int = 0
    cut: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    cut_by_replica: dict[str, int] = field(default_factory=dict)  # where the cuts were
    long_calls: list[dict[str, str]] = field(default_factory=list)  # replica, outcome
    cut_past_drain: dict[str, int] = field(default_factory=dict)  # the roll's count, by replica
    min_ready: int = 0
    samples: int = 0
    # The first samples under min_warm: each server not ready, as HAProxy saw it and why.
    under_min_warm: list[str] = field(default_factory=list)
    roll_s: float = 0.0
    # Each replica's drain (until no session was left, or the bound), restart and warm.
    per_replica_s: dict[str, dict[str, float]] = field(default_factory=dict)
    roll_line: str = ""
    second_roll_steps: int = -1

    def problems(self) -> list[str]:
        """The contract broken, one line each; none when the roll kept it."""
        cut_long = [c for c in self.long_calls if c["outcome"] in CUT]
        named = {c["replica"] for c in cut_long}
        return [
            line
            for line, broken in (
                (f"{self.lost} request(s) lost", self.lost),
                (f"{self.cut} stream(s) or session(s) cut within the drain bound", self.cut),
                (f"ready replicas fell to {self.min_ready}", self.min_ready < MIN_WARM),
                (f"a second roll restarted {self.second_roll_steps}", self.second_roll_steps),
                (
                    f"long calls cut on {sorted(named)}, the roll named {self.cut_past_drain}",
                    not named <= set(self.cut_past_drain)
                    or len(cut_long) > sum(self.cut_past_drain.values()),
                ),
                ("no sample of the pool", not self.samples),
            )
            if broken
        ]


def _sample(state: RunState, since: float) -> tuple[int, str]:
    """The pool's ready replicas, and those not ready with HAProxy's reasons."""
    rows = server_rows(stats_command(Path(state.admin_socket), "show stat"))
    ready = ready_servers(rows)
    others = sorted(
        f"{r['svname']} {r['status']} (check {r['check_status']}, agent {r['agent_status']})"
        for r in rows
        if not r["pxname"].endswith(TWIN_SUFFIXES) and r["svname"] not in ready
    )
    return len(ready), f"+{time.monotonic() - since:.2f} s: {'; '.join(others)}"


async def _long_call(endpoint: str) -> dict[str, str]:
    """A realtime session: one turn, then held open until its replica ends it (or 120 s)."""
    session = RealtimeSession(Connection(Endpoint(endpoint), 120.0, CONNECT_TIMEOUT_S), POOL, None)
    first = await session.turn(None, time.perf_counter(), "endpoint")
    if first.error:
        return {"replica": first.replica, "outcome": f"first turn {first.error}"}
    return {"replica": session.replica, "outcome": await session.until_closed()}


def _progress(since: float) -> Callable[[str], None]:
    def say(line: str) -> None:
        print(f"  +{time.monotonic() - since:.2f} s {line}", file=sys.stderr, flush=True)

    return say


async def _measure(cluster: LocalCluster, load: Load) -> Outcome:
    state = cluster.state
    assert state is not None
    outcome = Outcome()
    since = time.monotonic()
    runs: tuple[tuple[Protocol, int, int], ...] = (
        ("chat", load.chat_workers, 0),
        ("realtime", load.realtime_workers, load.session_turns),
    )
    with sampling(lambda: _sample(state, since), SAMPLE_EVERY_S) as samples:
        stop = asyncio.Event()
        loads = [
            asyncio.create_task(
                run_load(
                    state.endpoint,
                    POOL,
                    protocol=protocol,
                    concurrency=workers,
                    duration_s=600,
                    session_turns=turns,
                    timeout_s=30,
                    stop=stop,
                )
            )
            for protocol, workers, turns in runs
            if workers
        ]
        calls = [asyncio.create_task(_long_call(state.endpoint)) for _ in range(load.long_calls)]
        await asyncio.sleep(SETTLE_S)
        changed = read_stack("reliability", changed_stack())
        try:
            report: RollReport = await asyncio.to_thread(roll, cluster, changed, _progress(since))
            await asyncio.sleep(SETTLE_S)
        finally:
            stop.set()
            reports = await asyncio.gather(*loads)
            outcome.long_calls = list(await asyncio.gather(*calls))
    outcome.under_min_warm = [why for ready, why in samples if ready < MIN_WARM][:5]
    for done in reports:
        mine = [r for r in done.results if r.via == "endpoint"]
        outcome.requests += len(mine)
        if done.protocol == "realtime":
            outcome.realtime_turns += len(mine)
        for result in mine:
            if result.error:
                key = f"{done.protocol}:{result.error}"
                outcome.errors[key] = outcome.errors.get(key, 0) + 1
                if result.error in CUT:
                    outcome.cut += 1
                    by = outcome.cut_by_replica
                    by[result.replica] = by.get(result.replica, 0) + 1
                else:
                    outcome.lost += 1
    outcome.cut_past_drain = report.cut_on()
    outcome.min_ready = min((ready for ready, _ in samples), default=0)
    outcome.samples = len(samples)
    outcome.roll_s = round(report.seconds, 2)
    outcome.per_replica_s = {
        s.replica: {
            "drain": round(s.drain_s, 2),
            "restart": round(s.restart_s, 2),
            "warm": round(s.warm_s, 2),
        }
        for s in report.steps
    }
    outcome.roll_line = report.line()
    outcome.second_roll_steps = len((await asyncio.to_thread(roll, cluster, changed)).steps)
    return outcome


def run_scenario(load: Load = Load()) -> Outcome:
    with fresh_stack("reliability", STACK, READY_WITHIN_S) as (cluster, _):
        return asyncio.run(_measure(cluster, load))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="Rollouts measured, each afresh.")
    args = parser.parse_args(argv)
    rows = []
    for index in range(args.runs):
        outcome = run_scenario()
        row = {"run": index + 1, **asdict(outcome), "problems": outcome.problems()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any(row["problems"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
