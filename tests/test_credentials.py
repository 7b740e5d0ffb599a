"""No `denv` command sends a credential to a host it was not meant for.

Two records of every outgoing request. Listeners on 127.0.0.1 keep the head of each request they
get. And a wiretap on this process's sockets keeps every connection a command opens (TCP or Unix)
and every byte it sends on it, whatever the client library (httpx, urllib, websockets, asyncio):
so a request to a host no listener stands for is recorded too. The endpoint's API key goes to the
endpoint alone; a replica called directly (`denv bench --direct`), a balancer's stats page
(`denv status --endpoint`) and node agents get no credential at all; a local stack's control
token goes to its agents and replicas alone; commands that need no network (`denv plan`, its
resources preview with the provider clients mocked, `denv key digest`) open no connection; the
provider clients send their token to their provider's API alone and follow no redirect.
"""

import contextlib
import hashlib
import json
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from click.testing import CliRunner

from denv_iac.cli import main
from denv_iac.core.stack.reader import read_stack
from denv_iac.haproxy.runtime import stats_command
from denv_iac.lambda_api import API_URL as LAMBDA_URL
from denv_iac.lambda_api import LambdaApiError, LambdaClient
from denv_iac.local.processes import free_port
from denv_iac.local.rollout import ready_servers, roll_once, server_rows
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.loadgen_report import PROTOCOLS
from denv_iac.robot_api import API_URL as ROBOT_URL
from denv_iac.robot_api import RobotApiError, RobotClient
from tests.stacks import local_site

KEY = "sk-endpoint-only-4f1c"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
REFUSAL = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
CREDENTIAL_HEADERS = ("authorization", "proxy-authorization", "cookie", "x-api-key", "api-key")


@dataclass
class Recorder:
    """A listener that keeps the head of every request it gets and answers 503."""

    heads: list[bytes] = field(default_factory=list)
    sock: socket.socket = field(default_factory=socket.socket)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def serve(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            with connection:
                connection.settimeout(5)
                head = b""
                try:
                    while b"\r\n\r\n" not in head and (chunk := connection.recv(65536)):
                        head += chunk
                except OSError:
                    pass
                # Kept before the answer goes: once the command has its answer, the test may
                # read the heads.
                self.heads.append(head)
                with contextlib.suppress(OSError):
                    connection.sendall(REFUSAL)

    def headers(self) -> list[dict[str, str]]:
        """Each request's headers, names lowercased."""
        requests = []
        for head in self.heads:
            lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
            pairs = (line.partition(":") for line in lines if line)
            requests.append({name.strip().lower(): value.strip() for name, _, value in pairs})
        return requests


@pytest.fixture
def recorders() -> Iterator[tuple[Recorder, Recorder]]:
    pair = (Recorder(), Recorder())
    threads = []
    for recorder in pair:
        recorder.sock.bind(("127.0.0.1", 0))
        recorder.sock.listen(64)
        threads.append(threading.Thread(target=recorder.serve, daemon=True))
        threads[-1].start()
    yield pair
    for recorder, thread in zip(pair, threads, strict=True):
        recorder.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        recorder.sock.close()
        thread.join(timeout=5)


def denv(*args: str, stdin: bytes | None = None) -> str:
    result = CliRunner().invoke(main, list(args), env={"DENV_API_KEY": KEY}, input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.output


@dataclass
class Connection:
    """One connection this process opened: where to, and every byte sent on it."""

    peer: Any  # (host, port) for TCP, a path for a Unix socket
    sent: bytearray = field(default_factory=bytearray)

    @property
    def port(self) -> int | None:
        return self.peer[1] if isinstance(self.peer, tuple) else None


class Wiretap:
    """Patches socket.socket so that every connection made by this process, and every byte sent
    on it, is recorded. Sockets accepted by a listener are not connections made: left alone."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.connections: list[Connection] = []
        self._by_socket: weakref.WeakKeyDictionary[socket.socket, Connection] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        real = {name: getattr(socket.socket, name) for name in ("connect", "connect_ex")}
        real_send = {name: getattr(socket.socket, name) for name in ("send", "sendall")}

        def connecting(name: str) -> Any:
            def connect(sock: socket.socket, address: Any) -> Any:
                with self._lock:
                    self._by_socket[sock] = Connection(address)
                    self.connections.append(self._by_socket[sock])
                return real[name](sock, address)

            return connect

        def sending(name: str) -> Any:
            def send(sock: socket.socket, data: Any, *args: Any) -> Any:
                connection = self._by_socket.get(sock)
                if connection is not None:
                    connection.sent += bytes(data)
                return real_send[name](sock, data, *args)

            return send

        real_sendmsg = socket.socket.sendmsg

        def sendmsg(sock: socket.socket, buffers: Any, *args: Any) -> Any:
            connection = self._by_socket.get(sock)
            if connection is not None:
                connection.sent += b"".join(bytes(b) for b in buffers)
            return real_sendmsg(sock, buffers, *args)

        for name in real:
            monkeypatch.setattr(socket.socket, name, connecting(name))
        for name in real_send:
            monkeypatch.setattr(socket.socket, name, sending(name))
        monkeypatch.setattr(socket.socket, "sendmsg", sendmsg)

    def carrying(self, secret: str) -> list[Connection]:
        return [c for c in self.connections if secret.encode() in c.sent]

    def assert_only(self, secret: str, ports: set[int]) -> None:
        """`secret` went to these ports alone, and every connection stayed on this machine."""
        for connection in self.connections:
            assert connection.port is None or connection.peer[0] in LOOPBACK, connection.peer
        wrong = [c.peer for c in self.carrying(secret) if c.port not in ports]
        assert not wrong, f"a credential went to {wrong}"


@pytest.fixture
def tap(monkeypatch: pytest.MonkeyPatch) -> Wiretap:
    return Wiretap(monkeypatch)


def assert_no_credential(recorder: Recorder) -> None:
    assert recorder.heads, "the command sent nothing to this listener"
    for head, headers in zip(recorder.heads, recorder.headers(), strict=True):
        assert KEY.encode() not in head
        assert not set(CREDENTIAL_HEADERS) & set(headers), headers


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bench_sends_the_key_to_the_endpoint_alone(
    protocol: str, recorders: tuple[Recorder, Recorder], tap: Wiretap
) -> None:
    endpoint, replica = recorders
    denv("bench", endpoint.url, "--pool", "voice", "--protocol", protocol, "--requests", "4",
         "--concurrency", "1", "--quiet", "--direct", replica.url)  # fmt: skip
    assert endpoint.heads and all(
        h.get("authorization") == f"Bearer {KEY}" for h in endpoint.headers()
    )
    assert_no_credential(replica)
    tap.assert_only(KEY, {_port(endpoint.url)})
    assert {c.port for c in tap.connections} == {_port(endpoint.url), _port(replica.url)}
    assert tap.carrying(KEY)


def test_status_sends_no_credential_to_a_stats_page(
    recorders: tuple[Recorder, Recorder], tap: Wiretap
) -> None:
    balancer, _ = recorders
    denv("status", "--endpoint", balancer.url)
    assert_no_credential(balancer)
    tap.assert_only(KEY, set())
    assert {c.port for c in tap.connections} == {_port(balancer.url)}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _project(tmp_path: Path, config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A project with stack `t` holding `config`, as the working directory."""
    (tmp_path / "stacks").mkdir()
    (tmp_path / "Pulumi.yaml").write_text("name: t\nruntime: python\n")
    (tmp_path / "stacks" / "Pulumi.t.yaml").write_text(yaml.safe_dump({"config": config}))
    monkeypatch.chdir(tmp_path)


STACKS = Path(__file__).parent.parent / "stacks"


@pytest.mark.parametrize("stack", ["voice-multicloud", "k8s"])
def test_commands_that_need_no_network_open_no_connection(
    stack: str, tap: Wiretap, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan and its resources preview, whose providers are mocked (AWS, Lambda, Nebius,
    Hetzner with Robot, a joined site, Kubernetes, each with its credential in the stack),
    `key digest`, the stack's alerting rules and `doctor` on the stack."""
    assert "voice" in denv("plan", "--stack", stack, "--stacks-dir", str(STACKS))
    assert "voice" in denv("plan", "--stack", stack, "--stacks-dir", str(STACKS), "--resources")
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    assert denv("key", "digest", stdin=KEY.encode()).strip() == digest
    monkeypatch.chdir(STACKS.parent)  # alerts and doctor find the stacks from the project
    assert "DenvPoolBelowMinWarm" in denv("alerts", "--stack", stack)
    assert "haproxy" in denv("doctor", "--stack", stack)
    assert tap.connections == []


class FakeProvider:
    """A provider API that records every request and sends each one elsewhere (a redirect)."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def transport(self) -> httpx.MockTransport:
        def answer(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            return httpx.Response(307, headers={"Location": "https://elsewhere.example/v1"})

        return httpx.MockTransport(answer)


def test_provider_clients_send_their_token_to_their_api_alone() -> None:
    lambda_api, robot_api = FakeProvider(), FakeProvider()
    lambda_client = LambdaClient(KEY, transport=lambda_api.transport(), sleep=lambda _: None)
    # A redirect is an error, whichever: the client follows none.
    with lambda_client, pytest.raises((LambdaApiError, ValueError)):
        lambda_client.list_instances()
    robot = RobotClient("user", KEY, transport=robot_api.transport(), sleep=lambda _: None)
    with robot, pytest.raises(RobotApiError):
        robot.server_number("203.0.113.9")
    for fake, base in ((lambda_api, LAMBDA_URL), (robot_api, ROBOT_URL)):
        assert fake.requests
        assert {r.url.host for r in fake.requests} == {httpx.URL(base).host}
        assert all(r.url.scheme == "https" for r in fake.requests)
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in lambda_api.requests)
    assert all(KEY not in r.headers.get("authorization", "") for r in robot_api.requests)  # Basic
    assert all(r.headers["authorization"].startswith("Basic ") for r in robot_api.requests)


def _local_config(tokens: int = 2, spare: int = 0) -> dict[str, Any]:
    """Simulated replicas, one a local GPU, behind an endpoint that wants KEY."""
    voice = {"name": "voice", "min_warm": 1, "spare": spare, "sites": ["local"]}
    voice["simulate"] = {"ttft_ms": 5, "itl_ms": 1, "tokens": tokens}
    return {
        "denv:sites": [local_site("local", nodes=1 + spare, gpus=1)],
        "denv:recipes": [voice],
        "denv:balancer": {
            "sites": ["local"],
            "api_key_digests": [hashlib.sha256(KEY.encode()).hexdigest()],
        },
    }


@pytest.mark.needs_haproxy
def test_a_local_stack_keeps_each_credential_to_its_own_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tap: Wiretap
) -> None:
    """`local up`, `status`, `bench` (at the endpoint and --direct at a replica) and
    `local down` on a local stack with an API key: the key reaches the endpoint alone, the
    stack's control token the agents and replicas alone, and nothing leaves this machine."""
    _project(tmp_path, _local_config(), monkeypatch)
    port = free_port()
    state = json.loads(
        denv("local", "up", "--stack", "t", "--detach", "--json", "--port", str(port))
    )
    try:
        recorded = json.loads((tmp_path / ".denv" / "t" / "state.json").read_text())
        token = recorded["control_token"]
        agents = {agent["http_port"] for agent in recorded["agents"]}
        (replica,) = state["replicas"]
        direct = f"http://{replica['address']}:{replica['port']}"
        started = len(tap.connections)
        status = json.loads(denv("status", "--stack", "t", "--json"))
        assert status["ok"], status
        bench = denv("bench", state["endpoint"], "--pool", "voice", "--requests", "4",
                     "--concurrency", "1", "--quiet", "--direct", direct)  # fmt: skip
        # Reading the stack and loading it need no control token at all.
        assert not [c.peer for c in tap.connections[started:] if token.encode() in c.sent]
    finally:
        denv("local", "down", "--stack", "t")
    assert "requests 4 ok 4 errors {}" in bench, bench  # the endpoint took the key
    tap.assert_only(KEY, {port})
    tap.assert_only(token, {replica["port"], replica["agent_port"], *agents})
    endpoint_calls = [c for c in tap.connections if c.port == port]
    # Every request to the endpoint carried the key (a connection may send nothing: a port
    # check of `local up`).
    assert [c for c in endpoint_calls if c.sent]
    assert all(KEY.encode() in c.sent for c in endpoint_calls if c.sent)
    assert any(c.port == replica["port"] for c in tap.connections)  # --direct
    assert agents <= {c.port for c in tap.connections}  # status read the agents


@pytest.mark.needs_haproxy
def test_a_local_roll_keeps_the_control_token_to_agents_and_replicas(
    tmp_path: Path, tap: Wiretap
) -> None:
    """What the supervising `local up` runs when `denv local roll` asks it (roll_once): a
    replica drained, a new one warmed by a request sent to it directly, the old one stopped.
    The token goes to the stack's agents and replicas alone, the endpoint key nowhere."""
    port = free_port()
    cluster = LocalCluster(read_stack("t", _local_config(spare=1)), tmp_path / "run", port)
    cluster.up()
    try:
        assert cluster.state is not None
        token = cluster.state.control_token
        before = list(cluster.state.replicas)
        agents = {agent.http_port for agent in cluster.state.agents}
        admin = Path(cluster.state.admin_socket)
        deadline = time.monotonic() + 15
        while len(ready_servers(server_rows(stats_command(admin, "show stat")))) < len(before):
            assert time.monotonic() < deadline, "replicas not UP within 15 s"
            time.sleep(0.05)
        changed = read_stack("t", _local_config(tokens=3, spare=1))
        answer = roll_once(cluster, lambda: changed, lambda _: None)
        after = list(cluster.state.replicas)
    finally:
        cluster.down()
    assert (answer.code, answer.problems) == (0, []), answer.lines
    assert answer.lines[-1].startswith("rolled 2 replica(s)"), answer.lines
    ports = {p for r in (*before, *after) for p in (r.port, r.agent_port)}
    tap.assert_only(token, ports | agents)
    tap.assert_only(KEY, set())
    assert {c.port for c in tap.carrying(token)} == agents  # the roll drove every agent
    assert any(c.port in {r.port for r in after} for c in tap.connections)  # warmed directly


@pytest.mark.needs_haproxy
def test_local_demo_sends_the_key_to_the_endpoint_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tap: Wiretap
) -> None:
    """`local demo` on a stack with an API key: its chat and realtime traffic carries the key
    (DENV_API_KEY) to the endpoint and nowhere else; its faults reach replicas and agents
    with the stack's control token alone."""
    config = _local_config(tokens=8, spare=1)
    port = free_port()
    config["denv:balancer"]["port"] = port
    _project(tmp_path, config, monkeypatch)
    output = denv("local", "demo", "--stack", "t", "--duration", "9")
    assert "requests" in output, output
    endpoint_calls = [c for c in tap.connections if c.port == port and c.sent]
    assert endpoint_calls
    assert all(KEY.encode() in c.sent for c in endpoint_calls)
    tap.assert_only(KEY, {port})
