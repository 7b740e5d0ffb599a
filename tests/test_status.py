"""`denv status` and `denv bench` against a real local data plane (as `denv local up` runs it)."""

import http.server
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result
from denv_agent.control import inject_fault

from benchmarks.lab.waiting import eventually
from denv_iac.cli import main
from denv_iac.core.stack.reader import read_stack
from denv_iac.local.processes import AGENT_MARK, HAPROXY_MARK, free_port, ours
from denv_iac.local.run_state import RunState, run_dir
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.status import (
    AGENT_UNREACHABLE,
    AgentEndpoint,
    AgentHealth,
    haproxy_reason,
    pool_statuses,
    read_agents,
    replica_statuses,
    site_distances,
    with_agent_health,
)
from tests.stacks import local_site

# Two nodes, one voice replica each, both needed: losing a node puts the pool below min_warm.
CONFIG = {
    "denv:sites": [local_site("local", nodes=2, gpus=1)],
    "denv:recipes": [
        {
            "name": "voice",
            "min_warm": 2,
            "spare": 0,
            "sites": ["local"],
            "simulate": {"ttft_ms": 20, "itl_ms": 2, "tokens": 4},
        }
    ],
    "denv:balancer": {"sites": ["local"]},
}


def row(status: str, last_agt: str = "") -> dict[str, str]:
    """A `show stat` row as HAProxy writes it, reduced to the fields status reads."""
    return {
        "pxname": "voice.tier10",
        "status": status,
        "weight": "100",
        "scur": "0",
        "last_agt": last_agt,
    }


def test_reason_is_the_agents_word() -> None:
    assert haproxy_reason({"last_agt": "via agent : down (xid 79 gpu fell off the bus)"}) == (
        "xid 79 gpu fell off the bus"
    )
    assert haproxy_reason({"last_agt": "via agent : up"}) == ""
    assert haproxy_reason({"last_chk": "Layer4 connection problem"}) == "Layer4 connection problem"


def test_replicas_are_placed_by_their_id() -> None:
    [replica] = replica_statuses({"voice.aws-use1.n3.0": row("UP")})
    assert (replica.pool, replica.site, replica.node, replica.healthy) == (
        "voice",
        "aws-use1",
        "n3",
        True,
    )


@pytest.mark.parametrize(
    ("checks", "measured"),
    [
        ({"voice.local.n0.0": "312", "voice.local.n1.0": "300"}, 150.0),  # the quicker
        ({"voice.local.n0.0": "0", "voice.local.n1.0": ""}, 0.0),  # one not checked yet
        ({"voice.local.n0.0": "", "voice.local.n1.0": ""}, None),
    ],
)
def test_a_sites_round_trip_is_half_its_quickest_health_check(
    checks: dict[str, str], measured: float | None
) -> None:
    rows = {name: row("UP") | {"check_duration": ms} for name, ms in checks.items()}
    stack = read_stack("t", CONFIG)
    [distance] = site_distances(stack, replica_statuses(rows))
    # A local site runs on the balancer's machine: the stack's round trip for it is 0.
    assert (distance.site, distance.measured_round_trip_ms, distance.stated_round_trip_ms) == (
        "local",
        measured,
        0.0,
    )
    [unjudged] = site_distances(None, replica_statuses(rows))
    assert unjudged.stated_round_trip_ms is None


def test_unreachable_agent_is_said_and_haproxy_keeps_its_word() -> None:
    replicas = replica_statuses(
        {
            "voice.local.n0.0": row("DOWN (agent)", "via agent : down (gpu lost)"),
            "voice.local.n1.0": row("UP", "via agent : up"),
        }
    )
    agents = [
        AgentHealth("local/n0", "http://127.0.0.1:1", False, "connection refused", {}),
        AgentHealth(
            "local/n1",
            "http://127.0.0.1:2",
            True,
            "",
            {"voice.local.n1.0": {"reasons": [], "health": {"ttft_ms": 41.5}}},
        ),
    ]
    down, up = with_agent_health(replicas, agents)
    assert down.reason == f"gpu lost; {AGENT_UNREACHABLE}" and down.probe_ttft_ms is None
    assert up.reason == "" and up.probe_ttft_ms == 41.5


@pytest.mark.parametrize(
    ("engine", "running", "waiting"),
    [
        # As an agent reads a llama.cpp server: 2 decoding, 1 waiting inside it.
        ({"running": 2.0, "waiting": 1.0, "generation_tokens": 40.0, "error": None}, 2.0, 1.0),
        # A failed read shows no figures, not the last ones as if current.
        ({"running": 2.0, "waiting": 1.0, "error": "timed out"}, None, None),
        (None, None, None),  # an agent that reads no engine metrics
    ],
)
def test_the_engines_own_figures_come_from_its_agent(
    engine: dict[str, object] | None, running: float | None, waiting: float | None
) -> None:
    [replica] = replica_statuses({"voice.local.n1.0": row("UP", "via agent : up")})
    doc = {"voice.local.n1.0": {"reasons": [], "health": {"engine": engine}}}
    [merged] = with_agent_health([replica], [AgentHealth("local/n1", "u", True, "", doc)])
    assert (merged.engine_running, merged.engine_waiting) == (running, waiting)


def test_pools_without_a_stack_are_never_judged() -> None:
    replicas = replica_statuses({"side.local.n0.1.0": row("DOWN")})
    [pool] = pool_statuses(None, replicas)
    assert (pool.pool, pool.healthy, pool.min_warm, pool.ok) == ("side", 0, None, True)


@pytest.mark.timing
def test_a_silent_agent_never_hangs_the_read() -> None:
    # Connections land in the backlog and are never answered: the read must give up on time.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        [agent] = read_agents([AgentEndpoint("local/n0", url)], timeout_s=0.3)
    assert time.monotonic() - start < 1.5
    assert not agent.reachable and agent.error == "timed out"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"<html>not json</html>", "Expecting value"),
        (b'{"replicas": "everything is fine"}', "string indices must be integers"),
        (b'{"replicas": [{"name": "no id"}]}', "'id'"),
        (b"[1, 2, 3]", "'list' object has no attribute 'get'"),
    ],
)
def test_a_malformed_agent_reply_is_reported_never_raised(body: bytes, error: str) -> None:
    class Reply(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Reply)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        [agent] = read_agents([AgentEndpoint("local/n0", url)])
    finally:
        server.shutdown()
        server.server_close()
    assert not agent.reachable and error in agent.error and agent.replicas == {}
    merged = with_agent_health([replica_statuses({"voice.local.n0.0": row("UP")})[0]], [agent])
    assert merged[0].reason == AGENT_UNREACHABLE and merged[0].healthy


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "stacks").mkdir()
    (tmp_path / "Pulumi.yaml").write_text("name: t\nruntime: python\n")
    (tmp_path / "stacks" / "Pulumi.t.yaml").write_text(yaml.safe_dump({"config": CONFIG}))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def running(project: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(read_stack("t", CONFIG), run_dir(project, "t"), free_port())
    cluster.up()
    yield cluster
    cluster.down()


def status(*args: str) -> Result:
    return CliRunner().invoke(main, ["status", *args])


def first_status(holds: Callable[[Result], bool], timeout_s: float, *args: str) -> Result:
    """The first `denv status ARGS` that `holds`, asked every 0.1 s; past `timeout_s` the test
    fails showing the last one."""
    last: list[Result] = []

    def answered() -> bool:
        last[:] = [status(*args)]
        return holds(last[0])

    eventually(
        answered,
        timeout_s,
        f"the awaited `denv status {' '.join(args)}`",
        interval_s=0.1,
        detail=lambda: last[0].output,
    )
    return last[0]


def wait_for_healthy(count: int, timeout_s: float = 5.0) -> Result:
    def healthy(result: Result) -> bool:
        return bool(json.loads(result.output)["pools"][0]["healthy"] == count)

    return first_status(healthy, timeout_s, "--stack", "t", "--json")


def wait_gone(pid: int, mark: str) -> None:
    eventually(lambda: not ours(pid, mark), 10, f"{mark} (pid {pid}) ended")


def test_bad_input_exits_2_with_one_line(project: Path) -> None:
    def refused(args: list[str], words: str) -> None:
        result = status(*args)
        assert result.exit_code == 2, result.output
        assert words in result.output and result.output.count("\n") == 1

    refused(["--stack", "t"], "t is not running here")
    refused(["--stack", "nope"], "no Pulumi.nope.yaml")
    refused(["--admin-socket", str(project / "missing.sock")], "cannot read the balancer's stats")
    run_dir(project, "t").mkdir(parents=True)
    (run_dir(project, "t") / "state.json").write_text("{")
    refused(["--stack", "t"], "state.json line 1 column 2: not JSON (Expecting property name")


# Both replicas in rotation, each taking the default max_concurrency of 32, and no load.
IDLE = {"slots_in_use": 0, "queued": 0, "spilled": 0, "shed": 0, "saturated": False}
HEALTHY_IDLE_VOICE = {
    "pool": "voice",
    "healthy": 2,
    "min_warm": 2,
    "saturation": {"pool": "voice", "slots": 64, **IDLE},
    "versions": [],  # no canary
    "canary_pool": None,
    "ok": True,
}


@pytest.mark.needs_haproxy
def test_status_of_a_running_stack_then_xid_79(running: LocalCluster) -> None:
    state = running.state
    assert isinstance(state, RunState)
    healthy = wait_for_healthy(2)
    assert healthy.exit_code == 0, healthy.output
    document = json.loads(healthy.output)
    assert document["pools"] == [HEALTHY_IDLE_VOICE]
    assert {a["node"]: a["reachable"] for a in document["agents"]} == {
        "local/n0": True,
        "local/n1": True,
    }

    node = state.agent_of("local/n0")
    inject_fault(f"http://127.0.0.1:{node.http_port}", state.control_token, gpu=0, xid=79)
    degraded = wait_for_healthy(1)
    assert degraded.exit_code == 1, degraded.output
    replicas = {r["id"]: r for r in json.loads(degraded.output)["replicas"]}
    assert replicas["voice.local.n0.0"]["state"].startswith("DOWN")
    assert "xid 79" in replicas["voice.local.n0.0"]["reason"]

    table = status("--stack", "t")
    assert table.exit_code == 1
    assert "xid 79" in table.output
    assert "pool voice: 1 healthy, min_warm 2: BELOW MIN_WARM" in table.output
    # The replica out of rotation takes its slots with it.
    assert "pool voice: slots 0/32 in use, 0 queued;" in table.output

    # The same balancer read through its socket alone: no stack, so no verdict on min_warm.
    bare = status("--admin-socket", state.admin_socket)
    assert bare.exit_code == 0 and "min_warm unknown" in bare.output


@pytest.mark.timing
@pytest.mark.needs_haproxy
def test_an_agent_that_is_gone_is_shown_as_such(running: LocalCluster) -> None:
    state = running.state
    assert state is not None
    wait_for_healthy(2)
    agent = state.agent_of("local/n1")
    os.kill(agent.pid, signal.SIGTERM)
    wait_gone(agent.pid, AGENT_MARK)
    start = time.monotonic()
    result = status("--stack", "t", "--json")
    assert time.monotonic() - start < 3
    agents = {a["node"]: a for a in json.loads(result.output)["agents"]}
    assert not agents["local/n1"]["reachable"] and agents["local/n0"]["reachable"]
    replicas = {r["id"]: r for r in json.loads(result.output)["replicas"]}
    assert AGENT_UNREACHABLE in replicas["voice.local.n1.0"]["reason"]
    # Failing open is never silent: the command fails, one line for the agent.
    assert result.exit_code == 1
    problems = json.loads(result.output)["problems"]
    # One line for the gone agent. On a loaded machine a check of the other node can time out
    # meanwhile: its pool's line, or "not heard by the balancer's agent checks" for the live
    # agent, may then join it (both seen in full-suite runs); nothing else may.
    (line,) = [p for p in problems if p.startswith("agent of local/n1 ")]
    transient = ("pool voice:", "agent of local/n0 not heard by the balancer's agent checks")
    assert all(p.startswith(transient) for p in problems if p != line), problems
    assert line.startswith("agent of local/n1 at http://127.0.0.1:")
    assert line.endswith(
        ": connection refused: its GPU faults go unseen, its replicas are routed on health"
        " checks alone"
    )
    # Through the balancer's stats page (no agent is asked), its agent checks say the same.
    remote = first_status(
        lambda result: "FAILED agent of local/n1" in result.output,
        5,
        *("--stack", "t", "--endpoint", metrics_address(state)),
    )
    assert remote.exit_code == 1
    assert "FAILED agent of local/n1 not heard by the balancer's agent checks" in remote.output
    # Nothing else but the same transient as above: the live agent's check timing out meanwhile.
    failed = [
        f.strip().removeprefix("FAILED").strip()
        for f in remote.output.split("FAILED", 1)[1].splitlines()
    ]
    assert all("local/n0" not in f or f.startswith(transient[1]) for f in failed), failed


@pytest.mark.needs_haproxy
def test_a_dead_balancer_fails_the_status_with_one_line(running: LocalCluster) -> None:
    state = running.state
    assert state is not None
    wait_for_healthy(2)
    os.killpg(state.haproxy_pid, signal.SIGKILL)
    wait_gone(state.haproxy_pid, HAPROXY_MARK)
    result = status("--stack", "t")
    assert result.exit_code == 1
    assert result.output == (
        f"error: balancer of t (pid {state.haproxy_pid}) is not running: the endpoint "
        f"{state.endpoint} is down; a foreground `denv local up` restarts it\n"
    )


def metrics_address(state: RunState) -> str:
    return state.prometheus.removesuffix("/metrics")


@pytest.mark.needs_haproxy
def test_status_of_a_remote_balancer_through_its_stats_page(running: LocalCluster) -> None:
    state = running.state
    assert state is not None
    wait_for_healthy(2)
    remote = status("--stack", "t", "--endpoint", metrics_address(state), "--json")
    assert remote.exit_code == 0, remote.output
    document = json.loads(remote.output)
    assert document["pools"] == [HEALTHY_IDLE_VOICE]
    assert document["agents"] == []  # agent ports are open only to balancer hosts
    node = state.agent_of("local/n1")
    inject_fault(f"http://127.0.0.1:{node.http_port}", state.control_token, gpu=0, xid=79)
    # Until the fault shows: on a loaded machine an agent check may go unanswered first, which
    # fails the status too, for another reason.
    table = first_status(
        lambda result: "xid 79" in result.output,
        15,
        *("--stack", "t", "--endpoint", metrics_address(state)),
    )
    assert table.exit_code == 1 and "xid 79" in table.output
    assert "(remote: node agents are not read)" in table.output
    assert "pool voice: 1 healthy, min_warm 2: BELOW MIN_WARM" in table.output
    # The replica out of rotation takes its slots with it.
    assert "pool voice: slots 0/32 in use, 0 queued;" in table.output


def test_a_bad_endpoint_exits_2_with_one_line(project: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    for args, words in (
        (["--endpoint", "ftp://203.0.113.5"], "is not an http(s) URL"),
        (["--endpoint", f"http://127.0.0.1:{port}"], "connection refused"),
        (["--endpoint", "http://127.0.0.1:1", "--admin-socket", "x.sock"], "pass one of them"),
    ):
        result = status(*args)
        assert result.exit_code == 2, result.output
        assert words in result.output and result.output.count("\n") == 1, result.output


@pytest.mark.needs_haproxy
def test_bench_through_the_local_endpoint_measures_the_simulated_ttft(
    running: LocalCluster, tmp_path: Path
) -> None:
    state = running.state
    assert state is not None
    wait_for_healthy(2)
    summary_file = tmp_path / "bench.json"
    args = [state.endpoint, "--pool", "voice", "--requests", "60", "--concurrency", "4"]
    result = CliRunner().invoke(
        main, ["bench", *args, "--session-turns", "3", "--json", str(summary_file)]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(summary_file.read_text())
    assert summary["requests"] == 60 and summary["ok"] == 60 and summary["errors"] == {}
    # The simulator sleeps its configured 20 ms before the first token: never faster, and the
    # balancer adds well under a millisecond, so the median stays near it even on a busy machine.
    simulated = CONFIG["denv:recipes"][0]["simulate"]["ttft_ms"]
    assert simulated <= summary["ttft_p50_ms"] <= summary["ttft_p90_ms"] <= summary["ttft_p99_ms"]
    assert summary["ttft_p50_ms"] < simulated * 3
    assert summary["itl_mean_ms"] >= CONFIG["denv:recipes"][0]["simulate"]["itl_ms"] * 0.9
    assert set(summary["replicas"]) == {"voice.local.n0.0", "voice.local.n1.0"}
