"""A balancer host and two nodes, one behind NAT, serving over the WireGuard overlay in VMs.

The stack is a real one (a balancer host made on an `aws` site, a `joined` office of two
machines, the second `behind_nat`) read and placed by the product, with the VMs' addresses as
the machines'. Its overlay plan gives each machine's denv0.conf (`render_config`, the private key
filled in by `with_private_key`), which the overlay area's own steps put live over SSH; the
balancer host is NodeSetup's provider, called as the engine calls it, with the HAProxy config the
stack renders for the replicas' overlay addresses. The replicas are the simulator, run on each
node's overlay address.

Every frame on the links between sites (node1's port on the bridge, the office NAT's public leg)
is captured while a marker goes through the balancer: the marker reaches the replicas (their
/stats count it) and never shows on those links. The same capture finds it when a request takes
a plain path to node1 (the negative control: the check can fail). node2 needs no inbound port:
the balancer has no endpoint for it and learns one from node2's own handshake, through the NAT.
"""

from __future__ import annotations

import http.client
import json
import secrets
import shlex
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from denv_iac.balancer import (
    BalancerPool,
    BalancerServer,
    BalancerTier,
    RenderedConfig,
    render_haproxy_config,
)
from denv_iac.components.balancer import balancer_settings
from denv_iac.components.node_setup import node_deploy_specs
from denv_iac.components.overlay import new_key_pair
from denv_iac.dataplane import balancer_pools
from denv_iac.local.netns import call_in
from denv_iac.node.balancer_host import CONFIG_DIR
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.overlay import INTERFACE, OverlayPlan, render_config, with_private_key
from denv_iac.placement import Placement
from denv_iac.plan import make_plan
from denv_iac.spec.model import StackSpec
from denv_iac.spec.reader import read_stack
from tests.dataplane.overlay_lab import Capture
from tests.vm.bed import HOST, NAT_ADDRESS, NAT_LINK, Bed, Vm
from tests.vm.conftest import TIMINGS
from tests.vm.debian_repo import offer_packages
from tests.vm.standin_vm import send_folder
from tests.vm.test_join import in_netns, provider

ROOT = Path(__file__).resolve().parents[2]
SECRET = {"secure": "v1:dGVzdC1jaXBoZXJ0ZXh0"}  # never read: the keys come from the bed
BALANCER_SITE, OFFICE = "fsn", "office"
ENDPOINT_PORT = 8080
PLAIN_PORT = 8100  # the negative control's replica, on node1's public address
SIM_IN_VM = "/opt/denv-sim"
# What the simulator imports, sent to the nodes as they are here.
SIM_MODULES = (
    "denv_iac/__init__.py",
    "denv_iac/local/__init__.py",
    "denv_iac/local/replica_sim.py",
    "denv_iac/local/voice_sim.py",
    "denv_iac/spec/__init__.py",
    "denv_iac/spec/model.py",
)
STREAMS = 8
TTFT_PAIRS = 10


def stack_config(node1: Vm, node2: Vm) -> dict[str, Any]:
    """A balancer host made on AWS in front of an office of two machines, one behind NAT."""
    access = {"admin_cidrs": [f"{HOST}/32"], "ssh_private_key": SECRET}
    machine = {"gpu": "L40S", "gpus": 1}
    return {
        "denv:sites": [
            {
                "name": BALANCER_SITE,
                "kind": "aws",
                "region": "eu-central-1",
                "instance_type": "p5.4xlarge",
                "max_nodes": 1,
                **access,
            },
            {
                "name": OFFICE,
                "kind": "joined",
                **access,
                "nodes": [
                    {"name": "node1", "address": node1.address, **machine},
                    {"name": "node2", "address": node2.address, "behind_nat": True, **machine},
                ],
            },
        ],
        "denv:recipes": [
            {
                "name": "voice",
                "min_warm": 2,
                "spare": 0,
                "image": "ghcr.io/acme/voice:1.4",
                "sites": [OFFICE],
            }
        ],
        "denv:balancer": {"sites": [BALANCER_SITE], "port": ENDPOINT_PORT},
    }


@dataclass
class Site:
    bed: Bed
    balancer: Vm
    nodes: dict[str, Vm]  # by node name
    stack: StackSpec
    placement: Placement
    overlay: OverlayPlan
    specs: dict[str, NodeDeploySpec]  # by node id
    hub: str  # the balancer host's overlay member name

    def overlay_address(self, node: str) -> str:
        return self.overlay.address_of(OFFICE, node)

    def replica_of(self, node: str) -> tuple[str, int]:
        """(id, port) of the one replica the stack places on `node`."""
        (replica,) = self.specs[f"{OFFICE}.{node}"].replicas
        return replica.id, replica.port


def put_overlay(bed: Bed, vm: Vm, config: str) -> list[str]:
    code, out, err = in_netns(
        bed, "tests.vm.overlay_call", {"host": vm.address, "key": str(bed.key), "config": config}
    )
    assert code == 0, err[-3000:]
    applied: list[str] = json.loads(out)
    return applied


def start_sim(vm: Vm, replica: str, address: str, port: int) -> None:
    """The simulated replica on `address` only, as a transient unit; back when it answers."""
    argv = [
        "systemd-run", f"--unit=denv-sim-{port}", f"--setenv=PYTHONPATH={SIM_IN_VM}",
        "python3", "-m", "denv_iac.local.replica_sim", "--id", replica, "--host", address,
        "--port", str(port), "--ttft-ms", "20", "--itl-ms", "5", "--tokens", "8",
    ]  # fmt: skip
    vm.ssh(" ".join(map(shlex.quote, argv)))
    health = f"curl -sf -o /dev/null http://{address}:{port}/health"
    vm.ssh(f"for _ in $(seq 100); do {health} && exit 0; sleep 0.2; done; exit 1")


def sim_stats(vm: Vm, address: str, port: int) -> dict[str, Any]:
    stats: dict[str, Any] = json.loads(vm.ssh(f"curl -sf http://{address}:{port}/stats"))
    return stats


def rendered_config(site: Site, node1: Vm) -> RenderedConfig:
    """The stack's HAProxy config with every replica at its node's overlay address, and one
    pool of the test's own (`plain`) at node1's public address: the negative control's path."""

    def locate(replica: Any) -> tuple[str, int, int]:
        spec = site.specs[f"{replica.site}.{replica.node}"]
        port = next(r.port for r in spec.replicas if r.id == replica.id)
        return site.overlay_address(replica.node), port, spec.agent_port

    pools = balancer_pools(site.stack, site.placement, locate)
    plain = BalancerServer("plain.office.node1.0", OFFICE, "node1", node1.address, PLAIN_PORT, 9100)
    control = BalancerPool("plain", (BalancerTier(10, (OFFICE,), (plain,)),))
    return render_haproxy_config([*pools, control], balancer_settings(site.stack), CONFIG_DIR)


@dataclass(frozen=True)
class Answer:
    status: int
    replica: str  # who served, from X-Denv-Replica
    ttft_s: float
    body: bytes


def stream(address: str, model: str, marker: str) -> Answer:
    """One streamed chat completion through the balancer, the marker in the prompt and as the
    request id (which the replica counts in its /stats)."""
    payload = json.dumps(
        {"model": model, "stream": True, "messages": [{"role": "user", "content": marker}]}
    )
    headers = {"Content-Type": "application/json", "X-Request-Id": marker}
    connection = http.client.HTTPConnection(address, ENDPOINT_PORT, timeout=30)
    try:
        sent = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", payload, headers)
        response = connection.getresponse()
        body, first = b"", None
        while chunk := response.read1(65536):
            body += chunk
            if first is None and b'"content"' in body:
                first = time.perf_counter()
        ttft = (first or time.perf_counter()) - sent
        return Answer(response.status, response.getheader("X-Denv-Replica", ""), ttft, body)
    finally:
        connection.close()


def streams(bed: Bed, balancer: Vm, calls: list[tuple[str, str]]) -> list[Answer]:
    """(model, marker) streams one after the other, from the test's side of the bridge."""
    return call_in(
        bed.netns, lambda: [stream(balancer.address, model, marker) for model, marker in calls]
    )


def captured(site: Site, calls: list[tuple[str, str]]) -> tuple[list[Capture], list[Answer]]:
    """Every frame on the links between sites while `calls` are served: node1's port on the
    bridge and the office NAT's public leg."""
    links = [Capture(site.bed.netns, site.nodes["node1"].tap), Capture(site.bed.netns, NAT_LINK)]
    try:
        answers = streams(site.bed, site.balancer, calls)
    finally:
        for link in links:
            link.stop()
    return links, answers


@pytest.fixture(scope="module")
def site(bed: Bed) -> Iterator[Site]:
    balancer = bed.start("balancer1")
    node1 = bed.start("node1")
    node2 = bed.start("node2", behind_nat=True)
    TIMINGS["three VMs (one behind NAT) boot to SSH"] = max(
        vm.wait_ssh() for vm in (balancer, node1, node2)
    )
    stack = read_stack("vm", stack_config(node1, node2))
    plan = make_plan(stack)
    hub = next(m.name for m in plan.overlay.members if m.hub)
    site = Site(
        bed,
        balancer,
        {"node1": node1, "node2": node2},
        stack,
        plan.placement,
        plan.overlay,
        node_deploy_specs(stack, plan.placement),
        hub,
    )
    assert {r.node for r in plan.placement.replicas} == {"node1", "node2"}

    start = time.monotonic()
    offer_packages(balancer, bed.workdir, "haproxy", "wireguard-tools")
    for vm in (node1, node2):
        offer_packages(vm, bed.workdir, "wireguard-tools")
    with tempfile.TemporaryDirectory() as tmp:
        for module in SIM_MODULES:
            (Path(tmp) / module).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / module).write_bytes((ROOT / module).read_bytes())
        for vm in (node1, node2):
            send_folder(vm, Path(tmp), SIM_IN_VM)
    TIMINGS["overlay stack: packages offered, simulator sent"] = time.monotonic() - start

    # The overlay: keys as the Overlay component makes them, configs as the plan renders them.
    keys = {m.name: new_key_pair() for m in plan.overlay.members}
    public_keys = {name: pair[1] for name, pair in keys.items()}
    machines = {hub: balancer, "office.node1": node1, "office.node2": node2}
    public = {name: vm.address for name, vm in machines.items()}
    start = time.monotonic()
    for name, vm in machines.items():  # the hub first: the nodes' first handshakes find it up
        config = render_config(plan.overlay, name, public_keys, public)
        applied = put_overlay(bed, vm, with_private_key(config, keys[name][0]))
        assert f"overlay: bring {INTERFACE} up" in applied, applied
    for node in ("node1", "node2"):
        # The node's sshd through the tunnel: the first packet makes the handshake (no ping in
        # the image).
        probe = shlex.quote(f"</dev/tcp/{site.overlay_address(node)}/22")
        balancer.ssh(
            f"for _ in $(seq 60); do timeout 2 bash -c {probe} 2>/dev/null && exit 0; done; exit 1"
        )
    TIMINGS["overlay up (three machines) to both nodes answering the balancer"] = (
        time.monotonic() - start
    )

    for node, vm in site.nodes.items():
        replica, port = site.replica_of(node)
        start_sim(vm, replica, site.overlay_address(node), port)
    start_sim(node1, "plain.office.node1.0", node1.address, PLAIN_PORT)

    rendered = rendered_config(site, node1)
    props = {
        "host": balancer.address,
        "ssh_user": "root",
        "ssh_private_key": bed.key.read_text(),
        "balancer": {
            "haproxy_config": rendered.haproxy_cfg,
            "map_files": dict(sorted(rendered.files.items())),
            "map_dir": rendered.map_dir,
        },
        "balancer_firewall": {"admin_cidrs": [f"{HOST}/32"], "stats_port": 8405},
        "applied": None,
    }
    start = time.monotonic()
    provider(bed, "create", props)
    TIMINGS["overlay stack: balancer host (provider create)"] = time.monotonic() - start
    yield site


def served_by(answers: list[Answer]) -> Counter[str]:
    for answer in answers:
        assert answer.status == 200 and answer.body.rstrip().endswith(b"data: [DONE]"), answer
    return Counter(answer.replica for answer in answers)


def wait_serving(site: Site, timeout_s: float = 120) -> float:
    """Seconds until a stream is served by each node's replica (HAProxy's first checks)."""
    start = time.monotonic()
    wanted = {site.replica_of(node)[0] for node in site.nodes}
    seen: set[str] = set()
    while True:
        for answer in streams(site.bed, site.balancer, [("voice", "warm-up")] * 2):
            if answer.status == 200:
                seen.add(answer.replica)
        if wanted <= seen:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"served only by {seen}"
        time.sleep(1)


@pytest.mark.vm
def test_the_stack_serves_over_the_overlay_and_the_links_carry_no_plaintext(site: Site) -> None:
    node2 = site.nodes["node2"]
    TIMINGS["overlay stack: first streams from both nodes"] = wait_serving(site)

    # The negative control: a plain path to node1, and the capture sees the marker.
    plain = f"denv-marker-{secrets.token_hex(8)}"
    links, answers = captured(site, [("plain", plain)])
    assert served_by(answers) == {"plain.office.node1.0": 1}
    assert plain.encode() in b"".join(links[0].frames), "the capture misses node1's plain text"

    # Over the overlay: both nodes serve, the replicas got every marker, the links show none.
    markers = [f"denv-marker-{secrets.token_hex(8)}" for _ in range(STREAMS)]
    links, answers = captured(site, [("voice", m) for m in markers])
    counts = served_by(answers)
    replicas = {node: site.replica_of(node) for node in site.nodes}
    assert set(counts) == {replica for replica, _ in replicas.values()}, counts
    received: dict[str, str] = {}
    for node, (replica, port) in replicas.items():
        stats = sim_stats(site.nodes[node], site.overlay_address(node), port)
        received |= {m: replica for m in markers if stats["by_request_id"].get(m) == 1}
    assert received == {m: a.replica for m, a in zip(markers, answers, strict=True)}
    frames = b"".join(frame for link in links for frame in link.frames)
    assert not [m for m in markers if m.encode() in frames], "a marker crossed in plain text"
    # Both links carried the streams, as WireGuard datagrams.
    body = min(len(a.body) for a in answers)
    tunnelled = [link.udp_payload_bytes(site.overlay.spec.port) for link in links]
    assert min(tunnelled) > body, tunnelled
    print(f"\nstreams per replica over the overlay: {dict(sorted(counts.items()))}")

    # node2 is dialled by nobody: the balancer's config has no endpoint for it, and the one
    # it uses is what node2's NAT showed it.
    hub_config = site.balancer.ssh(f"cat /etc/wireguard/{INTERFACE}.conf")
    assert hub_config.count("Endpoint = ") == 1, "only node1 is dialled"
    peers = dict(
        line.split("\t")[:2]
        for line in site.balancer.ssh(f"wg show {INTERFACE} endpoints").splitlines()
    )
    node2_key = node2.ssh(f"wg show {INTERFACE} public-key").strip()
    assert peers[node2_key].split(":")[0] == NAT_ADDRESS, peers
    handshakes = dict(
        line.split("\t")
        for line in site.balancer.ssh(f"wg show {INTERFACE} latest-handshakes").splitlines()
    )
    assert int(handshakes[node2_key]) > 0


@pytest.mark.vm
def test_ttft_through_the_overlay_and_on_a_direct_path(site: Site) -> None:
    """node1's replica over the overlay and node1's plain replica, interleaved, same run."""
    replica, _ = site.replica_of("node1")
    times: dict[str, list[float]] = {"overlay": [], "direct": []}
    while min(len(t) for t in times.values()) < TTFT_PAIRS:
        answers = streams(site.bed, site.balancer, [("plain", "t"), ("voice", "t"), ("voice", "t")])
        times["direct"].append(answers[0].ttft_s)
        times["overlay"] += [a.ttft_s for a in answers[1:] if a.replica == replica][:1]
    overlay, direct = (statistics.median(times[k][:TTFT_PAIRS]) for k in ("overlay", "direct"))
    print(
        f"\nTTFT p50 through the balancer VM to node1 ({TTFT_PAIRS} pairs): direct "
        f"{direct * 1000:.1f} ms, over the overlay {overlay * 1000:.1f} ms"
    )
    # TCG-emulated guests on a shared machine: a loose bound that still catches a tunnel that
    # stalls (a handshake per request, a lost keepalive).
    assert overlay - direct < 0.5
