"""A whole agent: the NVML double, real replica servers, real sockets."""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from denv_agent import control
from denv_agent.agent import Agent
from denv_agent.config import AgentConfig
from denv_agent.nvml_double import FakeNvml

from agent.tests.agent_testkit import (
    TOKEN,
    ReplicaServer,
    http_get,
    http_url,
    make_config,
    replica,
    replica_servers,
    reply,
    running,
    wait_for,
)

R0, R1 = "voice.local.node-a.0", "voice.local.node-a.1"


@pytest.fixture
def replicas() -> Iterator[list[ReplicaServer]]:
    with replica_servers() as servers:
        yield servers


@pytest.fixture
def config(tmp_path: Path, replicas: list[ReplicaServer]) -> AgentConfig:
    return make_config(tmp_path, [replica(i, s.health_url) for i, s in enumerate(replicas)])


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(2)


@pytest.fixture
def agent(config: AgentConfig, fake: FakeNvml) -> Iterator[Agent]:
    with running(config, fake, simulate=True) as agent:
        wait_for(
            lambda: (reply(agent, R0), reply(agent, R1)), ("up ready 100%\n", "up ready 100%\n")
        )
        wait_for(lambda: agent.healthz()["gpus"][1]["xid_events"], "registered")
        yield agent


def _replies(agent: Agent) -> tuple[str, str]:
    return reply(agent, R0), reply(agent, R1)


@pytest.mark.parametrize(
    ("xid", "expected"),
    [
        (13, ("up ready 100%\n", "up ready 100%\n")),
        (94, ("up ready 100%\n", "up ready 100%\n")),
        (63, ("drain #xid 63 row remap pending\n", "up ready 100%\n")),
        (92, ("drain #xid 92 high single-bit ecc error rate\n", "up ready 100%\n")),
        (48, ("down #xid 48 double-bit ecc error\n", "up ready 100%\n")),
        (109, ("down #xid 109 context switch timeout\n", "up ready 100%\n")),
        (146, ("down #xid 146\n", "up ready 100%\n")),
        (79, ("down #xid 79 gpu fell off the bus\n", "down #xid 79 gpu fell off the bus\n")),
        (160, ("down #xid 160\n", "down #xid 160\n")),
        (999, ("up ready 100%\n", "up ready 100%\n")),
    ],
)
def test_each_xid_class_end_to_end(
    agent: Agent, fake: FakeNvml, xid: int, expected: tuple[str, str]
) -> None:
    fake.inject_xid(0, xid)
    wait_for(lambda: agent.healthz()["gpus"][0]["xids"], {str(xid): 1})
    assert _replies(agent) == expected
    _, metrics = http_get(agent, "/metrics")
    assert b'denv_agent_xid_events_total{class="' in metrics


@pytest.mark.timing
def test_critical_xid_leaves_rotation_within_half_a_second(agent: Agent, fake: FakeNvml) -> None:
    started = time.monotonic()
    fake.inject_xid(1, 79)
    wait_for(lambda: reply(agent, R0), "down #xid 79 gpu fell off the bus\n", interval_s=0.002)
    assert time.monotonic() - started < 0.5


def test_faults_are_sticky_until_an_operator_clears_them(agent: Agent, fake: FakeNvml) -> None:
    fake.inject_xid(0, 79)
    fake.lose_gpu(0)
    wait_for(lambda: reply(agent, R1), "down #xid 79 gpu fell off the bus\n")
    fake.repair(0)
    time.sleep(0.2)  # several polls of a now healthy GPU
    assert reply(agent, R1) == "down #xid 79 gpu fell off the bus\n"
    control.clear_faults(http_url(agent), TOKEN)
    wait_for(lambda: _replies(agent), ("up ready 100%\n", "up ready 100%\n"))


def test_lost_gpu_takes_its_replicas_down(agent: Agent, fake: FakeNvml) -> None:
    fake.lose_gpu(1)
    wait_for(lambda: _replies(agent), ("up ready 100%\n", "down #gpu lost\n"))
    assert "gpu lost" in agent.healthz()["gpus"][1]["reasons"]


def test_pending_remap_drains(agent: Agent, fake: FakeNvml) -> None:
    fake.set_pending_remap(0)
    wait_for(lambda: reply(agent, R0), "drain #pending row remap\n")
    fake.set_pending_remap(0, False)
    wait_for(lambda: reply(agent, R0), "up ready 100%\n")


def test_throttling_and_heat_lower_the_weight(agent: Agent, fake: FakeNvml) -> None:
    fake.throttle(0, "hw_thermal")
    wait_for(lambda: reply(agent, R0), "up ready 50%\n")
    doc = agent.healthz()
    assert doc["gpus"][0]["throttle"] == ["hw_thermal"]
    assert "throttled: hw thermal" in doc["replicas"][0]["reasons"]
    fake.throttle(0)
    fake.apply({"gpu": 0, "temperature_c": 90})
    wait_for(lambda: agent.healthz()["replicas"][0]["reasons"], ["temperature 90c, limit 85c"])
    assert reply(agent, R0) == "up ready 50%\n"


def test_mig_mode_change_takes_whole_gpu_replicas_down(agent: Agent, fake: FakeNvml) -> None:
    fake.set_mig_mode(1, current=False, pending=True)
    wait_for(lambda: reply(agent, R1), "drain #mig mode change pending on gpu 1\n")
    fake.set_mig_mode(1, current=True)
    wait_for(lambda: reply(agent, R1), "down #mig enabled on gpu 1, not as configured\n")


@pytest.mark.parametrize(
    ("mode", "reason"),
    [("error", "http 503"), ("hang", "timeout"), ("garbage", "bad response")],
)
def test_failing_replicas_go_down_after_three_failures(
    agent: Agent, replicas: list[ReplicaServer], mode: str, reason: str
) -> None:
    replicas[1].health = mode
    wait_for(lambda: reply(agent, R1), f"down #health check failed 3x: {reason}\n", timeout_s=8)
    assert reply(agent, R0) == "up ready 100%\n"
    replicas[1].health = "ok"
    wait_for(lambda: reply(agent, R1), "up ready 100%\n", timeout_s=8)


def test_a_stopped_replica_is_refused(agent: Agent, replicas: list[ReplicaServer]) -> None:
    replicas[0].close()
    wait_for(lambda: reply(agent, R0), "down #health check failed 3x: connection refused\n")


def test_slow_first_token_lowers_the_weight(tmp_path: Path, replicas: list[ReplicaServer]) -> None:
    probe = {"ttft_budget_ms": 100, "probe_model": "voice", "probe_interval_s": 0.05}
    config = make_config(tmp_path, [replica(0, replicas[0].health_url, **probe)])
    with running(config, FakeNvml(1)) as agent:
        wait_for(lambda: reply(agent, R0), "up ready 100%\n")
        wait_for(
            lambda: agent.healthz()["replicas"][0]["health"]["ttft_ms"], lambda v: v is not None
        )
        replicas[0].ttft_s = 0.2
        wait_for(lambda: reply(agent, R0), "up ready 50%\n")
        reasons = agent.healthz()["replicas"][0]["reasons"]
        assert reasons[0].startswith("ttft ") and reasons[0].endswith(" ms over 100 ms budget")
        _, metrics = http_get(agent, "/metrics")
        assert b'denv_agent_probe_ttft_seconds_count{replica="voice.local.node-a.0"}' in metrics
        replicas[0].ttft_s = 0.0
        wait_for(lambda: reply(agent, R0), "up ready 100%\n")


def _post(agent: Agent, path: str, body: object, token: str | None = TOKEN) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(
        f"{http_url(agent)}{path}", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"])
def test_control_needs_the_token(agent: Agent, token: str | None) -> None:
    assert _post(agent, "/control/drain", {}, token) == (
        401,
        {"error": "missing or wrong control token"},
    )
    assert _replies(agent) == ("up ready 100%\n", "up ready 100%\n")


def test_control_refuses_bad_requests(agent: Agent) -> None:
    assert _post(agent, "/control/drain", {"replica": "nobody"})[0] == 404
    assert _post(agent, "/control/drain", {"replica": 7})[0] == 400
    assert _post(agent, "/control/drain", [1])[0] == 400
    assert _post(agent, "/control/nothing", {})[0] == 404
    assert _post(agent, "/control/simulate", {"gpu": 0, "melt": 1}) == (
        400,
        {"error": "unknown fault 'melt'"},
    )


def test_drain_survives_a_restart(config: AgentConfig) -> None:
    with running(config, FakeNvml(2)) as agent:
        wait_for(lambda: reply(agent, R0), "up ready 100%\n")
        control.drain(http_url(agent), TOKEN, R0)
        assert _replies(agent) == ("drain #operator\n", "up ready 100%\n")
    with running(config, FakeNvml(2)) as agent:
        wait_for(lambda: reply(agent, R1), "up ready 100%\n")
        assert reply(agent, R0) == "drain #operator\n"
        control.drain(http_url(agent), TOKEN)
        assert _replies(agent) == ("drain #operator\n", "drain #operator\n")
        assert agent.healthz()["drains"] == {"node": True, "replicas": [R0], "stopping": []}
    with running(config, FakeNvml(2)) as agent:
        wait_for(lambda: reply(agent, R1), "drain #operator\n")
        control.undrain(http_url(agent), TOKEN)
        assert _replies(agent) == ("up ready 100%\n", "up ready 100%\n")
    assert json.loads(config.state_file.read_text()) == {
        "node_drained": False,
        "drained_replicas": [],
    }


def test_down_beats_drain(agent: Agent, fake: FakeNvml) -> None:
    control.drain(http_url(agent), TOKEN, R0)
    fake.lose_gpu(0)
    wait_for(lambda: reply(agent, R0), "down #gpu lost\n")
    assert agent.healthz()["replicas"][0]["reasons"] == ["gpu lost", "operator"]


def test_unwritable_state_file_refuses_the_drain(
    tmp_path: Path, replicas: list[ReplicaServer]
) -> None:
    (tmp_path / "blocker").write_text("a file where a directory should be")
    config = make_config(tmp_path, [replica(0, replicas[0].health_url)])
    config = dataclasses.replace(config, state_file=tmp_path / "blocker" / "state.json")
    with running(config, FakeNvml(1)) as agent:
        wait_for(lambda: reply(agent, R0), "up ready 100%\n")
        status, body = _post(agent, "/control/drain", {})
        assert status == 500 and "nothing changed" in str(body)
        assert reply(agent, R0) == "up ready 100%\n"


def test_unreadable_state_file_drains_until_undrained(config: AgentConfig) -> None:
    config.state_file.write_text("{not json")
    with running(config, FakeNvml(2)) as agent:
        wait_for(lambda: reply(agent, R0), "drain #state file unreadable\n")
        control.undrain(http_url(agent), TOKEN)
        wait_for(lambda: _replies(agent), ("up ready 100%\n", "up ready 100%\n"))


def test_simulate_endpoint_exists_only_in_simulate_mode(config: AgentConfig) -> None:
    with running(config, FakeNvml(2)) as agent:
        assert _post(agent, "/control/simulate", {"gpu": 0, "xid": 79})[0] == 404


def test_inject_fault_helper_drives_the_simulated_gpus(agent: Agent) -> None:
    assert control.inject_fault(http_url(agent), TOKEN, gpu=1, xid=48) == {"ok": True}
    wait_for(lambda: _replies(agent), ("up ready 100%\n", "down #xid 48 double-bit ecc error\n"))
    control.inject_fault(http_url(agent), TOKEN, gpu=0, remap_pending=True)
    wait_for(lambda: reply(agent, R0), "drain #pending row remap\n")


def test_healthz_and_metrics_describe_the_node(agent: Agent) -> None:
    status, body = http_get(agent, "/healthz")
    doc = json.loads(body)
    assert status == 200 and doc["node"] == "node-a" and doc["simulated"] is True
    assert doc["nvml"] == {
        "state": "ok",
        "error": None,
        "driver_version": "550.54.15",
        "gpu_count": 2,
    }
    assert [g["index"] for g in doc["gpus"]] == [0, 1]
    gpu = doc["gpus"][0]
    assert gpu["temperature_c"] == 45 and gpu["memory_total_bytes"] == 80 * 2**30
    assert gpu["xid_events"] == "registered" and gpu["reasons"] == []
    assert [(r["id"], r["state"], r["weight_pct"]) for r in doc["replicas"]] == [
        (R0, "up", 100),
        (R1, "up", 100),
    ]
    status, metrics = http_get(agent, "/metrics")
    for name in (
        b'denv_agent_gpu_temperature_celsius{gpu="0"',
        b"denv_agent_gpu_utilization_ratio",
        b"denv_agent_gpu_memory_used_bytes",
        b'denv_agent_replica_state{replica="voice.local.node-a.0",state="up"} 1.0',
        b"denv_agent_replica_weight_percent",
        b"denv_agent_nvml_up 1.0",
        b"process_resident_memory_bytes",
    ):
        assert name in metrics, name
    assert http_get(agent, "/nothing")[0] == 404
    assert http_get(agent, "/healthz?pretty=1")[0] == 200


def test_nvml_unavailable_is_said_once_and_every_replica_is_down(
    config: AgentConfig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with running(config, FakeNvml(2, library_found=False)) as agent:
        wait_for(lambda: _replies(agent), ("down #nvml unavailable\n", "down #nvml unavailable\n"))
        doc = agent.healthz()
        assert doc["nvml"]["state"] == "unavailable"
        assert doc["nvml"]["error"] == "nvml shared library not found"
        assert doc["reasons"] == ["nvml unavailable"]
        assert http_get(agent, "/metrics")[0] == 200
    lines = [r.getMessage() for r in caplog.records if "nvml unavailable" in r.getMessage()]
    assert len(lines) == 1 and "nvml shared library not found" in lines[0]


def test_nvml_errors_are_reasons_not_crashes(agent: Agent, fake: FakeNvml) -> None:
    fake.fail_call("nvmlDeviceGetTemperature", "NVMLError_Unknown", gpu=0)
    fake.fail_call("nvmlEventSetWait_v2", "NVMLError_Unknown")
    wait_for(lambda: agent.healthz()["gpus"][0]["reasons"], ["nvml temperature: unknown error"])
    assert _replies(agent) == ("up ready 100%\n", "up ready 100%\n")


def test_replies_stay_fast_while_every_nvml_call_takes_a_second(
    config: AgentConfig, replicas: list[ReplicaServer]
) -> None:
    fake = FakeNvml(2)
    fake.set_slowdown(1.0)  # from the start: even nvmlInit hangs
    with running(config, fake) as agent:
        wait_for(lambda: _replies(agent), ("up ready 100%\n", "up ready 100%\n"))
        latencies = []
        for n in range(300):
            started = time.perf_counter()
            assert reply(agent, (R0, R1)[n % 2]) == "up ready 100%\n"
            latencies.append(time.perf_counter() - started)
        p99 = statistics.quantiles(latencies, n=100)[98]
        assert p99 < 0.050, f"p99 {p99 * 1000:.1f} ms"
        assert agent.healthz()["nvml"]["state"] == "initializing"
