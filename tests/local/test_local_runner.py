"""The local runner brings up a real data plane for a local stack and leaves nothing behind."""

import hashlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from click.testing import CliRunner
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from denv_iac.cli import main
from denv_iac.core.balancer.client_secrets import subprotocols
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.local import processes
from denv_iac.local.processes import HAPROXY_MARK, REPLICA_MARK, free_port, ours
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.local.stopping import stop_recorded
from denv_iac.ops.demo import kill_replica, run_demo
from tests.stacks import local_site, valid_config

pytestmark = pytest.mark.needs_haproxy

CONFIG = {
    "denv:sites": [local_site("local", nodes=2, gpus=2)],
    "denv:recipes": [
        {
            "name": "voice",
            "min_warm": 1,
            "spare": 1,
            "sites": ["local"],
            "simulate": {"ttft_ms": 20, "itl_ms": 2, "tokens": 4},
        },
        {
            "name": "side",
            "gpu": "1g.10gb",
            "min_warm": 1,
            "spare": 1,
            "sites": ["local"],
            "simulate": {"ttft_ms": 10, "itl_ms": 2, "tokens": 4},
        },
    ],
    "denv:balancer": {"sites": ["local"]},
}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("zombie") < 0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    running = LocalCluster(read_stack("t", CONFIG), tmp_path / "run", free_port())
    running.up()
    yield running
    running.down()


def test_state_file_describes_what_runs(cluster: LocalCluster) -> None:
    state = RunState.from_json((cluster.directory / "state.json").read_text())
    assert [r.id for r in state.replicas] == [
        "voice.local.n0.0",
        "voice.local.n1.0",
        "side.local.n0.1.0",
        "side.local.n1.1.0",
    ]
    assert all(alive(r.pid) and r.address == "127.0.0.1" for r in state.replicas)
    assert {r.agent_port for r in state.replicas} == {a.agent_port for a in state.agents}
    assert Path(state.admin_socket).exists()
    response = httpx.post(
        f"{state.endpoint}/v1/chat/completions", json={"model": "side", "max_tokens": 2}, timeout=5
    )
    assert response.status_code == 200
    assert response.headers["x-denv-replica"].startswith("side.local.")


def test_a_replica_obeys_only_its_runs_token(cluster: LocalCluster) -> None:
    state = cluster.state
    assert state is not None
    replica = state.replicas[0]
    url = f"{replica.url}/control/fault"
    for headers in ({}, {"Authorization": "Bearer guess"}):
        assert httpx.post(url, json={"mode": "exit"}, headers=headers).status_code == 401
    assert alive(replica.pid)
    kill_replica(state, replica.id)  # the run's token, from its state
    deadline = time.monotonic() + 5
    while alive(replica.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(replica.pid)


def test_down_leaves_no_process(tmp_path: Path) -> None:
    running = LocalCluster(read_stack("t", CONFIG), tmp_path / "run", free_port())
    state = running.up()
    pids = [state.haproxy_pid] + [a.pid for a in state.agents] + [r.pid for r in state.replicas]
    running.down()
    assert not any(alive(pid) for pid in pids)
    assert not (tmp_path / "run" / "state.json").exists()


def test_stop_recorded_stops_only_its_own_processes(cluster: LocalCluster) -> None:
    state = cluster.state
    assert state is not None
    assert ours(state.haproxy_pid, HAPROXY_MARK)
    assert all(ours(r.pid, REPLICA_MARK) for r in state.replicas)
    assert not ours(os.getpid(), REPLICA_MARK) and not ours(os.getpid(), HAPROXY_MARK)
    assert stop_recorded(cluster.directory) == 1 + len(state.agents) + len(state.replicas)
    assert not any(alive(r.pid) for r in state.replicas)


def test_local_up_runs_with_the_stacks_balancer_timers(tmp_path: Path) -> None:
    timers = {
        "connect_timeout_ms": 300,
        "check_timeout_ms": 1500,
        "check_inter_ms": 3000,
        "agent_inter_ms": 2500,
    }
    stack = read_stack("t", {**CONFIG, "denv:balancer": {"sites": ["local"], "timers": timers}})
    running = LocalCluster(stack, tmp_path / "run", free_port())
    running.up()
    try:
        settings = running.balancer_settings
        assert {name: getattr(settings, name) for name in timers} == timers
        config = (running.directory / "haproxy" / "haproxy.cfg").read_text()
        assert "timeout connect 300ms" in config
        assert "timeout check 1500ms" in config
        assert "default-server check inter 3000ms fastinter 750ms" in config
        assert "agent-inter 2500ms" in config
    finally:
        running.down()


def test_local_up_mints_and_opens_realtime_client_secrets_with_a_key_of_its_run(
    tmp_path: Path,
) -> None:
    key = "sk-local-test"
    balancer = {
        "sites": ["local"],
        "api_key_digests": [hashlib.sha256(key.encode()).hexdigest()],
        "client_secret_key": {"secure": "ciphertext-that-local-runs-never-read"},
    }
    running = LocalCluster(
        read_stack("t", {**CONFIG, "denv:balancer": balancer}),
        tmp_path / "run",
        free_port(),
    )
    running.up()
    try:
        key_file = Path(str(running.balancer_settings.client_secret_key_file))
        assert key_file.parent == running.directory and key_file.stat().st_mode & 0o077 == 0
        url = f"http://127.0.0.1:{running.port}"
        minted = httpx.post(
            f"{url}/v1/realtime/client_secrets",
            json={"session": {"model": "voice"}},
            headers={"Authorization": f"Bearer {key}"},
            timeout=5,
        )
        assert minted.status_code == 200, minted.text
        offered = [Subprotocol(p) for p in subprotocols(minted.json()["value"])]
        realtime = url.replace("http://", "ws://") + "/v1/realtime?model=voice"
        with connect(realtime, subprotocols=offered, open_timeout=5) as ws:
            assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
    finally:
        running.down()


def test_remote_sites_are_refused(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="runs local sites only"):
        LocalCluster(read_stack("t", valid_config()), tmp_path)


def test_demo_loses_nothing_and_replays_nothing(cluster: LocalCluster) -> None:
    lines: list[str] = []
    result = run_demo(cluster, lines.append, duration_s=9)
    assert result.requests > 100
    # Every line, whole: which pool lost what, and how, is the first thing a failure needs.
    assert result.lost == 0 and result.replayed == 0, "\n".join(lines)
    assert any("XID 79" in line for line in lines)
    # The realtime sessions on the dead replica saw their socket close and were served again.
    assert result.realtime_cut >= 1 and result.realtime_reconnect_max_ms is not None, lines
    assert any(line.startswith("pool voice (realtime): ") for line in lines)


@pytest.mark.timing
def test_status_command_reads_a_running_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "stacks").mkdir()
    (tmp_path / "Pulumi.yaml").write_text("name: t\nruntime: python\n")
    (tmp_path / "stacks" / "Pulumi.t.yaml").write_text(yaml.safe_dump({"config": CONFIG}))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    assert runner.invoke(main, ["local", "status", "--stack", "t"]).exit_code == 2
    port = str(free_port())
    up = runner.invoke(main, ["local", "up", "--stack", "t", "--port", port, "--detach", "--json"])
    try:
        assert up.exit_code == 0, up.output
        started = json.loads(up.stdout)
        assert started["endpoint"] == f"http://127.0.0.1:{port}" and len(started["replicas"]) == 4
        assert "control_token" not in started

        def status() -> tuple[int, dict[str, Any]]:
            shown = runner.invoke(main, ["local", "status", "--stack", "t", "--json"])
            pools = {p["pool"]: p for p in json.loads(shown.output)["pools"]}
            return shown.exit_code, dict(pools["voice"])

        # `up` returns once every process listens; HAProxy's first checks may still be under
        # way on a busy machine, and status reports (exit 1) what they said so far.
        deadline = time.monotonic() + 15
        code, voice = status()
        while code != 0 or voice["healthy"] < 2:
            assert time.monotonic() < deadline, (code, voice)
            time.sleep(0.1)
            code, voice = status()
        assert voice["healthy"] == 2 and voice["ok"], voice
    finally:
        down = runner.invoke(main, ["local", "down", "--stack", "t"])
    assert "stopped 7 processes" in down.output


class _Draws:
    """Stands in for the port chooser: hands out the given ports in turn."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = iter(ports)

    def randrange(self, low: int, high: int) -> int:
        port = next(self.ports)
        assert low <= port < high
        return port


def test_free_port_never_hands_out_a_port_twice_nor_one_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = int(taken.getsockname()[1])
        monkeypatch.setattr(processes, "LOWEST_PORT", 1024)
        monkeypatch.setattr(processes, "first_outgoing_port", lambda: 65536)
        monkeypatch.setattr(processes, "_HANDED_OUT", set())
        free = [free_port() for _ in range(3)]
        drawn = [free[0], free[0], taken_port, free[1], free[2]]
        monkeypatch.setattr(processes, "_CHOOSER", _Draws(drawn))
        monkeypatch.setattr(processes, "_HANDED_OUT", set())
        assert [free_port(), free_port()] == [free[0], free[1]]


def test_free_port_draws_below_the_kernel_s_outgoing_ports() -> None:
    # An outgoing connection takes its own port from that range, and may take a port drawn
    # there before its listener binds it.
    top = processes.first_outgoing_port()
    assert all(processes.LOWEST_PORT <= free_port() < top for _ in range(50))


@pytest.mark.parametrize(
    ("text", "first"), [("32768\t60999\n", 32768), ("20000 40000", 20000), ("", 32768)]
)
def test_the_outgoing_range_is_read_from_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, first: int
) -> None:
    (tmp_path / "range").write_text(text)
    monkeypatch.setattr(processes, "OUTGOING_PORTS", tmp_path / "range")
    assert processes.first_outgoing_port() == first


def test_a_kernel_that_gives_every_port_to_outgoing_connections_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processes, "first_outgoing_port", lambda: 1024)
    with pytest.raises(RuntimeError, match=r"sysctl net\.ipv4\.ip_local_port_range"):
        free_port()
