"""`make reliability`, overload and a zombie engine: replicas of known capacity, counted.

Each scenario starts a fresh local stack whose simulated replicas have a capacity of their own
(`slots` sequences decoding at once, each slower as the batch grows, a FIFO queue behind them,
headers sent at admission as a real engine does) and a recipe whose `max_concurrency` equals the
slots, then puts open-loop Poisson arrivals of streamed chat on it (half of them turns of
four-turn conversations on `X-Denv-Session`, half requests of their own) at a multiple of the
pool's capacity:

- capacity = replicas x slots / the time one request holds its slot with every slot busy
  (prefill, then `tokens` tokens at `itl_ms x (1 + itl_growth x (slots - 1))`);
- per level, counted by benchmarks/goodput.py as `make bench` counts: requests, completed,
  completed with the first token within the first-token budget, cut mid-stream (an answer that
  began and broke off: must be 0 on healthy replicas), shed (503/429) and the longest any shed
  request waited for that answer (must be within the budget plus 100 ms), and goodput:
  completed-within-budget per second of the run as a share of capacity;
- `fallback 0.9x`: a second site of equal size as the pool's next tier, 0.9x of the home tier's
  capacity (at least 99 % must complete with the first token within budget);
- `zombie`: one of two replicas keeps answering /health and sending headers but makes no token,
  under load, with the stack's defaults (no ttft_budget_ms, no probe settings): the time from
  its first stalled request until HAProxy has it out of rotation (goal 2 s), the turns cut (at
  most those in flight on it, which maxconn bounds), and the time until the pool is back at full
  strength after the fault clears.

Traffic stays on 127.0.0.1. Writes benchmarks/results/overload_reliability.json.
"""

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.goodput import tally
from benchmarks.lab.sampling import sampling
from benchmarks.reliability import (
    fresh_stack,
    stats_of,
    wait_full_strength,
    wait_full_strength_within,
)
from denv_iac.core.stack.model import FIRST_TOKEN_TIMEOUT_MS
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.demo import replica_fault, seen_by_replicas
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_report import LoadReport

RESULTS = Path(__file__).parent / "results" / "overload_reliability.json"
LEVELS = (0.5, 0.9, 1.3, 2.0)
FALLBACK_LEVEL = 0.9
# With one of two replicas out, the other is at 0.8 of its own capacity.
ZOMBIE_LEVEL = 0.4
SESSION_SHARE = 0.5
SESSION_TURNS = 4
# A refusal must come within the first-token budget plus this: HAProxy's timer wheel and two
# shared cores.
SHED_SLACK_MS = 100
ZOMBIE_OUT_MS = 2000
READY_LIMIT_S = 20.0  # for the stack to be at full strength before a level
ROTATION_EVERY_S = 0.02  # how often HAProxy's view of the replicas is read during a level
# One GPU's engine in miniature: four sequences at once, each token 10 % slower per extra one.
ENGINE = {"ttft_ms": 40, "itl_ms": 20, "tokens": 16, "slots": 4, "itl_growth": 0.1}


def capacity_per_s(replicas: int, engine: dict[str, Any] = ENGINE) -> float:
    """Requests/s the replicas finish with every slot busy."""
    slots: int = engine["slots"]
    itl_ms: float = engine["itl_ms"] * (1 + engine["itl_growth"] * (slots - 1))
    held_s: float = (engine["ttft_ms"] + engine["tokens"] * itl_ms) / 1000
    return replicas * slots / held_s


def _node(name: str) -> dict[str, Any]:
    return {"name": name, "gpu": "H100", "gpus": 1}


def overload_stack(fallback: bool) -> dict[str, Any]:
    """Two replicas at the home site; with `fallback`, two more at a second site, the next
    tier. Stack defaults otherwise: budgets, probe settings, session affinity."""
    sites = ["home", "away"] if fallback else ["home"]
    return {
        "denv:sites": [
            {"name": site, "kind": "local", "nodes": [_node("node-a"), _node("node-b")]}
            for site in sites
        ],
        "denv:recipes": [
            {
                "name": "voice",
                "min_warm": 2 * len(sites) - 1,
                "spare": 1,
                "sites": sites,
                "max_concurrency": ENGINE["slots"],
                "simulate": ENGINE,
            }
        ],
        "denv:balancer": {"sites": ["home"]},
    }


@dataclass(frozen=True)
class Level:
    scenario: str
    load: float  # the arrival rate as a multiple of the home tier's capacity
    rate_per_s: float
    capacity_per_s: float
    duration_s: float
    requests: int
    completed: int
    within_budget: int  # completed with the first token within the first-token budget
    cut: int  # answers that began and broke off mid-stream
    shed: int  # answered 503 or 429 (benchmarks/goodput.py: rejected)
    worst_shed_ms: float | None  # the longest wait for a 503/429, from the request
    other_errors: dict[str, int]
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    # Within-budget completions per second of the run (its arrivals, then the last answers),
    # as a share of capacity.
    goodput: float
    within_budget_share: float  # within_budget / requests
    served_by_fallback: int = 0
    # Replicas HAProxy took out of rotation during the level: a full replica is never down.
    left_rotation: tuple[str, ...] = ()
    # Why, as HAProxy saw it when they were out: "replica: status (last check; agent's reply)".
    why_out: tuple[str, ...] = ()


def count(
    scenario: str, load: float, capacity: float, duration_s: float, report: LoadReport
) -> Level:
    """One level's figures: goodput over the whole run (its arrivals, then the last answers)."""
    counted = tally(report.results, FIRST_TOKEN_TIMEOUT_MS)
    return Level(
        scenario,
        load,
        round(load * capacity, 2),
        round(capacity, 2),
        duration_s,
        counted.sent,
        counted.completed,
        counted.within_budget,
        len(counted.cut),
        len(counted.rejected),
        counted.worst_rejected_ms,
        counted.other_errors,
        counted.ttft_ms(50),
        counted.ttft_ms(90),
        counted.goodput(report.wall_s, capacity),
        round(counted.within_budget / counted.sent, 4) if counted.sent else 0.0,
        sum(1 for r in report.results if r.ok and ".away." in r.replica),
    )


def level_problems(level: Level) -> list[str]:
    """What the issue's goals say of one level, one line each."""
    problems = []
    if level.cut:
        problems.append(f"{level.scenario}: {level.cut} streams cut on healthy replicas")
    budget = FIRST_TOKEN_TIMEOUT_MS + SHED_SLACK_MS
    if level.worst_shed_ms is not None and level.worst_shed_ms > budget:
        problems.append(f"{level.scenario}: a 503 took {level.worst_shed_ms} ms (> {budget})")
    if level.other_errors:
        problems.append(f"{level.scenario}: unserved without a 503/429: {level.other_errors}")
    if level.left_rotation:
        problems.append(f"{level.scenario}: full replicas marked down: {level.why_out}")
    if level.scenario.startswith("fallback") and level.within_budget_share < 0.99:
        problems.append(f"{level.scenario}: {level.within_budget_share:.1%} within budget (< 99%)")
    if level.load >= 2.0 and not level.scenario.startswith("fallback") and level.goodput < 0.9:
        problems.append(f"{level.scenario}: goodput {level.goodput} (< 0.9 of capacity)")
    return problems


async def _load(state: RunState, rate: float, duration_s: float, seed: int) -> LoadReport:
    return await run_load(
        state.endpoint,
        "voice",
        rate=rate,
        duration_s=duration_s,
        session_share=SESSION_SHARE,
        session_turns=SESSION_TURNS,
        seed=seed,
        timeout_s=10,
    )


def _out_of_rotation(state: RunState) -> dict[str, str]:
    """The replicas HAProxy has out of rotation (not UP) now, each with why: its status, its
    last health check and the agent's last reply."""
    return {
        replica: f"{row.get('status')} (check: {row.get('last_chk')}; agent: {row.get('last_agt')})"
        for replica, row in stats_of(state).items()
        if not row.get("status", "").startswith("UP")
    }


def run_levels(
    levels: tuple[float, ...],
    duration_s: float,
    fallback: bool = False,
    seed: int = 1,
    stack: dict[str, Any] | None = None,
    cluster_type: type[LocalCluster] = LocalCluster,
) -> list[Level]:
    """Each level on the same stack (`overload_stack` unless given), one after the other (a
    second between them)."""
    capacity = capacity_per_s(2)
    name = "fallback" if fallback else "one tier"
    out = []
    config = stack or overload_stack(fallback)
    with fresh_stack("overload", config, READY_LIMIT_S, cluster_type) as (_, state):
        for load in levels:
            wait_full_strength_within(state, READY_LIMIT_S)
            with sampling(lambda: _out_of_rotation(state), ROTATION_EVERY_S) as samples:
                report = asyncio.run(_load(state, load * capacity, duration_s, seed))
            level = count(f"{name} {load}x", load, capacity, duration_s, report)
            left = sorted({replica for sample in samples for replica in sample})
            why = sorted({f"{r}: {reason}" for sample in samples for r, reason in sample.items()})
            out.append(replace(level, left_rotation=tuple(left), why_out=tuple(why)))
            time.sleep(1.0)
    return out


@dataclass(frozen=True)
class Zombie:
    scenario: str
    load: float
    requests: int
    completed: int
    cut: int
    # Of those, streams the zombie had (by its own log and the replica header) that were sent
    # before it went out of rotation: the turns in flight on it.
    cut_in_flight: int
    in_flight_when_out: int  # HAProxy's count of requests on it when it went out
    shed: int
    worst_shed_ms: float | None
    other_errors: dict[str, int]
    out_of_rotation_ms: float | None  # from its first stalled request
    recovered_ms: float | None  # from the fault's clearing until full strength


def _poll(check: Callable[[], bool], limit_s: float) -> float | None:
    since = time.perf_counter()
    while time.perf_counter() - since < limit_s:
        if check():
            return time.perf_counter() - since
        time.sleep(0.005)
    return None


def run_zombie(
    duration_s: float, seed: int = 2, cluster_type: type[LocalCluster] = LocalCluster
) -> Zombie:
    """A zombie a third of the way in, cleared two thirds in; detection counted from its first
    stalled request: the fault is set while a stream runs on it."""
    capacity = capacity_per_s(2)
    config = overload_stack(False)
    with fresh_stack("overload", config, READY_LIMIT_S, cluster_type) as (cluster, state):
        zombie = state.replicas[0].id
        moments: dict[str, float] = {}
        timings: dict[str, float | None] = {}
        rows: list[dict[str, str]] = []

        def row() -> dict[str, str]:
            return stats_of(state).get(zombie, {})

        def out() -> bool:
            rows.append(row())
            return not rows[-1].get("status", "UP").startswith("UP")

        def fault() -> None:
            time.sleep(duration_s / 3)
            _poll(lambda: int(row().get("scur") or 0) > 0, 5.0)
            replica_fault(state, zombie, "zombie")
            moments["fault"] = time.perf_counter()
            timings["out"] = _poll(out, 10.0)
            time.sleep(max(0.0, duration_s / 3 - (timings["out"] or 0)))
            healing = time.perf_counter()
            replica_fault(state, zombie, "none")
            timings["recovered"] = wait_full_strength(state, healing)

        stop = threading.Event()
        supervisor = threading.Thread(target=cluster.supervise_until, args=(stop, print))
        supervisor.start()
        faulting = threading.Thread(target=fault)
        faulting.start()
        began = time.perf_counter()
        try:
            report = asyncio.run(_load(state, ZOMBIE_LEVEL * capacity, duration_s, seed))
        finally:
            faulting.join()
            stop.set()
            supervisor.join()
        seen = seen_by_replicas(state)
    out_s, recovered_s = timings.get("out"), timings.get("recovered")
    went_out = moments.get("fault", began) + (out_s or duration_s) - began
    counted = tally(report.results, FIRST_TOKEN_TIMEOUT_MS)
    return Zombie(
        "zombie, stack defaults",
        ZOMBIE_LEVEL,
        counted.sent,
        counted.completed,
        len(counted.cut),
        sum(
            1
            for r in counted.cut
            if r.replica == zombie and seen.get(r.request_id) == [zombie] and r.started_s < went_out
        ),
        int(rows[-1].get("scur") or 0) if rows else 0,
        len(counted.rejected),
        counted.worst_rejected_ms,
        counted.other_errors,
        None if out_s is None else round(out_s * 1000, 1),
        None if recovered_s is None else round(recovered_s * 1000, 1),
    )


def zombie_problems(zombie: Zombie) -> list[str]:
    problems = []
    if zombie.out_of_rotation_ms is None or zombie.out_of_rotation_ms > ZOMBIE_OUT_MS:
        problems.append(f"zombie out of rotation after {zombie.out_of_rotation_ms} ms")
    if zombie.cut != zombie.cut_in_flight:
        problems.append(
            f"zombie: {zombie.cut} cut, of which {zombie.cut_in_flight} were in flight on it"
        )
    budget = FIRST_TOKEN_TIMEOUT_MS + SHED_SLACK_MS
    if zombie.worst_shed_ms is not None and zombie.worst_shed_ms > budget:
        problems.append(f"zombie: a 503 took {zombie.worst_shed_ms} ms (> {budget})")
    if zombie.recovered_ms is None:
        problems.append("zombie: the pool was not back at full strength")
    if zombie.other_errors:
        problems.append(f"zombie: other errors {zombie.other_errors}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Overload and zombie scenarios, counted.")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    args = parser.parse_args(argv)
    levels = run_levels(LEVELS, args.duration)
    levels += run_levels((FALLBACK_LEVEL,), args.duration, fallback=True)
    zombie = run_zombie(args.duration)
    for level in levels:
        print(
            f"{level.scenario:16} rate={level.rate_per_s:6}/s requests={level.requests:5} "
            f"completed={level.completed:5} within_budget={level.within_budget:5} "
            f"cut={level.cut} shed={level.shed} worst_shed_ms={level.worst_shed_ms} "
            f"goodput={level.goodput} ttft_p50/p90_ms={level.ttft_p50_ms}/{level.ttft_p90_ms}"
            f" fallback_served={level.served_by_fallback} other={level.other_errors}"
            f" left_rotation={list(level.left_rotation)}"
        )
    print(json.dumps(asdict(zombie)))
    problems = [p for level in levels for p in level_problems(level)] + zombie_problems(zombie)
    RESULTS.parent.mkdir(exist_ok=True)
    figures = {
        "engine": ENGINE,
        "max_concurrency": ENGINE["slots"],
        "first_token_budget_ms": FIRST_TOKEN_TIMEOUT_MS,
        "session_share": SESSION_SHARE,
        "levels": [asdict(level) for level in levels],
        "zombie": asdict(zombie),
        "problems": problems,
    }
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
