"""A canary on a running local stack, through real HAProxy and the simulated replicas: it takes its
share of new sessions, a session's later turns stay on the replica it started on, `denv status`
shows both versions side by side, and the promotion edit rolls under load losing nothing.
Skipped where HAProxy is not installed, as tests.local.test_local_roll is."""

import copy
import json
import re
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from benchmarks.lab.waiting import eventually
from denv_iac.core.balancer.stats import server_rows
from denv_iac.core.stack.reader import read_stack
from denv_iac.haproxy.runtime import stats_rows
from denv_iac.local.processes import HOST, free_port
from denv_iac.local.rollout import RollStopped, roll
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.status import (
    AgentEndpoint,
    pool_statuses,
    read_agents,
    replica_statuses,
    with_agent_health,
)
from tests.local.test_local_roll import VOICE, Load, _cmdline, _ready
from tests.local.test_local_supervision import _stack_project, _supervised_up
from tests.stacks import local_site

pytestmark = pytest.mark.needs_haproxy

SHARE = 0.25
# New sessions sent one after another, and how far the canary's measured share may stray from
# SHARE: the binomial spread of 1000 draws at 0.25 is 1.4 points; over 4000 sessions in six
# runs the canary took 27.1 % (the ring's points and the hash of the session ids, not the
# weights alone), so 7 points is 3.5 sigma from what it takes. One at a time, so that
# bounded-load hashing never moves a session off a busy replica: sent 4 at a time, a canary 15
# times slower to its first token held more requests than its share and took 10 % of them.
SESSIONS = 1000
TOLERANCE = 0.07
TURNS = 3  # later turns of each of STICKY sessions
STICKY = 40
STABLE = {"ttft_ms": 2, "itl_ms": 1, "tokens": 2}
NEW = {"ttft_ms": 15, "itl_ms": 1, "tokens": 2}


def _config(
    canary: bool = True, simulate: dict[str, Any] = STABLE, share: float = SHARE
) -> dict[str, Any]:
    # test_local_roll's pool of 3 (min_warm 2, spare 1); the agent probes each replica's first
    # token every second.
    voice = {**copy.deepcopy(VOICE), "ttft_budget_ms": 1000, "simulate": copy.deepcopy(simulate)}
    if canary:
        voice["canary"] = {"share": share, "simulate": copy.deepcopy(NEW)}
    return {
        "denv:sites": [local_site("local", nodes=4, gpus=1)],
        "denv:recipes": [voice],
        "denv:balancer": {"sites": ["local"]},
    }


@pytest.fixture
def running(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(read_stack("t", _config()), tmp_path / "run", free_port())
    cluster.up()
    try:
        eventually(lambda: len(_ready(cluster)) == 4, 15, "all 4 replicas UP")
        yield cluster
    finally:
        cluster.down()


def _turn(http: httpx.Client, endpoint: str, session: str) -> str:
    """One turn of a session (its X-Denv-Session header); the replica that served it."""
    response = http.post(
        f"{endpoint}/v1/chat/completions",
        json={"model": "voice", "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Denv-Session": session},
    )
    assert response.status_code == 200, response.text
    return response.headers["X-Denv-Replica"]


def _sessions(
    endpoint: str, sessions: list[str], turns: int, at_once: int = 1
) -> dict[str, list[str]]:
    """Each session's turns in order (`at_once` sessions side by side): who served each."""
    local = threading.local()

    def run(session: str) -> list[str]:
        if not hasattr(local, "http"):
            local.http = httpx.Client(timeout=10)
        return [_turn(local.http, endpoint, session) for _ in range(turns)]

    with ThreadPoolExecutor(at_once) as pool:
        return dict(zip(sessions, pool.map(run, sessions), strict=True))


class StableLoad(Load):
    """Streaming clients, sampling the recipe's own ready replicas (the canary is no part of
    min_warm)."""

    def sampler(self) -> None:
        while not self.stop.wait(0.05):
            ready = _ready(self.cluster)
            self.ready_samples.append(sum(1 for r in ready if r.startswith("voice.")))


def test_canary_share_stickiness_status_and_promotion(running: LocalCluster) -> None:
    cluster = running
    assert cluster.state is not None
    endpoint = cluster.state.endpoint

    # New sessions: the canary takes its share of them.
    firsts = _sessions(endpoint, [str(uuid.uuid4()) for _ in range(SESSIONS)], 1)
    served = Counter(turns[0].split(".")[0] for turns in firsts.values())
    assert set(served) == {"voice", "voice-canary"}
    measured = served["voice-canary"] / SESSIONS
    assert abs(measured - SHARE) <= TOLERANCE, f"canary took {measured:.3f} of new sessions"

    # A session's later turns stay on the replica its first turn went to, canary or not. One at
    # a time, as above: with several at once, bounded-load hashing sends a turn past a replica
    # that holds over 1.5 times its weighted share of the requests in flight (see
    # docs/components.md, Canary).
    sticky = list(firsts)[:STICKY]
    later = _sessions(endpoint, sticky, TURNS)
    moved = {s: (firsts[s][0], turns) for s, turns in later.items() if set(turns) != {firsts[s][0]}}
    assert moved == {}
    assert any(firsts[s][0].startswith("voice-canary.") for s in sticky)

    # `denv status`: both versions side by side, from HAProxy's rows and the agents' probes.
    agents = [AgentEndpoint(a.node, f"http://{HOST}:{a.http_port}") for a in cluster.state.agents]

    def versions() -> Any:
        rows = stats_rows(Path(cluster.state.admin_socket))  # type: ignore[union-attr]
        replicas = with_agent_health(replica_statuses(server_rows(rows)), read_agents(agents))
        (pool,) = pool_statuses(cluster.stack, replicas)
        return pool

    eventually(lambda: all(v.probe_ttft_ms is not None for v in versions().versions), 10, "probed")
    pool = versions()
    stable, canary = pool.versions
    assert (stable.version, stable.ready, stable.replicas) == ("stable", 3, 3)
    assert (canary.version, canary.ready, canary.replicas) == ("canary", 1, 1)
    assert canary.share_now == pytest.approx(SHARE) and canary.share_stack == SHARE
    assert canary.served >= served["voice-canary"] and stable.served >= served["voice"]
    # The canary's simulated first token comes after 15 ms, the recipe's after 2 ms.
    assert canary.probe_ttft_ms is not None and canary.probe_ttft_ms >= NEW["ttft_ms"]
    assert pool.healthy == 3 and pool.ok

    # Promotion: the canary's simulate copied into the recipe, the canary block dropped. The
    # recipe's replicas roll onto it one by one under load; the canary's is drained and retired.
    promoted = read_stack("t", _config(canary=False, simulate=NEW))
    canary_replica = next(r for r in cluster.state.replicas if r.pool == "voice-canary")
    lines: list[str] = []
    with StableLoad(endpoint, cluster) as load:
        eventually(lambda: load.completed >= 10, 10, "serving")
        report = roll(cluster, promoted, lines.append)
        done = load.completed
        eventually(lambda: load.completed >= done + 10, 10, "serving after the roll")
    assert load.lost == [] and load.cut == [] and report.cut == 0
    assert min(load.ready_samples) >= 2  # min_warm, the recipe's own replicas
    assert [s.replica for s in report.steps] == [f"voice.local.n{i}.0" for i in range(3)]
    assert [s.replica for s in report.retired] == [canary_replica.id] and report.reweighted
    assert [r.id for r in cluster.state.replicas] == [s.replica for s in report.steps]
    for replica in cluster.state.replicas:
        assert "--ttft-ms=15 " in _cmdline(replica.pid), replica.id
    assert not Path(f"/proc/{canary_replica.pid}").exists()
    # New sessions all go to the recipe's replicas now, the canary out of the balancer.
    after = _sessions(endpoint, [str(uuid.uuid4()) for _ in range(40)], 1)
    assert {turns[0].split(".")[0] for turns in after.values()} == {"voice"}
    assert "voice-canary" not in str(server_rows(stats_rows(Path(cluster.state.admin_socket))))
    assert roll(cluster, promoted).line().startswith("nothing to roll")
    print(
        f"canary share {measured:.3f} of {SESSIONS} new sessions (stack {SHARE});"
        f" {STICKY} sessions x {TURNS} later turns, 0 moved;"
        f" probe TTFT stable {stable.probe_ttft_ms} ms, canary {canary.probe_ttft_ms} ms;"
        f" {report.line()}; requests under the roll {load.completed}"
    )


def _denv(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "denv_iac", *args, "--stack", "t"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _versions(project: Path) -> list[dict[str, Any]]:
    status = _denv(project, "status", "--json")
    (pool,) = json.loads(status.stdout)["pools"]
    return pool["versions"]  # type: ignore[no-any-return]


def test_canary_brought_in_reweighted_and_retired_by_denv_local_roll(tmp_path: Path) -> None:
    project = _stack_project(tmp_path)
    stack_file = project / "stacks" / "Pulumi.t.yaml"
    stack_file.write_text(yaml.safe_dump({"config": _config(canary=False)}))
    with _supervised_up(project) as (supervisor, state):
        # Brought in: its replica started on the free GPU, warm, then in the balancer; the
        # recipe's replicas untouched.
        stack_file.write_text(yaml.safe_dump({"config": _config()}))
        added = _denv(project, "local", "roll")
        assert added.returncode == 0, added.stderr
        assert re.fullmatch(
            r"started voice-canary\.local\.n3\.0 \(warm in [0-9.]+ s\); balancer reloaded with"
            r" the new weights; 3 unchanged; 0 session\(s\) cut",
            added.stdout.splitlines()[-1],
        )
        now = RunState.from_json((project / ".denv/t/state.json").read_text())
        assert {r.id: r.pid for r in now.replicas if r.pool == "voice"} == {
            r.id: r.pid for r in state.replicas
        }
        eventually(lambda: [v["ready"] for v in _versions(project)] == [3, 1], 15, "both ready")
        # `denv status`, both versions side by side. (Its exit status says whether the agents
        # were heard, which a loaded machine can delay: tests/test_status.py checks it.)
        text = _denv(project, "status")
        assert "pool voice: stable and canary" in text.stdout
        assert re.search(r"canary\s+│ voice-canary\s+│\s+1/1 │\s+25\.0 % │\s+25\.0 %", text.stdout)

        # A new share: nothing restarts; the balancer is reloaded with the new weights.
        stack_file.write_text(yaml.safe_dump({"config": _config(share=0.5)}))
        rolled = _denv(project, "local", "roll")
        assert rolled.returncode == 0, rolled.stderr
        assert rolled.stdout.splitlines()[-1] == (
            "balancer reloaded with the new weights; 4 unchanged; 0 session(s) cut"
        )
        stable, canary = _versions(project)
        assert (stable["share_stack"], canary["share_stack"]) == (0.5, 0.5)
        assert canary["share_now"] == pytest.approx(255 / (255 + 3 * 85))  # weights 85 and 255

        # Retirement: the block dropped. The canary's replica is drained, left out, stopped.
        stack_file.write_text(yaml.safe_dump({"config": _config(canary=False)}))
        retired = _denv(project, "local", "roll")
        assert retired.returncode == 0, retired.stderr
        canary_pid = next(r.pid for r in now.replicas if r.pool == "voice-canary")
        assert retired.stdout.splitlines()[-1].startswith(
            "retired voice-canary.local.n3.0 (drained"
        )
        assert _versions(project) == []
        final = RunState.from_json((project / ".denv/t/state.json").read_text())
        assert {r.id: r.pid for r in final.replicas} == {r.id: r.pid for r in state.replicas}
        assert not Path(f"/proc/{canary_pid}").exists()
        assert _denv(project, "local", "roll").stdout.strip().startswith("nothing to roll")
        assert supervisor.poll() is None


def test_a_canary_that_never_warms_stays_out_of_the_balancer(tmp_path: Path) -> None:
    slow_budget = {"stall_timeout_ms": 30000}
    config = _config(canary=False)
    config["denv:recipes"][0].update(slow_budget)
    cluster = LocalCluster(read_stack("t", config), tmp_path / "run", free_port())
    cluster.up()
    try:
        assert cluster.state is not None
        eventually(lambda: len(_ready(cluster)) == 3, 15, "all 3 replicas UP")
        pids = {r.id: r.pid for r in cluster.state.replicas}
        # Its first token comes after 20 s: never within the 10 s cold-start budget.
        changed = _config()
        changed["denv:recipes"][0].update(slow_budget)
        changed["denv:recipes"][0]["canary"]["simulate"] = {"ttft_ms": 20000}
        with pytest.raises(RollStopped) as stopped:
            roll(cluster, read_stack("t", changed))
        assert str(stopped.value).startswith(
            "replica voice-canary.local.n3.0 of the canary of voice never became warm (no first"
            " token within cold_start_budget_s 10 s"
        )
        assert {r.id: r.pid for r in cluster.state.replicas} == pids
        assert cluster.stack.canary_pool("voice") is None  # the old stack, a roll asked again
        rows = server_rows(stats_rows(Path(cluster.state.admin_socket)))
        assert sorted(rows) == sorted(pids)  # never in the balancer
    finally:
        cluster.down()
