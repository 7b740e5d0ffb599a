"""Realtime sessions through faults on the local data plane, counted (part of `make reliability`).

Each scenario starts a fresh local stack (reliability.STACK: a voice pool on two nodes), opens
realtime sessions through the endpoint, one turn each, then starts a turn on all of them and
injects the fault once every session of the replica serving the most has heard audio. A session
cut by the fault reconnects at once with its `X-Denv-Session`. Counted (see
denv_iac.ops.voice_failover): sessions cut and how the client saw it, stalled (cut without a
close: the client found out only by its own timeout, 5 s), replayed (by the replicas' logs),
failed reconnects, and from the close the client saw to `session.created` on the new socket.

- replica killed mid-session: the process dies; its sessions see the socket close (1006).
- replica frozen mid-session (SIGSTOP): its sessions are closed once its health checks mark it
  down (on-marked-down shutdown-sessions), about 2 s.
- balancer reload with 50 open sessions: nothing may be cut; the old worker keeps them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.reliability import STACK, at_full_strength
from denv_iac.core.stack.reader import read_stack
from denv_iac.local.processes import free_port
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.demo import seen_by_replicas
from denv_iac.ops.voice_failover import realtime_failover

RESULTS = Path(__file__).parent / "results" / "realtime_reliability.json"
POOL = "voice"
RECOVERY_LIMIT_S = 15.0


@dataclass(frozen=True)
class Scenario:
    name: str
    sessions: int
    # The fault, given the cluster, its state and the replica serving the most sessions; it
    # returns what clears it (or None).
    fault: Callable[[LocalCluster, RunState, str], Callable[[], None] | None]
    ends_sessions: bool = True


def _pid(state: RunState, replica_id: str) -> int:
    return next(r.pid for r in state.replicas if r.id == replica_id)


def killed(cluster: LocalCluster, state: RunState, victim: str) -> Callable[[], None]:
    os.kill(_pid(state, victim), signal.SIGKILL)  # at once: no client to make on the way
    return lambda: cluster.restart_replica(victim)


def frozen(cluster: LocalCluster, state: RunState, victim: str) -> Callable[[], None]:
    pid = _pid(state, victim)
    os.kill(pid, signal.SIGSTOP)
    return lambda: os.kill(pid, signal.SIGCONT)


def reloaded(cluster: LocalCluster, state: RunState, victim: str) -> Callable[[], None] | None:
    settings = cluster.balancer_settings
    cluster.reload_balancer(dataclasses.replace(settings, check_inter_ms=750))
    return None


SCENARIOS = (
    Scenario("realtime: replica killed mid-session", 8, killed),
    Scenario("realtime: replica frozen mid-session", 8, frozen),
    Scenario("realtime: balancer reload with 50 open sessions", 50, reloaded, False),
)


def run_scenario(scenario: Scenario) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="denv-realtime-reliability-") as tmp:
        cluster = LocalCluster(read_stack("reliability", STACK), Path(tmp), free_port())
        cluster.up()
        try:
            return _measure(cluster, scenario)
        finally:
            cluster.down()


def _measure(cluster: LocalCluster, scenario: Scenario) -> dict[str, object]:
    state = cluster.state
    assert state is not None
    time.sleep(0.5)  # first agent verdicts in
    clears: list[Callable[[], None]] = []

    def fault(victim: str) -> None:
        if (clear := scenario.fault(cluster, state, victim)) is not None:
            clears.append(clear)

    report = asyncio.run(
        realtime_failover(
            state.endpoint,
            POOL,
            fault,
            lambda: seen_by_replicas(state),
            sessions=scenario.sessions,
            ends_sessions=scenario.ends_sessions,
        )
    )
    for clear in clears:
        clear()
    deadline = time.monotonic() + RECOVERY_LIMIT_S
    while not at_full_strength(state) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"scenario": scenario.name, **report.figures()}


def run_all(names: tuple[str, ...] | None = None) -> list[dict[str, object]]:
    rows = []
    for scenario in SCENARIOS:
        if names is None or scenario.name in names:
            row = run_scenario(scenario)
            print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)
            rows.append(row)
    return rows


def failed(row: dict[str, object]) -> bool:
    """A session stalled, replayed or not served again: the contract broken."""
    return any(row[key] for key in ("stalled", "replayed", "failed_reconnects"))


def main() -> int:
    rows = run_all()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any(failed(row) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
