"""Shared pieces for the agent tests: a stand-in model server, configs, a running agent."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from denv_agent.agent import Agent
from denv_agent.config import AgentConfig, parse, to_toml
from denv_agent.http_api import JsonHandler
from denv_agent.nvml_double import FakeNvml
from denv_agent.pod_resources import (
    ContainerDevices,
    ContainerResources,
    PodResources,
    PodResourcesSource,
)

TOKEN = "test-control-token-0123456789"

FAST_INTERVALS = {
    "gpu_poll_s": 0.05,
    "health_s": 0.05,
    "health_timeout_s": 0.3,
    "probe_s": 0.1,
    "probe_timeout_s": 1.0,
    "agent_check_read_timeout_s": 0.2,
}


class ReplicaServer:
    """A local model server: GET /health and a streamed POST /v1/chat/completions.

    health: "ok", "error" (503), "hang" (no answer until closed), "garbage" (not HTTP).
    stream: "ok" (`tokens` tokens: the first after ttft_s, then one every gap_s),
    "no_token" ([DONE] only), "error" (500).
    """

    def __init__(self) -> None:
        self.health = "ok"
        self.stream = "ok"
        self.ttft_s = 0.0
        self.tokens = 1
        self.gap_s = 0.0
        self.released = threading.Event()
        owner = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                mode = owner.health
                if mode == "hang":
                    owner.released.wait(10)
                    return
                if mode == "garbage":
                    self.wfile.write(b"\x00\xffthis is not http\r\n\r\n")
                    return
                self._send(200 if mode == "ok" else 503, b"{}", "application/json")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if owner.stream == "error":
                    self._send(500, b"{}", "application/json")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                role = {"choices": [{"delta": {"role": "assistant"}}]}
                self.wfile.write(f"data: {json.dumps(role)}\n\n".encode())
                self.wfile.flush()
                if owner.stream == "ok":
                    token = {"choices": [{"delta": {"content": "hi"}}]}
                    for index in range(owner.tokens):
                        owner.released.wait(owner.gap_s if index else owner.ttft_s)
                        self.wfile.write(f"data: {json.dumps(token)}\n\n".encode())
                        self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/health"

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@contextmanager
def replica_servers(count: int = 2) -> Iterator[list[ReplicaServer]]:
    """`count` local model servers, closed afterwards."""
    servers = [ReplicaServer() for _ in range(count)]
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


def closed_port() -> int:
    """A local port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def config_data(
    tmp_path: Path, replicas: list[dict[str, object]], **tables: Mapping[str, object]
) -> dict[str, object]:
    data: dict[str, object] = {
        "node": "node-a",
        "state_file": str(tmp_path / "state.json"),
        "control_token": TOKEN,
        "listen": {"agent_check": "127.0.0.1:0", "http": "127.0.0.1:0"},
        "intervals": {**FAST_INTERVALS, **tables.pop("intervals", {})},
    }
    data.update(tables)
    data["replicas"] = replicas
    return data


def make_config(
    tmp_path: Path, replicas: list[dict[str, object]], **tables: Mapping[str, object]
) -> AgentConfig:
    return parse(to_toml(config_data(tmp_path, replicas, **tables)))


def replica(n: int, health_url: str, **extra: object) -> dict[str, object]:
    return {"id": f"voice.local.node-a.{n}", "health_url": health_url, "gpu": n, **extra}


@contextmanager
def running(
    config: AgentConfig,
    nvml: FakeNvml,
    *,
    simulate: bool = False,
    pod_source: PodResourcesSource | None = None,
) -> Iterator[Agent]:
    agent = Agent(config, nvml, simulator=nvml if simulate else None, pod_source=pod_source)
    agent.start()
    try:
        yield agent
    finally:
        nvml.close()
        agent.stop()


GPU0 = "GPU-00000000-0000-0000-0000-000000000000"  # FakeNvml's first GPU


class PodTable:
    """The kubelet's pod list of one node: each named pod's server container holds one GPU."""

    def __init__(self, pods: Mapping[str, str], namespace: str = "denv") -> None:
        self.pods = dict(pods)  # pod -> GPU UUID
        self.namespace = namespace

    def list(self) -> tuple[PodResources, ...]:
        return tuple(
            PodResources(
                pod,
                self.namespace,
                (ContainerResources("server", (ContainerDevices("nvidia.com/gpu", (gpu,)),)),),
            )
            for pod, gpu in self.pods.items()
        )


@contextmanager
def kube_agent(
    tmp_path: Path, replicas: list[dict[str, object]], pods: Mapping[str, str]
) -> Iterator[Agent]:
    """A Kubernetes node's agent serving its pod endpoints on 127.0.0.1; `pods` are this node's
    (pod -> GPU UUID), other replicas' pods are elsewhere."""
    config = make_config(
        tmp_path,
        replicas,
        listen={"agent_check": "127.0.0.1:0", "http": "127.0.0.1:0", "pods": "127.0.0.1:0"},
        kubernetes={
            "namespace": "denv",
            "container": "server",
            "pod_resources_socket": str(tmp_path / "kubelet.sock"),
        },
    )
    with running(config, FakeNvml(1), pod_source=PodTable(pods)) as agent:
        yield agent


def pods_url(agent: Agent) -> str:
    assert agent.pod_api is not None
    host, port = agent.pod_api.address
    return f"http://{host}:{port}"


def ask(address: tuple[str, int], payload: bytes, *, half_close: bool = False) -> bytes:
    """One agent-check exchange, as HAProxy does it: connect, send, read to EOF."""
    with socket.create_connection(address, timeout=5) as s:
        if payload:
            s.sendall(payload)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks)


def reply(agent: Agent, replica_id: str) -> str:
    assert agent.agent_check is not None
    return ask(agent.agent_check.address, f"{replica_id}\n".encode()).decode()


def wait_for(
    probe: Callable[[], object], expected: object, timeout_s: float = 5.0, interval_s: float = 0.01
) -> None:
    """Wait until probe() == expected (or, for a callable `expected`, until it returns true)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if (expected(value) if callable(expected) else value == expected) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(interval_s)
    assert expected(value) if callable(expected) else value == expected, value


def http_get(agent: Agent, path: str) -> tuple[int, bytes]:
    assert agent.http is not None
    return http_call(agent.http.address, "GET", path)


def http_call(address: tuple[str, int], method: str, path: str) -> tuple[int, bytes]:
    """One request without a body: its status and body, errors included."""
    host, port = address
    request = urllib.request.Request(f"http://{host}:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_url(agent: Agent) -> str:
    assert agent.http is not None
    host, port = agent.http.address
    return f"http://{host}:{port}"
