"""Busy is not broken on nodes: with the node agent's defaults a zombie engine is out of rotation
within 2 s, a full one never.

Each node's agent runs with the config file its node deploy writes (denv_iac.node.agent) for a
recipe with no engine setting, and HAProxy with the config every balancer host serves
(denv_iac.components.balancer: the stack's balancer settings, agent checks every agent-inter).
Only what the deploy fixes and this machine cannot give is moved: the replicas' and agents'
ports, the files under /etc and /var, and the GPUs (the agent's simulated NVML). The replicas are
the engine-shaped simulator serving vLLM's metrics.
"""

import dataclasses
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from denv_iac.core.balancer import render_haproxy_config
from denv_iac.core.balancer.files import relocate_maps
from denv_iac.core.dataplane import balancer_pools
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.placement import PlacedReplica, place_replicas
from denv_iac.core.stack.reader import read_stack
from denv_iac.haproxy.files import write_config
from denv_iac.haproxy.runtime import HaproxyProcess
from denv_iac.local.processes import free_port, wait_for_port
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.local.replica_sim import ReplicaProcess
from denv_iac.node import agent
from denv_iac.node.from_stack import node_deploy_specs
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.ops.demo import set_fault
from tests.engine_load import agent_reply, all_up, server_row, streaming, wait_for, watch_full
from tests.stacks import SECRET
from tests.timing import assert_within

pytestmark = pytest.mark.needs_haproxy

# The done-when goal: out of rotation within 2 s of the first stalled request.
ZOMBIE_OUT_S = 2.0
LOOPBACK = "127.0.0.1"
# Nothing about the engine: no engine, metrics_path, ttft_budget_ms or stall_timeout_ms.
CONFIG = {
    "denv:sites": [
        {
            "name": "office",
            "kind": "joined",
            "ssh_private_key": SECRET,
            "nodes": [
                {"name": f"rack-{n}", "address": f"192.0.2.{10 + n}", "gpu": "L40S", "gpus": 1}
                for n in (1, 2)
            ],
        }
    ],
    "denv:recipes": [
        {
            "name": "voice",
            "image": "vllm/vllm-openai:v0.11.0",
            "min_warm": 1,
            "spare": 1,
            "sites": ["office"],
            "max_concurrency": 4,
        }
    ],
    "denv:balancer": {"sites": ["office"]},
}


def _engine(replica_id: str, model: str) -> ReplicaSimConfig:
    """The engine behind a replica: two slots, so the balancer's four requests leave two queued
    in the engine; each stream (16 tokens, 30 ms apart) ends well inside the first-token budget.
    It serves vLLM's metric names."""
    return ReplicaSimConfig(
        replica_id, LOOPBACK, ttft_ms=20, itl_ms=30, tokens=16, engine="vllm", model=model, slots=2
    )


@dataclass(frozen=True)
class NodeStack:
    endpoint: str
    admin_socket: Path
    replicas: dict[str, ReplicaSimConfig]  # by replica id
    ports: dict[str, int]  # replica id -> its simulated engine's port
    agent_ports: dict[str, int]  # replica id -> its node agent's agent-check port


def _agent_ports() -> int:
    """A port free for the agent check with the next one free for the control endpoint (the
    deploy puts it at agent_port + 1)."""
    while True:
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind((LOOPBACK, port + 1))
            except OSError:
                continue
        return port


def _relocated(text: str, directory: Path) -> str:
    """The deploy's config text with its files under /etc and /var moved into `directory`."""
    for path, name in ((agent.STATE_FILE, "state.json"), (agent.TOKEN, "agent.token")):
        assert text.count(f'"{path}"') == 1, (path, text)
        text = text.replace(f'"{path}"', f'"{directory / name}"')
    return text


def _node_spec(spec: NodeDeploySpec, ports: dict[str, int], agent_port: int) -> NodeDeploySpec:
    """The node's spec with the ports of this machine; it listens on loopback, as a node on
    the overlay listens on its overlay address only."""
    replicas = tuple(dataclasses.replace(r, port=ports[r.id]) for r in spec.replicas)
    return dataclasses.replace(
        spec, replicas=replicas, agent_port=agent_port, listen_address=LOOPBACK
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeStack]:
    directory = tmp_path_factory.mktemp("node")
    spec = read_stack("t", CONFIG)
    placement = place_replicas(spec)
    (recipe,) = spec.recipes
    agents: list[subprocess.Popen[bytes]] = []
    replicas: dict[str, ReplicaProcess] = {}
    haproxy: HaproxyProcess | None = None
    try:
        for placed in placement.replicas:
            config = _engine(placed.id, recipe.model_names[0])
            replicas[placed.id] = process = ReplicaProcess(config, directory / f"{placed.id}.log")
            process.spawn()
        ports = {replica_id: p.wait_ready() for replica_id, p in replicas.items()}
        agent_ports: dict[str, int] = {}
        for node_id, node_spec in node_deploy_specs(spec, placement).items():
            here = _node_spec(node_spec, ports, _agent_ports())
            agent_ports.update({r.id: here.agent_port for r in here.replicas})
            node_dir = directory / node_id
            node_dir.mkdir()
            (node_dir / "agent.token").write_text("t" * 32)
            path = node_dir / "agent.toml"
            text = agent.config(here).content.decode()
            # The agent's own intervals (metrics every 250 ms): the deploy sets none by default.
            assert "[intervals]" not in text and 'engine = "auto"' in text, text
            path.write_text(_relocated(text, node_dir))
            command = [sys.executable, "-m", "denv_agent", "--config", str(path), "--simulate"]
            with (node_dir / "agent.log").open("ab") as log:
                agents.append(
                    subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                )
            wait_for_port(here.agent_port, f"agent of {node_id}", LOOPBACK)

        def locate(replica: PlacedReplica) -> tuple[str, int, int]:
            return LOOPBACK, ports[replica.id], agent_ports[replica.id]

        admin_socket = directory / "haproxy.sock"
        port = free_port()
        # The balancer hosts' settings; only where HAProxy listens and keeps its files is local.
        settings = dataclasses.replace(
            balancer_settings(spec),
            bind_address=LOOPBACK,
            port=port,
            stats_socket=str(admin_socket),
            prometheus_port=None,
            state_file=str(directory / "haproxy.state"),
        )
        maps = str(directory / "haproxy")
        rendered = render_haproxy_config(balancer_pools(spec, placement, locate), settings, maps)
        config_path = write_config(relocate_maps(rendered, maps), Path(maps))
        haproxy = HaproxyProcess(config_path, admin_socket, directory / "haproxy.log")
        haproxy.start()
        yield NodeStack(
            f"http://{LOOPBACK}:{port}",
            admin_socket,
            {replica_id: p.config for replica_id, p in replicas.items()},
            ports,
            agent_ports,
        )
    finally:
        if haproxy is not None:
            haproxy.stop()
        for agent_process in agents:
            agent_process.kill()
            agent_process.wait()
        for replica in replicas.values():
            replica.stop()


def _status(stack: NodeStack, replica_id: str) -> str:
    return server_row(stack.admin_socket, replica_id)["status"]


def _fault(stack: NodeStack, replica_id: str, mode: str) -> None:
    config = stack.replicas[replica_id]
    set_fault(f"http://{LOOPBACK}:{stack.ports[replica_id]}", config.control_token, mode)


def _reply(stack: NodeStack, replica_id: str) -> str:
    return agent_reply(LOOPBACK, stack.agent_ports[replica_id], replica_id)


def _all_up(stack: NodeStack) -> bool:
    return all_up(stack.admin_socket, list(stack.replicas))


def _engine_read(stack: NodeStack, replica_id: str) -> dict[str, Any] | None:
    """What the agent last read from the replica's engine metrics (its /healthz)."""
    port = stack.agent_ports[replica_id] + 1  # the deploy's control endpoint
    doc = httpx.get(f"http://{LOOPBACK}:{port}/healthz", timeout=5).json()
    (replica,) = [r for r in doc["replicas"] if r["id"] == replica_id]
    engine: dict[str, Any] | None = (replica["health"] or {}).get("engine")
    return engine


def test_the_node_agent_reads_the_engine_with_no_setting(stack: NodeStack) -> None:
    """What the deploy wrote is what the agent runs: the engine's metrics, known by vLLM's
    names with `engine: auto`."""
    wait_for("every replica up", lambda: _all_up(stack), 20)
    for replica_id in stack.replicas:
        assert _reply(stack, replica_id).startswith("up ready"), replica_id

        def read(replica_id: str = replica_id) -> bool:
            engine = _engine_read(stack, replica_id)
            return engine is not None and engine["running"] == 0

        wait_for("the engine's metrics read", read, 5)
        engine = _engine_read(stack, replica_id)
        assert engine is not None and engine["error"] is None, engine


@pytest.mark.timing
def test_a_zombie_is_out_of_rotation_within_2_s_with_the_node_defaults(stack: NodeStack) -> None:
    wait_for("every replica up", lambda: _all_up(stack), 20)
    zombie, peer = list(stack.replicas)
    with streaming(stack.endpoint, streams=2):
        # The clock starts with a stream running on it: the first stalled request is at once.
        wait_for(
            "a stream on the replica",
            lambda: int(server_row(stack.admin_socket, zombie)["scur"] or 0) > 0,
            5,
        )
        _fault(stack, zombie, "zombie")
        out_s = wait_for(
            "the zombie marked down",
            lambda: _status(stack, zombie).startswith("DOWN"),
            ZOMBIE_OUT_S + 3,
        )
        assert_within(out_s, ZOMBIE_OUT_S, "zombie replica out of rotation (node defaults)")
        assert _reply(stack, zombie).startswith("down #engine stalled")
        assert _status(stack, peer) == "UP"
        _fault(stack, zombie, "none")
        wait_for("the replica back up", lambda: _status(stack, zombie) == "UP", 5)
    assert _reply(stack, zombie).startswith("up ready")


@pytest.mark.timing
def test_a_full_replica_is_never_marked_down_with_the_node_defaults(stack: NodeStack) -> None:
    wait_for("every replica up", lambda: _all_up(stack), 20)
    replies, states = watch_full(
        stack.endpoint,
        list(stack.replicas),
        lambda r: _reply(stack, r),
        lambda r: _status(stack, r),
    )
    assert states == {"UP"}, states
    assert all(reply.startswith("up ready") for reply in replies), replies
    # The engine's queue was read: it lowered the weight.
    assert any(reply != "up ready 100%" for reply in replies), replies
