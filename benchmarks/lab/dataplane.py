"""A real data plane on 127.0.0.1: simulated replicas, a real HAProxy, a stand-in agent.

Used by the data-plane tests and the data-plane benchmark. Everything started here is stopped
by pid in Dataplane.close(), which the fixtures call whatever the test outcome.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from denv_agent.verdict import Verdict

from benchmarks.lab.waiting import eventually
from denv_iac.core.balancer import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    render_haproxy_config,
)
from denv_iac.core.balancer.model import connect_timeout_for
from denv_iac.core.stack.model import (
    FIRST_TOKEN_TIMEOUT_MS,
    MAX_CONCURRENCY,
    STALL_TIMEOUT_MS,
)
from denv_iac.haproxy.files import write_config
from denv_iac.haproxy.runtime import HaproxyProcess, server_stats
from denv_iac.local.processes import free_port
from denv_iac.local.replica_model import ReplicaSimConfig, control_headers
from denv_iac.local.replica_sim import ReplicaProcess

# What the real agent says of a healthy replica.
AGENT_UP = Verdict("up", 100, ()).reply
# Latency of the simulated replicas unless a test asks otherwise; replica_id is set per replica.
FAST_REPLICA = ReplicaSimConfig("template", ttft_ms=20, itl_ms=5, tokens=8)
# A stream (or utterance) long enough to be caught in flight: 40 tokens, or 20 ms audio frames,
# 50 ms apart.
LONG_STREAMS = ReplicaSimConfig("template", ttft_ms=20, itl_ms=50, tokens=40)
# The harness's pools keep the recipe defaults: these are their budgets, in seconds.
FIRST_TOKEN_S = FIRST_TOKEN_TIMEOUT_MS / 1000
STALL_S = STALL_TIMEOUT_MS / 1000


@dataclass(frozen=True)
class PoolLayout:
    name: str
    tiers: tuple[tuple[int, tuple[str, ...]], ...]  # (priority, sites), most preferred first
    session_affinity: bool = True
    models: tuple[str, ...] = ()  # aliases, as a recipe's `models:` list gives them
    # The recipe's capacity and silence budgets (the stack's defaults unless a test sets them).
    max_concurrency: int = MAX_CONCURRENCY
    first_token_timeout_ms: int = FIRST_TOKEN_TIMEOUT_MS
    stall_timeout_ms: int = STALL_TIMEOUT_MS
    queue_budget_ms: int | None = None
    # From the balancer to the tiers' sites, as a stack states it: every site here is on this
    # machine, as a local site is (0). None: unknown, the settings' connect timeout.
    round_trip_ms: float | None = 0.0


# Two home sites and one failover site for voice; llm lives on a site voice may not use.
STANDARD_POOLS = (
    PoolLayout("voice", ((10, ("home-a", "home-b")), (20, ("fallback",)))),
    PoolLayout("llm", ((10, ("elsewhere",)),), session_affinity=False),
)
STANDARD_REPLICAS = (
    "voice.home-a.n0.0",
    "voice.home-b.n1.0",
    "voice.fallback.n2.0",
    "llm.elsewhere.n3.0",
)


class _AgentCheckServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class AgentStandIn:
    """Answers HAProxy's agent checks as the node agent would: one line per poll for the
    replica named by agent-send. Tests choose the reply per replica."""

    def __init__(self) -> None:
        self._replies: dict[str, str] = {}
        self._lock = threading.Lock()
        self.polls: Counter[str] = Counter()
        stand_in = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                replica_id = self.rfile.readline(256).decode(errors="replace").strip()
                with stand_in._lock:
                    stand_in.polls[replica_id] += 1
                    reply = stand_in._replies.get(replica_id, AGENT_UP)
                # HAProxy may have given up on this check (a timeout, a reload) already.
                with contextlib.suppress(ConnectionError):
                    self.wfile.write(reply.encode() + b"\n")

        self._server = _AgentCheckServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def set_reply(self, replica_id: str, reply: str) -> None:
        with self._lock:
            self._replies[replica_id] = reply

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class SimulatedReplica:
    replica_id: str
    process: ReplicaProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.process.port}"

    @property
    def pool(self) -> str:
        return self.replica_id.split(".")[0]

    @property
    def site(self) -> str:
        return self.replica_id.split(".")[1]

    @property
    def node(self) -> str:
        return self.replica_id.split(".")[2]

    def fault(self, mode: str, k: int = 0) -> None:
        response = httpx.post(
            f"{self.url}/control/fault",
            json={"mode": mode, "k": k},
            headers=control_headers(self.process.config.control_token),
            timeout=2,
        )
        response.raise_for_status()

    def kill(self) -> None:
        """The replica process dies: its port refuses and its connections reset."""
        self.process.stop()

    def restart(self) -> None:
        """A fresh process on the same port."""
        self.process.spawn()
        self.process.wait_ready()

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/stats", timeout=2)
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats


class Dataplane:
    """Replicas + HAProxy + agent stand-in, started together; close() stops them all."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.agent = AgentStandIn()
        self.replicas: dict[str, SimulatedReplica] = {}
        self.haproxy: HaproxyProcess | None = None
        self.settings = BalancerSettings()

    @classmethod
    def start(
        cls,
        workdir: Path,
        pools: Sequence[PoolLayout] = STANDARD_POOLS,
        replica_ids: Sequence[str] = STANDARD_REPLICAS,
        sim: ReplicaSimConfig = FAST_REPLICA,
        **settings: Any,
    ) -> Dataplane:
        workdir.mkdir(parents=True, exist_ok=True)
        plane = cls(workdir)
        try:
            plane._start_replicas(replica_ids, sim)
            plane._start_haproxy(pools, settings)
            plane.wait_until(plane.all_up, timeout_s=10, what="every server up")
        except BaseException:
            plane.close()
            raise
        return plane

    def _start_replicas(self, replica_ids: Sequence[str], sim: ReplicaSimConfig) -> None:
        for replica_id in replica_ids:
            config = dataclasses.replace(sim, replica_id=replica_id)
            process = ReplicaProcess(config, log_path=self.workdir / f"{replica_id}.log")
            self.replicas[replica_id] = SimulatedReplica(replica_id, process)
            process.spawn()
        for replica in self.replicas.values():
            replica.process.wait_ready()

    def _start_haproxy(self, layouts: Sequence[PoolLayout], settings: dict[str, Any]) -> None:
        self.settings = BalancerSettings(
            **{
                "bind_address": "127.0.0.1",
                "port": free_port(),
                "stats_socket": str(self.workdir / "haproxy.sock"),
                "prometheus_port": None,
                **settings,
            }
        )
        pools = [self._balancer_pool(layout) for layout in layouts]
        rendered = render_haproxy_config(pools, self.settings, str(self.workdir))
        config_path = write_config(rendered, self.workdir)
        self.haproxy = HaproxyProcess(
            config_path, Path(self.settings.stats_socket), self.workdir / "haproxy.log"
        )
        self.haproxy.start()

    def _balancer_pool(self, layout: PoolLayout) -> BalancerPool:
        tiers = []
        for priority, sites in layout.tiers:
            servers = tuple(
                BalancerServer(
                    replica_id=replica.replica_id,
                    site=replica.site,
                    node=replica.node,
                    address="127.0.0.1",
                    port=replica.process.port,
                    agent_port=self.agent.port,
                )
                for replica in self.replicas.values()
                if replica.pool == layout.name and replica.site in sites
            )
            connect = (
                None if layout.round_trip_ms is None else connect_timeout_for(layout.round_trip_ms)
            )
            tiers.append(BalancerTier(priority, sites, servers, connect))
        return BalancerPool(
            layout.name,
            tuple(tiers),
            layout.session_affinity,
            layout.first_token_timeout_ms,
            layout.stall_timeout_ms,
            layout.models,
            layout.max_concurrency,
            layout.queue_budget_ms,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def client(self, timeout_s: float = 5.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout_s)

    def status(self) -> dict[str, str]:
        """HAProxy's status of each server (UP, DOWN, DRAIN, ...), by replica id."""
        assert self.haproxy is not None
        return {
            name: row["status"] for name, row in server_stats(self.haproxy.stats_socket).items()
        }

    def all_up(self) -> bool:
        assert self.haproxy is not None
        rows = server_stats(self.haproxy.stats_socket)
        # UP alone is HAProxy's optimistic start state: wait for a passed health check too.
        return len(rows) == len(self.replicas) and all(
            row["status"] == "UP" and row["check_status"] == "L7OK" for row in rows.values()
        )

    def wait_until(
        self, predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.01
    ) -> float:
        """Poll until `predicate` holds; returns the seconds it took. A failure shows HAProxy's
        status of each server."""
        return eventually(predicate, timeout_s, what, interval_s, detail=self.status)

    def total_requests(self, request_id: str) -> int:
        """How many times any live replica received the request with this id."""
        return sum(
            replica.stats()["by_request_id"].get(request_id, 0)
            for replica in self.replicas.values()
            if replica.process.running
        )

    def close(self) -> None:
        if self.haproxy is not None:
            self.haproxy.stop()
        for replica in self.replicas.values():
            replica.process.stop()
        self.agent.close()


@dataclass
class StreamOutcome:
    status: int
    replica: str | None  # X-Denv-Replica, as set by the balancer
    chunks: list[dict[str, Any]]
    done: bool  # the stream ended with data: [DONE]
    error: str | None  # why the stream broke off, if it did
    first_token_s: float | None
    elapsed_s: float
    body: bytes = b""  # the body of a non-streamed (error) answer


def stream_chat(
    client: httpx.Client,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    chunks: list[dict[str, Any]] | None = None,
) -> StreamOutcome:
    """POST a streamed chat completion and record what came back, and when; `chunks`, when
    given, fills as they arrive, for a test that waits on a stream in flight."""
    started = time.monotonic()
    chunks = [] if chunks is None else chunks
    first_token_s: float | None = None
    done = False
    error: str | None = None
    with client.stream(
        "POST", "/v1/chat/completions", json={"stream": True, **body}, headers=headers
    ) as response:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                for event in _sse_events(response.iter_lines()):
                    if first_token_s is None:
                        first_token_s = time.monotonic() - started
                    if event == "[DONE]":
                        done = True
                    else:
                        chunks.append(json.loads(event))
            except httpx.TransportError as broken:
                error = f"{type(broken).__name__}: {broken}"
            content = b""
        else:
            content = response.read()
    return StreamOutcome(
        status=response.status_code,
        replica=response.headers.get("x-denv-replica"),
        chunks=chunks,
        done=done,
        error=error,
        first_token_s=first_token_s,
        elapsed_s=time.monotonic() - started,
        body=content,
    )


def _sse_events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def session_replica(
    plane: Dataplane, session: dict[str, str], model: str = "voice"
) -> SimulatedReplica:
    """The replica of `model`'s pool that serves the conversation `session` (an
    X-Denv-Session header)."""
    with plane.client() as client:
        outcome = stream_chat(client, {"model": model, "max_tokens": 1}, session)
    assert outcome.replica is not None
    return plane.replicas[outcome.replica]


class Frozen:
    """SIGSTOP, as a hung GPU process or a wedged engine looks from outside; thawed on exit."""

    def __init__(self, replica: SimulatedReplica) -> None:
        self.pid = replica.process.pid
        assert self.pid is not None

    def __enter__(self) -> float:
        assert self.pid is not None
        os.kill(self.pid, signal.SIGSTOP)
        return time.monotonic()

    def thaw(self) -> float:
        assert self.pid is not None
        os.kill(self.pid, signal.SIGCONT)
        return time.monotonic()

    def __exit__(self, *_: object) -> None:
        self.thaw()
