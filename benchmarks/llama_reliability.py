"""`make reliability`, real engines: llama.cpp's llama-server behind the endpoint, counted.

stacks/Pulumi.local-llama.yaml (two llama-server processes serving SmolLM2-135M on the CPU, two
slots each, `max_concurrency: 2`) under the local runner's supervisor. Rows:

- overload: 8 closed-loop clients (twice the four slots) for 60 s through the endpoint, then the
  same 8 clients straight at the two engines (four each) for 60 s in the same run: answers by
  status, streams cut, and goodput (answers completed per second) through the endpoint as a
  share of the engines' own.
- kill, stop (SIGSTOP), wedge (the decode loop stopped, its API still answering /health), drain
  and roll (the command's arguments changed): 2 closed-loop clients (what one engine's slots
  take) for 12 s, the fault at 4 s, cleared at 8 s (a killed engine is restarted by the
  supervisor; a roll runs to its end). Counted: requests, lost (failed and not cut: a healthy
  replica was there), cut (streams broken off on the faulted engine), resent (cut streams whose
  HAProxy log line shows the request went to a second replica: a replay; the balancer resends
  only before a first byte), out (fault until the balancer had it out of rotation; none where
  it never had to: a killed engine restarted and loaded before anything found it gone, the
  requests it answered `503 Loading model` retried elsewhere) and back (fault cleared, or for a
  fault that heals by itself the fault, until both replicas are in rotation again).

Writes benchmarks/results/llama_reliability.json. These are CPU figures: a 135M model at about
60 tokens/s a stream on one thread; a GPU engine's first token and its tokens come faster, and
its restarts (a model load of seconds to minutes) slower.
"""

import asyncio
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from denv_agent.control import drain, undrain

from denv_iac.haproxy.runtime import server_stats
from denv_iac.local.processes import free_port
from denv_iac.local.rollout import roll
from denv_iac.local.run_state import ReplicaState, RunState
from denv_iac.local.runner import LocalCluster, supervised
from denv_iac.ops.llama import DecodeLoopFreeze, build_engine
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_report import LoadReport

RESULTS = Path(__file__).parent / "results" / "llama_reliability.json"
POOL = "chat"
MAX_TOKENS = 48
OVERLOAD_CLIENTS = 8
OVERLOAD_S = 60.0
FAULT_CLIENTS = 2
FAULT_RUN_S = 12.0
FAULT_AT_S = 4.0
CLEAR_AT_S = 8.0
# The retries field of an HAProxy log line (actconn/feconn/beconn/srv_conn/retries) and the
# request id it captured.
LOG_LINE = re.compile(r" \d+/\d+/\d+/\d+/(\+?\d+) \d+/\d+ \{([^}]*)\}")


def _state(cluster: LocalCluster) -> RunState:
    assert cluster.state is not None
    return cluster.state


def _chat(cluster: LocalCluster) -> list[ReplicaState]:
    return [r for r in _state(cluster).replicas if r.pool == POOL]


def _in_rotation(cluster: LocalCluster) -> set[str]:
    rows = server_stats(Path(_state(cluster).admin_socket))
    return {n for n, r in rows.items() if r["pxname"] == f"{POOL}.tier10" and r["status"] == "UP"}


def _wait(condition: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until `condition` holds, None past `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if condition():
            return time.monotonic() - started
        time.sleep(0.02)
    return None


def _full(cluster: LocalCluster) -> float | None:
    return _wait(lambda: len(_in_rotation(cluster)) == 2, 30.0)


def _load(url: str, clients: int, seconds: float) -> LoadReport:
    return asyncio.run(
        run_load(
            url,
            POOL,
            concurrency=clients,
            duration_s=seconds,
            max_tokens=MAX_TOKENS,
        )
    )


def _direct(urls: list[str], clients: int, seconds: float) -> list[LoadReport]:
    """`clients` spread evenly over the engines, called straight, at once."""
    reports: list[LoadReport] = []
    threads = [
        threading.Thread(
            target=lambda u=url: reports.append(_load(u, clients // len(urls), seconds))
        )
        for url in urls
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return reports


def overload(cluster: LocalCluster) -> dict[str, Any]:
    _full(cluster)
    through = _load(_state(cluster).endpoint, OVERLOAD_CLIENTS, OVERLOAD_S)
    direct = _direct([r.url for r in _chat(cluster)], OVERLOAD_CLIENTS, OVERLOAD_S)
    served = sum(1 for r in through.results if r.ok)
    served_direct = sum(1 for report in direct for r in report.results if r.ok)
    direct_wall = max(report.wall_s for report in direct)
    goodput, goodput_direct = served / through.wall_s, served_direct / direct_wall
    answers = {"200": served, **{k: v for k, v in sorted(through.errors().items())}}
    return {
        "clients": OVERLOAD_CLIENTS,
        "slots": 4,
        "seconds": OVERLOAD_S,
        "answers": answers,
        "other_than_200_or_503": sum(
            v for k, v in through.errors().items() if k not in ("http_503",)
        ),
        "cut": through.errors().get("aborted", 0),
        "goodput_per_s": round(goodput, 2),
        "direct_goodput_per_s": round(goodput_direct, 2),
        "goodput_ratio": round(goodput / goodput_direct, 3),
        "ttft_p50_ms": through.ttft_ms(50),
        "ttft_p90_ms": through.ttft_ms(90),
        "direct_ttft_p50_ms": _merged_ttft(direct, 50),
        "direct_ttft_p90_ms": _merged_ttft(direct, 90),
    }


def _merged_ttft(reports: list[LoadReport], q: float) -> float | None:
    merged = LoadReport(results=[r for report in reports for r in report.results])
    return merged.ttft_ms(q)


@dataclasses.dataclass
class Fault:
    name: str
    start: Callable[[LocalCluster, ReplicaState], Callable[[], None] | None]


def _kill(cluster: LocalCluster, victim: ReplicaState) -> None:
    os.killpg(victim.pid, signal.SIGKILL)  # the supervisor starts it again


def _stop(cluster: LocalCluster, victim: ReplicaState) -> Callable[[], None]:
    os.killpg(victim.pid, signal.SIGSTOP)
    return lambda: os.killpg(victim.pid, signal.SIGCONT)


def _wedge(cluster: LocalCluster, victim: ReplicaState) -> Callable[[], None]:
    freeze = DecodeLoopFreeze(victim.pid)
    freeze.freeze()
    return freeze.thaw


def _drain(cluster: LocalCluster, victim: ReplicaState) -> Callable[[], None]:
    state = _state(cluster)
    agent = state.agent_of(f"{victim.site}/{victim.node}")
    drain(agent.url, state.control_token, victim.id)

    def clear() -> None:
        undrain(agent.url, state.control_token, victim.id)

    return clear


def _roll(cluster: LocalCluster, victim: ReplicaState) -> None:
    stack = cluster.stack
    recipe = next(r for r in stack.recipes if r.name == POOL)
    command = list(recipe.command)
    at = command.index("-c") + 1
    command[at] = "1024" if command[at] != "1024" else "2048"
    recipes = tuple(
        dataclasses.replace(r, command=tuple(command)) if r is recipe else r for r in stack.recipes
    )
    roll(cluster, dataclasses.replace(stack, recipes=recipes))


FAULTS = (
    Fault("engine killed (SIGKILL), restarted by the supervisor", _kill),
    Fault("engine stopped (SIGSTOP) 4 s", _stop),
    Fault("decode loop wedged 4 s, /health still 200", _wedge),
    Fault("drained 4 s", _drain),
    Fault("rollout: the command's arguments changed", _roll),
)


def fault_row(cluster: LocalCluster, log: Path, fault: Fault) -> dict[str, Any]:
    _full(cluster)
    victim = _chat(cluster)[0]
    reports: list[LoadReport] = []
    worker = threading.Thread(
        target=lambda: reports.append(_load(_state(cluster).endpoint, FAULT_CLIENTS, FAULT_RUN_S))
    )
    worker.start()
    time.sleep(FAULT_AT_S)
    faulted = time.monotonic()
    clear = fault.start(cluster, victim)
    out = _wait(lambda: victim.id not in _in_rotation(cluster), CLEAR_AT_S - FAULT_AT_S)
    # Back: from the fault for one that heals by itself (a restart, a roll), else from its
    # clearing; none where the balancer never had it out.
    back: float | None = None
    if clear is None and out is not None:
        back = _full(cluster)
        back = None if back is None else time.monotonic() - faulted
    time.sleep(max(0.0, faulted + CLEAR_AT_S - FAULT_AT_S - time.monotonic()))
    if clear is not None:
        cleared = time.monotonic()
        clear()
        back = _full(cluster)
        back = None if back is None else time.monotonic() - cleared
    _full(cluster)
    worker.join()
    report = reports[0]
    cut = [r for r in report.results if r.error == "aborted"]
    retries = _retries(log)
    return {
        "fault": fault.name,
        "requests": len(report.results),
        "ok": sum(1 for r in report.results if r.ok),
        "lost": sum(1 for r in report.results if r.error and r.error != "aborted"),
        "cut": len(cut),
        "resent": sum(1 for r in cut if retries.get(r.request_id, 0) > 0),
        "out_ms": None if out is None else round(out * 1000, 1),
        "back_ms": None if back is None else round(back * 1000, 1),
        "ttft_p99_ms": report.ttft_ms(99),
    }


def _retries(log: Path) -> dict[str, int]:
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        match = LOG_LINE.search(line)
        if match:
            found[match.group(2)] = int(match.group(1).lstrip("+"))
    return found


def run() -> dict[str, Any]:
    engine = build_engine(Path(__file__).parent)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(engine.stack(), Path(tmp), free_port(), project=engine.project)
        with supervised(cluster):
            figures: dict[str, Any] = {"overload_2x": overload(cluster)}
            print(json.dumps(figures["overload_2x"]), flush=True)
            rows = []
            for fault in FAULTS:
                row = fault_row(cluster, Path(tmp) / "logs" / "haproxy.log", fault)
                print(json.dumps(row), flush=True)
                rows.append(row)
            figures["faults"] = rows
    return figures


def main() -> int:
    figures = run()
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
    overload_row = figures["overload_2x"]
    bad = overload_row["other_than_200_or_503"] or overload_row["cut"]
    bad = bad or overload_row["goodput_ratio"] < 0.9
    bad = bad or any(r["lost"] or r["resent"] for r in figures["faults"])
    print(f"wrote {RESULTS}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
