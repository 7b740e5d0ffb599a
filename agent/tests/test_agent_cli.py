"""The agent as a real process, its commands, and the smoke script's checks."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from denv_agent import cli, control, smoke
from denv_agent.agent import Agent
from denv_agent.config import to_toml
from denv_agent.nvml_double import FakeNvml
from denv_agent.process import AgentProcess, parse_ready

from agent.tests.agent_testkit import (
    TOKEN,
    ReplicaServer,
    ask,
    config_data,
    make_config,
    replica,
    running,
    wait_for,
)

R0 = "voice.local.node-a.0"


@pytest.fixture
def server() -> Iterator[ReplicaServer]:
    server = ReplicaServer()
    yield server
    server.close()


def _write(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(to_toml(data))
    return path


def test_simulated_agent_process_end_to_end(
    tmp_path: Path, server: ReplicaServer, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path,
        config_data(tmp_path, [replica(0, server.health_url), replica(1, server.health_url)]),
    )
    env = {**os.environ, "DENV_AGENT_TEST_MARK": "1"}
    with AgentProcess(path, simulate=True, env=env) as agent:
        assert b"\0DENV_AGENT_TEST_MARK=1\0" in Path(f"/proc/{agent.pid}/environ").read_bytes()

        def check(rid: str = R0) -> bytes:
            return ask(agent.agent_check, f"{rid}\n".encode())

        wait_for(check, b"up ready 100%\n")
        url = agent.http_url
        assert cli.main(["drain", "--replica", R0, "--config", str(path), "--url", url]) == 0
        assert "drained replicas: voice.local.node-a.0" in capsys.readouterr().out
        assert check() == b"drain #operator\n"
        assert cli.main(["--config", str(path), "undrain", "--url", url]) == 0
        assert check() == b"up ready 100%\n"
        control.inject_fault(url, TOKEN, gpu=1, xid=79)
        wait_for(check, b"down #xid 79 gpu fell off the bus\n")
        assert cli.main(["clear-faults", "--config", str(path), "--url", url]) == 0
        wait_for(lambda: check("voice.local.node-a.1"), b"up ready 100%\n")
        assert agent.stop() == 0
    log = "".join(agent.lines)
    assert "simulating 2 gpu(s)" in log and "stopping" in log and "Traceback" not in log


def test_control_commands_say_when_the_agent_is_not_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = config_data(tmp_path, [replica(0, "http://127.0.0.1:1/health")])
    data["listen"] = {"http": "127.0.0.1:1"}
    path = _write(tmp_path, data)
    assert cli.main(["drain", "--config", str(path)]) == 1
    assert "cannot reach the agent at http://127.0.0.1:1" in capsys.readouterr().err


def test_control_url_comes_from_the_config(tmp_path: Path) -> None:
    config = make_config(tmp_path, [replica(0, "http://x/h")], listen={"http": "0.0.0.0:9301"})
    assert control.control_url(config) == "http://127.0.0.1:9301"
    ephemeral = make_config(tmp_path, [replica(0, "http://x/h")])
    with pytest.raises(control.ControlFailed, match="port 0"):
        control.control_url(ephemeral)


def test_wrong_token_is_reported(tmp_path: Path) -> None:
    config = make_config(tmp_path, [replica(0, "http://127.0.0.1:1/h")])
    with running(config, FakeNvml(1)) as agent:
        assert agent.http is not None
        url = f"http://127.0.0.1:{agent.http.address[1]}"
        with pytest.raises(
            control.ControlFailed, match=r"missing or wrong control token \(http 401\)"
        ):
            control.drain(url, "not-the-token-at-all")


def test_a_taken_port_is_one_clear_line_and_exit_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        data = config_data(tmp_path, [replica(0, "http://127.0.0.1:1/h")])
        data["listen"] = {
            "agent_check": f"127.0.0.1:{taken.getsockname()[1]}",
            "http": "127.0.0.1:0",
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "denv_agent",
                "--config",
                str(_write(tmp_path, data)),
                "--simulate",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 1
    assert "cannot listen:" in result.stderr and "Traceback" not in result.stderr


def test_config_error_from_the_console_script(tmp_path: Path) -> None:
    path = _write(tmp_path, config_data(tmp_path, [{"id": R0, "gpu": 0}]))
    result = subprocess.run(
        [sys.executable, "-m", "denv_agent", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr == (
        'agent config: replicas[0].health_url: missing; add health_url = "http://127.0.0.1:8001/health"\n'
    )


class _LogLineBetweenWrites(io.StringIO):
    """stderr as another thread can make it: a log line lands after any write that does not end
    its line (the NVML thread logs its first reading as the agent announces it is ready)."""

    def write(self, text: str) -> int:
        written = super().write(text)
        if "ready:" in text and not text.endswith("\n"):
            super().write("2026-01-01 00:00:00 denv-agent INFO nvml: driver 580.95.05, 2 gpu(s)\n")
        return written


def test_the_ready_line_keeps_its_ports_when_another_thread_logs_as_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Agent] = []

    class Recorded(Agent):
        def start(self) -> None:
            super().start()
            started.append(self)

    handlers: dict[int, Callable[..., object]] = {}

    def stop_once_ready() -> None:
        # SIGTERM as the agent's handler gets it, once the agent has announced itself.
        while "ready:" not in stream.getvalue():
            time.sleep(0.01)
        handlers[signal.SIGTERM](signal.SIGTERM, None)

    stream = _LogLineBetweenWrites()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(cli, "Agent", Recorded)
    monkeypatch.setattr(cli.signal, "signal", handlers.__setitem__)
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **_: None)
    config = make_config(tmp_path, [replica(0, "http://127.0.0.1:9/health")])
    stopper = threading.Thread(target=stop_once_ready, daemon=True)
    stopper.start()
    assert cli._run(config, simulate=True, log_level="info") == 0
    stopper.join(5)
    [agent] = started
    assert agent.agent_check is not None and agent.http is not None
    lines = [line for line in stream.getvalue().splitlines() if "ready:" in line]
    assert [parse_ready(line) for line in lines] == [
        (agent.agent_check.address, agent.http.address)
    ]


def test_ready_line_parses() -> None:
    line = (
        "2026-01-01 denv-agent INFO ready: node n, agent-check 0.0.0.0:9300, http 127.0.0.1:9301\n"
    )
    assert parse_ready(line) == (("0.0.0.0", 9300), ("127.0.0.1", 9301))
    assert parse_ready("something else") is None


def test_smoke_without_nvml_exits_2_with_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(smoke, "real_nvml", lambda: FakeNvml(1, library_found=False))
    assert smoke.main([]) == 2
    err = capsys.readouterr().err
    assert "NVML is not usable here (nvml shared library not found)" in err


def test_smoke_checks_pass_on_healthy_gpus_and_catch_bad_ones(
    tmp_path: Path, server: ReplicaServer
) -> None:
    config = make_config(tmp_path, [replica(i, server.health_url) for i in range(2)])
    with running(config, FakeNvml(2)) as agent:
        wait_for(lambda: smoke._settled(agent.healthz(), 2), True)
        doc = agent.healthz()
    assert smoke.check(doc, 2) == []
    text = smoke.table(doc)
    assert "NVIDIA H100 80GB HBM3" in text and "registered" in text and "up ready 100%" in text
    doc["gpus"][1].update(temperature_c=None, xid_events="failed: not supported", uuid="?")
    assert smoke.check(doc, 3) == [
        "/healthz lists 2 gpu(s), nvml counts 3",
        "gpu 1: uuid '?'",
        "gpu 1: temperature None",
        "gpu 1: xid event registration failed: not supported",
    ]
