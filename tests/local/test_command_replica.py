"""A recipe's `command` runs as the local replica: placeholders, readiness, one-line failures,
its process group stopped with it, and a local stack that runs it (not the simulator)."""

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from denv_iac.core.stack.command import render_command
from denv_iac.core.stack.reader import read_stack
from denv_iac.local.command_replica import CommandConfig, CommandReplica, CommandStartError
from denv_iac.local.processes import free_port, ours
from denv_iac.local.runner import LocalCluster
from denv_iac.local.stopping import stop_recorded
from tests.stacks import local_site

HTTP_SERVER = (sys.executable, "-m", "http.server", "{port}", "--bind", "{host}")


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (("srv", "--port", "{port}"), ("srv", "--port", "8123")),
        (("srv", "--listen={host}:{port}"), ("srv", "--listen=10.9.0.2:8123")),
        # Other braces are left as written: a JSON argument passes untouched.
        (("srv", '{"level": 3}', "{ports}"), ("srv", '{"level": 3}', "{ports}")),
        (("srv",), ("srv",)),
    ],
)
def test_placeholders_are_replaced_and_nothing_else(
    command: tuple[str, ...], expected: tuple[str, ...]
) -> None:
    assert render_command(command, port=8123, host="10.9.0.2") == expected


def config(command: tuple[str, ...], tmp_path: Path, **changes: object) -> CommandConfig:
    values: dict[str, object] = {
        "replica_id": "chat.local.node-a.0",
        "recipe": "chat",
        "command": command,
        "host": "127.0.0.1",
        "port": free_port(),
        "health_path": "/",
        "ready_timeout_s": 10.0,
        "workdir": str(tmp_path),
    }
    values.update(changes)
    return CommandConfig(**values)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_a_command_serves_on_the_port_it_was_given_and_stops_with_its_group(
    tmp_path: Path,
) -> None:
    # A shell that starts a child of its own, then runs the server: both go at stop().
    script = tmp_path / "serve.sh"
    script.write_text('sleep 300 & echo $! > child.pid\nexec "$@"\n')
    replica = CommandReplica(
        config(("sh", str(script), *HTTP_SERVER), tmp_path), tmp_path / "replica.log"
    )
    replica.spawn()
    port = replica.wait_ready()
    assert port == replica.config.port
    assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
    child = int((tmp_path / "child.pid").read_text())  # written in the workdir
    assert alive(child) and replica.pid is not None
    assert os.getpgid(child) == replica.pid  # its own group, led by the server
    assert ours(replica.pid, replica.config.mark)
    replica.stop()
    assert not replica.running
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the server's child outlived stop()"


def test_a_command_that_is_not_installed_is_one_line_naming_the_recipe(tmp_path: Path) -> None:
    replica = CommandReplica(config(("no-such-llm-server", "--port", "{port}"), tmp_path))
    with pytest.raises(CommandStartError) as raised:
        replica.spawn()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("recipe chat: command 'no-such-llm-server' cannot start")
    assert "install it or give its full path" in message


def test_a_command_that_exits_at_start_says_its_status_and_last_log_line(tmp_path: Path) -> None:
    failing = (sys.executable, "-c", "import sys; print('model file not found'); sys.exit(3)")
    replica = CommandReplica(config(failing, tmp_path), tmp_path / "replica.log")
    replica.spawn()
    with pytest.raises(CommandStartError) as raised:
        replica.wait_ready()
    message = str(raised.value)
    assert "\n" not in message
    assert "exited with status 3 before its health path answered" in message
    assert message.endswith(": model file not found")
    assert not replica.running


LOADING_SERVER = textwrap.dedent(
    """
    import sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    started = time.monotonic()
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            loading = time.monotonic() - started < float(sys.argv[2])
            if self.path == "/health":
                status, body = (503 if loading else 200), b"{}"
            else:
                status, body = 200, sys.argv[3].encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


def test_ready_only_once_health_answers_200_and_its_engine_metrics_read(tmp_path: Path) -> None:
    metrics = "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 0\n"
    command = (sys.executable, "-c", LOADING_SERVER, "{port}", "0.6", metrics)
    replica = CommandReplica(
        config(
            command,
            tmp_path,
            health_path="/health",
            metrics_names=("llamacpp:requests_processing",),
        )
    )
    replica.spawn()
    started = time.monotonic()
    try:
        replica.wait_ready()
        # Not before the model "loaded": /health answered 503 for 0.6 s.
        assert time.monotonic() - started >= 0.5
    finally:
        replica.stop()


def test_a_server_without_its_engine_metrics_is_never_ready(tmp_path: Path) -> None:
    command = (sys.executable, "-c", LOADING_SERVER, "{port}", "0", "no metrics here")
    replica = CommandReplica(
        config(
            command,
            tmp_path,
            health_path="/health",
            metrics_names=("vllm:num_requests_running",),
            ready_timeout_s=1.0,
        ),
        tmp_path / "replica.log",
    )
    replica.spawn()
    with pytest.raises(CommandStartError) as raised:
        replica.wait_ready()
    message = str(raised.value)
    assert "not ready within 1 s (/metrics answered 200 without its engine metrics)" in message
    assert "raise cold_start_budget_s" in message
    assert not replica.running


@pytest.mark.needs_haproxy
def test_a_local_stack_runs_the_recipes_command_not_the_simulator(tmp_path: Path) -> None:
    stack = read_stack(
        "t",
        {
            "denv:sites": [local_site("local", nodes=1, gpus=1)],
            "denv:recipes": [
                {
                    "name": "files",
                    "min_warm": 1,
                    "spare": 0,
                    "sites": ["local"],
                    "health_path": "/",
                    "engine": "none",
                    "command": list(HTTP_SERVER),
                }
            ],
            "denv:balancer": {"sites": ["local"]},
        },
    )
    (tmp_path / "hello.txt").write_text("served from the project folder\n")
    cluster = LocalCluster(stack, tmp_path / "run", free_port(), project=tmp_path)
    state = cluster.up()
    try:
        (replica,) = state.replicas
        assert replica.group and ours(replica.pid, replica.mark)
        # The replica is python's own file server, run in the project folder.
        direct = httpx.get(f"{replica.url}/hello.txt")
        assert direct.text == "served from the project folder\n"
        assert "SimpleHTTP" in direct.headers["server"]
        # A crash is restarted on the same port by the supervisor.
        old_pid, old_port = replica.pid, replica.port
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
            "restarted" in x for x in cluster.supervise()
        ):
            time.sleep(0.1)
        (again,) = cluster.state.replicas if cluster.state else ()
        assert again.pid != old_pid and again.port == old_port
        assert httpx.get(f"{again.url}/hello.txt").status_code == 200
        # `denv local down` of a detached stack finds it by what state.json records.
        pid = again.pid
        assert stop_recorded(tmp_path / "run") >= 2
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
    finally:
        cluster.down()
