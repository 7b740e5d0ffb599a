"""A recipe change rolls onto a running local stack under streaming load, through real HAProxy:
nothing lost, no stream cut, min_warm ready at every sample; a config that never warms stops the
roll with the old replicas serving."""

import copy
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from benchmarks.lab.waiting import eventually
from denv_iac.core.rollout import RolloutRefused
from denv_iac.core.stack.reader import read_stack
from denv_iac.haproxy.runtime import stats_command
from denv_iac.local.processes import free_port
from denv_iac.local.rollout import (
    RollStopped,
    ready_servers,
    roll,
    server_rows,
)
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from tests.local.test_local_supervision import CONFIG as SUPERVISED
from tests.local.test_local_supervision import _stack_project, _supervised_up
from tests.stacks import local_site

pytestmark = pytest.mark.needs_haproxy

VOICE: dict[str, Any] = {
    "name": "voice",
    "min_warm": 2,
    "spare": 1,
    "sites": ["local"],
    "drain_timeout_s": 10,
    "cold_start_budget_s": 10,
    "simulate": {"ttft_ms": 20, "itl_ms": 20, "tokens": 16},
}


def _config(**voice: Any) -> dict[str, Any]:
    recipe = copy.deepcopy(VOICE)
    recipe.update(voice)
    return {
        "denv:sites": [local_site("local", nodes=3, gpus=1)],
        "denv:recipes": [recipe],
        "denv:balancer": {"sites": ["local"]},
    }


@pytest.fixture
def started(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalCluster]:
    config: dict[str, Any] = request.param
    cluster = LocalCluster(read_stack("t", config), tmp_path / "run", free_port())
    cluster.up()
    try:
        eventually(lambda: len(_ready(cluster)) == len(cluster.placement.replicas), 15, "all UP")
        yield cluster
    finally:
        cluster.down()


def _ready(cluster: LocalCluster) -> set[str]:
    assert cluster.state is not None
    return _state_ready(cluster.state)


def _state_ready(state: RunState) -> set[str]:
    return ready_servers(server_rows(stats_command(Path(state.admin_socket), "show stat")))


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@dataclass
class Load:
    """Clients streaming chat through the endpoint, and a sampler of the pool's ready count."""

    endpoint: str
    cluster: LocalCluster
    stop: threading.Event = field(default_factory=threading.Event)
    completed: int = 0
    lost: list[str] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)
    ready_samples: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self.stop.is_set():
                body = {"model": "voice", "stream": True, "messages": [{"role": "user"}]}
                started = False
                try:
                    url = f"{self.endpoint}/v1/chat/completions"
                    with http.stream("POST", url, json=body) as response:
                        if response.status_code != 200:
                            self._note(self.lost, f"http {response.status_code}")
                            continue
                        done = False
                        for line in response.iter_lines():
                            started = True
                            done = done or line == "data: [DONE]"
                        if not done:
                            self._note(self.cut, "no [DONE]")
                            continue
                except httpx.HTTPError as error:
                    self._note(self.cut if started else self.lost, repr(error))
                    continue
                with self.lock:
                    self.completed += 1

    def _note(self, into: list[str], what: str) -> None:
        with self.lock:
            into.append(what)

    def sampler(self) -> None:
        while not self.stop.wait(0.05):
            self.ready_samples.append(len(_ready(self.cluster)))

    def __enter__(self) -> "Load":
        self.threads = [threading.Thread(target=self.client) for _ in range(3)]
        self.threads.append(threading.Thread(target=self.sampler))
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)


@pytest.mark.timing
@pytest.mark.parametrize("started", [_config()], indirect=True)
def test_recipe_change_rolls_under_load_losing_nothing(started: LocalCluster) -> None:
    cluster = started
    assert cluster.state is not None
    changed = read_stack("t", _config(simulate={"ttft_ms": 20, "itl_ms": 20, "tokens": 12}))
    lines: list[str] = []
    with Load(cluster.state.endpoint, cluster) as load:
        eventually(lambda: load.completed >= 10, 10, "serving")
        before_roll = load.completed
        report = roll(cluster, changed, lines.append)
        before_end = load.completed
        eventually(lambda: load.completed >= before_end + 10, 10, "serving after the roll")
    ids = [r.id for r in cluster.placement.replicas]
    assert [s.replica for s in report.steps] == ids
    assert load.lost == [] and load.cut == [] and report.cut == 0
    # Traffic flowed through the roll (how much depends on the machine, not the product).
    assert before_end - before_roll >= len(report.steps)
    assert load.ready_samples and min(load.ready_samples) >= 2  # min_warm
    for replica in cluster.state.replicas:
        assert "--tokens=12" in _cmdline(replica.pid), replica.id
        answer = httpx.post(
            f"{replica.url}/v1/chat/completions", json={"model": "voice"}, timeout=5
        ).json()
        assert answer["usage"]["completion_tokens"] == 12
    assert roll(cluster, changed).steps == []  # a second roll applies nothing
    print(report.line(), f"samples {len(load.ready_samples)}, requests {load.completed}")


@pytest.mark.timing
@pytest.mark.parametrize("started", [_config(min_warm=1, stall_timeout_ms=30000)], indirect=True)
def test_a_config_that_never_warms_stops_the_roll_old_replicas_serving(
    started: LocalCluster,
) -> None:
    cluster = started
    assert cluster.state is not None
    pids = {r.id: r.pid for r in cluster.state.replicas}
    # Not applied by a local roll: refused before anything changes, naming the field.
    with pytest.raises(RolloutRefused, match=r"recipes\[voice\]\.stall_timeout_ms: changed"):
        roll(cluster, read_stack("t", _config(min_warm=1, stall_timeout_ms=20000)))
    # A first token 20 s away never comes within the 10 s cold-start budget.
    slow = {"ttft_ms": 20000, "itl_ms": 20, "tokens": 16}
    changed = read_stack("t", _config(min_warm=1, stall_timeout_ms=30000, simulate=slow))
    first = cluster.placement.replicas[0].id
    with pytest.raises(RollStopped) as stopped:
        roll(cluster, changed)
    line = str(stopped.value)
    assert line.startswith(f"replica {first} never became warm") and "\n" not in line
    # The others were never touched; the failed one serves its old config again.
    assert {r.id: r.pid for r in cluster.state.replicas if r.id != first} == {
        k: v for k, v in pids.items() if k != first
    }
    for replica in cluster.state.replicas:
        assert "--ttft-ms=20 " in _cmdline(replica.pid), replica.id
    eventually(lambda: len(_ready(cluster)) == len(pids), 15, "all UP again")
    for _ in range(6):
        response = httpx.post(
            f"{cluster.state.endpoint}/v1/chat/completions", json={"model": "voice"}, timeout=5
        )
        assert response.status_code == 200
    assert cluster.stack.recipes[0].simulate.ttft_ms == 20


def _denv_roll(project: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "denv_iac", "local", "roll", "--stack", "t"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_denv_local_roll_rolls_through_the_supervisor(tmp_path: Path) -> None:
    project = _stack_project(tmp_path)
    with _supervised_up(project) as (_, state):
        config = copy.deepcopy(SUPERVISED)
        config["denv:recipes"][0]["simulate"]["tokens"] = 6
        (project / "stacks" / "Pulumi.t.yaml").write_text(yaml.safe_dump({"config": config}))
        rolled = _denv_roll(project)
        assert rolled.returncode == 0, rolled.stderr
        assert rolled.stdout.splitlines()[-1].startswith("rolled 2 replica(s) in ")
        now = RunState.from_json((project / ".denv/t/state.json").read_text())
        for before, after in zip(state.replicas, now.replicas, strict=True):
            if before.pool == "voice":
                assert "--tokens=6 " in _cmdline(after.pid), after.id
            else:
                assert after.pid == before.pid, after.id  # unchanged replicas are untouched
        again = _denv_roll(project)
        assert again.stdout.strip() == "nothing to roll: every replica runs the stack file's config"
    refused = _denv_roll(project)
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: --stack: t has no supervising `denv local up`")
    assert len(refused.stderr.splitlines()) == 1


def test_denv_local_roll_stops_naming_a_replica_that_never_warms(tmp_path: Path) -> None:
    project = _stack_project(tmp_path)
    config = copy.deepcopy(SUPERVISED)
    voice = config["denv:recipes"][0]
    voice.update(stall_timeout_ms=30000, cold_start_budget_s=10)
    stack_file = project / "stacks" / "Pulumi.t.yaml"
    stack_file.write_text(yaml.safe_dump({"config": config}))
    with _supervised_up(project) as (supervisor, state):
        # The new config's first token comes after 20 s: never within the 10 s budget.
        voice["simulate"]["ttft_ms"] = 20000
        stack_file.write_text(yaml.safe_dump({"config": config}))
        stopped = _denv_roll(project)
        assert stopped.returncode == 1, stopped.stderr
        (line,) = stopped.stderr.splitlines()
        first = next(r.id for r in state.replicas if r.pool == "voice")
        assert line.startswith(f"error: replica {first} never became warm with the new config")
        assert "cold_start_budget_s 10 s" in line
        now = RunState.from_json((project / ".denv/t/state.json").read_text())
        for before, after in zip(state.replicas, now.replicas, strict=True):
            assert "--ttft-ms=20000" not in _cmdline(after.pid), after.id
            if after.id != first:
                assert after.pid == before.pid, after.id  # never touched
        # The old version serves, the failed replica among it, through the endpoint.
        eventually(lambda: len(_state_ready(now)) == len(now.replicas), 15, "all UP again")
        for _ in range(4):
            response = httpx.post(
                f"{now.endpoint}/v1/chat/completions", json={"model": "voice"}, timeout=5
            )
            assert response.status_code == 200
        assert supervisor.poll() is None


# Streams of 3 s against a drain bound of 1 s: each drained replica still holds its stream.
LONG = {"ttft_ms": 20, "itl_ms": 20, "tokens": 150}


@pytest.mark.parametrize("started", [_config(drain_timeout_s=1, simulate=LONG)], indirect=True)
def test_streams_past_drain_timeout_are_cut_counted_and_named(started: LocalCluster) -> None:
    cluster = started
    assert cluster.state is not None
    changed = read_stack("t", _config(drain_timeout_s=1, simulate={**LONG, "tokens": 149}))
    lines: list[str] = []
    with Load(cluster.state.endpoint, cluster) as load:
        eventually(lambda: _sessions(cluster) >= 3, 10, "3 streams open")
        report = roll(cluster, changed, lines.append)
        eventually(lambda: load.completed >= 3, 15, "serving after the roll")
    assert load.lost == []
    # What the clients saw cut is what the roll counted, each on a replica it names.
    assert load.cut and len(load.cut) <= report.cut
    named = [line for line in lines if "still open after drain_timeout_s 1 s: cut" in line]
    assert {line.split(":")[0].removeprefix("replica ") for line in named} == set(report.cut_on())
    assert report.line().endswith(
        f"{report.cut} session(s) cut past drain_timeout_s ("
        + ", ".join(f"{r} {n}" for r, n in report.cut_on().items())
        + ")"
    )
    assert min(load.ready_samples) >= 2  # min_warm held even so


def _sessions(cluster: LocalCluster) -> int:
    assert cluster.state is not None
    rows = server_rows(stats_command(Path(cluster.state.admin_socket), "show stat"))
    return sum(int(r["scur"] or 0) for r in rows if r["svname"].startswith("voice."))
