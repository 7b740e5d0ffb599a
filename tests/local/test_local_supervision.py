"""The local runner keeps what it started alive, and one stack runs once."""

import contextlib
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from benchmarks.lab.waiting import eventually
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.local.processes import RestartBackoff, free_port
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.local.stopping import StackLock
from tests.local.test_local_runner import CONFIG, alive

pytestmark = pytest.mark.needs_haproxy


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    running = LocalCluster(read_stack("t", CONFIG), tmp_path / "run", free_port())
    running.up()
    yield running
    running.down()


def _stack_project(tmp_path: Path) -> Path:
    (tmp_path / "stacks").mkdir()
    (tmp_path / "Pulumi.yaml").write_text("name: t\nruntime: python\n")
    (tmp_path / "stacks" / "Pulumi.t.yaml").write_text(yaml.safe_dump({"config": CONFIG}))
    return tmp_path


def _supervise_until(
    cluster: LocalCluster, done: Callable[[], bool], timeout_s: float = 10
) -> list[str]:
    """What supervising logged until `done` held: supervise, then ask, every 50 ms."""
    lines: list[str] = []

    def supervised() -> bool:
        lines.extend(cluster.supervise())
        return done()

    eventually(supervised, timeout_s, "recovered", detail=lambda: lines)
    return lines


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _serves(state: RunState, pool: str = "voice") -> bool:
    try:
        response = httpx.post(
            f"{state.endpoint}/v1/chat/completions",
            json={"model": pool, "max_tokens": 1},
            timeout=2,
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def test_a_replica_that_dies_is_restarted_on_its_port(cluster: LocalCluster) -> None:
    state = cluster.state
    assert state is not None
    victim = state.replicas[0]
    old_pid, port = victim.pid, victim.port
    os.kill(old_pid, signal.SIGKILL)
    lines = _supervise_until(cluster, lambda: _healthy(victim.url))
    assert lines == [f"replica {victim.id} died; restarted (restart 1)"]
    assert victim.pid != old_pid and alive(victim.pid) and victim.port == port
    recorded = RunState.from_json((cluster.directory / "state.json").read_text())
    assert recorded.replicas[0].pid == victim.pid


def test_an_agent_and_the_balancer_that_die_are_restarted(cluster: LocalCluster) -> None:
    state = cluster.state
    assert state is not None
    agent = state.agents[0]
    old_agent, old_haproxy = agent.pid, state.haproxy_pid
    os.kill(old_agent, signal.SIGKILL)
    os.killpg(old_haproxy, signal.SIGKILL)
    lines = _supervise_until(cluster, lambda: agent.pid != old_agent and _serves(state))
    assert sorted(lines) == [
        f"agent of {agent.node} died; restarted (restart 1)",
        "balancer died; restarted (restart 1)",
    ]
    assert alive(agent.pid) and agent.pid != old_agent
    assert alive(state.haproxy_pid) and state.haproxy_pid != old_haproxy


def test_restart_waits_double_up_to_a_ceiling_and_start_over_once_stable() -> None:
    backoff = RestartBackoff(started_at=0.0)
    now, waits = 0.0, []
    for _ in range(8):
        assert backoff.due(now)
        backoff.restarted(now)
        waits.append(backoff.wait_s)
        assert not backoff.due(now + backoff.wait_s / 2)
        now += backoff.wait_s  # dies again as soon as it may be restarted
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    backoff.restarted(now + 60)  # it had stayed up for a minute
    assert backoff.wait_s == 0.1 and backoff.restarts == 9


def test_a_replica_that_keeps_dying_is_not_restarted_in_a_loop(cluster: LocalCluster) -> None:
    state = cluster.state
    assert state is not None
    victim = state.replicas[0]
    restarts = 0
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        restarts += len(cluster.supervise())
        with contextlib.suppress(ProcessLookupError):  # already dead, not yet restarted
            os.kill(victim.pid, signal.SIGKILL)
        time.sleep(0.02)
    # Waits of 0.1, 0.2, 0.4, 0.8 s (plus each start) leave room for five restarts at most.
    assert 2 <= restarts <= 5
    _supervise_until(cluster, lambda: _healthy(victim.url))  # and it comes back


def test_nothing_is_restarted_once_down_began(tmp_path: Path) -> None:
    running = LocalCluster(read_stack("t", CONFIG), tmp_path / "run", free_port())
    state = running.up()
    running.down()
    assert running.supervise() == []
    assert not any(alive(r.pid) for r in state.replicas)


def test_state_file_is_private(cluster: LocalCluster) -> None:
    mode = stat.S_IMODE((cluster.directory / "state.json").stat().st_mode)
    assert mode == 0o600


def test_a_second_lock_on_one_stack_is_refused_with_the_holder(tmp_path: Path) -> None:
    first = StackLock(tmp_path)
    first.acquire("t")
    try:
        with pytest.raises(
            StackError, match=rf"t is already starting or running.*pid {os.getpid()}"
        ):
            StackLock(tmp_path).acquire("t")
    finally:
        first.release()
    second = StackLock(tmp_path)
    second.acquire("t")  # free again once released
    second.release()


def test_two_local_up_of_one_stack_the_second_fails_and_orphans_nothing(tmp_path: Path) -> None:
    _stack_project(tmp_path)
    denv = [sys.executable, "-m", "denv_iac", "local", "up", "--stack", "t", "--quiet"]
    port = str(free_port())
    first = subprocess.Popen(
        [*denv, "--port", port],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None
        endpoint = first.stdout.readline().strip()
        assert endpoint == f"http://127.0.0.1:{port}", first.poll() is not None and first.stderr
        second = subprocess.run(
            [*denv, "--port", str(free_port())],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert second.stderr.strip() == (
            f"error: --stack: t is already starting or running locally (pid {first.pid}); "
            "`denv local down --stack t` or Ctrl-C in its terminal stops it"
        )
        recorded = RunState.from_json((tmp_path / ".denv" / "t" / "state.json").read_text())
        assert alive(recorded.haproxy_pid)
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    assert not any(alive(r.pid) for r in recorded.replicas)
    assert not alive(recorded.haproxy_pid)


def test_a_left_over_state_file_is_dropped(tmp_path: Path) -> None:
    _stack_project(tmp_path)
    run = tmp_path / ".denv" / "t"
    run.mkdir(parents=True)
    # Recorded processes that are long gone (pids no process of ours has).
    state = RunState("t", "http://127.0.0.1:1", "/nonexistent", "", 2**22 + 7, "x")
    (run / "state.json").write_text(state.to_json())
    port = str(free_port())
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "denv_iac",
            "local",
            "up",
            "--stack",
            "t",
            "--port",
            port,
            "--detach",
            "--quiet",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == f"http://127.0.0.1:{port}"
    finally:
        down = subprocess.run(
            [sys.executable, "-m", "denv_iac", "local", "down", "--stack", "t"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert down.stdout.strip() == "stopped 7 processes"


def _ignore_sigint() -> None:
    # What a non-interactive shell does to a job it starts with `&`.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _supervised_up(project: Path) -> Iterator[tuple[subprocess.Popen[str], RunState]]:
    """A foreground `denv local up` started as a background job, and what it recorded."""
    port = str(free_port())
    command = [sys.executable, "-m", "denv_iac", "local", "up", "--stack", "t", "--quiet"]
    supervisor = subprocess.Popen(
        [*command, "--port", port],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    try:
        assert supervisor.stdout is not None
        assert supervisor.stdout.readline().strip() == f"http://127.0.0.1:{port}"
        yield supervisor, RunState.from_json((project / ".denv/t/state.json").read_text())
    finally:
        if supervisor.poll() is None:
            supervisor.terminate()
            supervisor.wait(30)


def _all_stopped(state: RunState) -> bool:
    pids = [state.haproxy_pid, *(a.pid for a in state.agents), *(r.pid for r in state.replicas)]
    return not any(alive(pid) for pid in pids)


def test_down_stops_a_supervised_up_and_nothing_is_restarted(tmp_path: Path) -> None:
    project = _stack_project(tmp_path)
    with _supervised_up(project) as (supervisor, state):
        down = subprocess.run(
            [sys.executable, "-m", "denv_iac", "local", "down", "--stack", "t"],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert down.returncode == 0, down.stderr
        # The supervisor, then the 7 processes it started (HAProxy, 2 agents, 4 replicas).
        assert down.stdout.strip() == "stopped 8 processes"
        assert supervisor.wait(10) == 0
        assert _all_stopped(state)
        # Nothing is left to restart them, and nothing of the stack listens any more.
        assert not (project / ".denv/t/state.json").exists()
        assert not _serves(state)
        assert StackLock(project / ".denv/t").holder() is None


def test_sigint_stops_a_supervised_up_started_as_a_background_job(tmp_path: Path) -> None:
    project = _stack_project(tmp_path)
    with _supervised_up(project) as (supervisor, state):
        assert StackLock(project / ".denv/t").holder() == supervisor.pid
        supervisor.send_signal(signal.SIGINT)
        assert supervisor.wait(30) == 0
        assert _all_stopped(state)
