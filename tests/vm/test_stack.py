"""A whole stack on VMs, under load: a balancer host with TLS on in front of a `joined` site of two
GPU machines, each replica the simulator run by its own systemd unit.

The stack is read and placed by the product; each machine's inputs come from the same pure
functions the components call (`node_deploy_specs`, `balancer_pools`, `balancer_settings`,
`render_haproxy_config`), with the VMs' addresses as the machines'; NodeSetup's provider puts
them on the VMs as the engine calls it. Then, each under load through the TLS endpoint (the
product's load generator, every request counted): traffic reaches both nodes; a replica killed
with SIGKILL comes back by systemd; a node rebooted comes back in rotation by itself; every repair
level, run as an operator runs `denv node repair`; a second run of every deploy changes nothing;
delete leaves no unit, rule or mount. After each fault the pool is back at full strength (every
server UP in HAProxy) before the next.

Counted per fault: lost (a request that failed although healthy replicas were left), cut (a
started stream ended early: reported to its client as cut) and replayed (a cut stream that a
replica received again, by the replicas' own request logs).

The nodes have no Docker: a stand-in `docker` (diverted in place of the package's) runs a
container's command on the host, as host networking would see it, with its env file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import pytest
import websockets

from denv_iac.core.balancer import RenderedConfig, render_haproxy_config
from denv_iac.core.balancer.model import CONFIG_DIR
from denv_iac.core.balancer.stats import parse_stats_csv
from denv_iac.core.dataplane import balancer_pools
from denv_iac.core.endpoint import balancer_settings, endpoint_url
from denv_iac.core.placement import PlacedReplica, Placement
from denv_iac.core.plan import make_plan
from denv_iac.core.stack.model import StackSpec
from denv_iac.core.stack.reader import read_stack
from denv_iac.node.from_stack import node_deploy_specs
from denv_iac.node.spec import NodeDeploySpec, spec_to_json
from denv_iac.ops.demo import count_replayed
from denv_iac.ops.loadgen_report import StreamResult
from tests.node import standin
from tests.vm.bed import HOST, Bed, Vm
from tests.vm.conftest import TIMINGS
from tests.vm.debian_repo import offer_packages
from tests.vm.standin_vm import make_gpu_machine, send_folder
from tests.vm.test_balancer_host import API_KEY, Tls, make_tls, stats_socket
from tests.vm.test_join import provider

ROOT = Path(__file__).resolve().parents[2]
SECRET = {"secure": "v1:dGVzdC1jaXBoZXJ0ZXh0"}  # never read: the values come from the bed
BALANCER_SITE, OFFICE = "edge", "office"
NODES = ("node1", "node2")
ENDPOINT_PORT = 8443
POOL = "voice"
IMAGE = "denv-sim:vm"
SIM_IN_VM = "/opt/denv-sim"
# The recipe's command: the simulator on the port the deploy gives the replica ($PORT), at a
# voice stream's pace (a chunk every 20 ms).
COMMAND = (
    "sh",
    "-c",
    'exec python3 -m denv_iac.local.replica_sim --id "replica-$PORT" --host 0.0.0.0'
    ' --port "$PORT" --ttft-ms 20 --itl-ms 20 --tokens 8',
)
# The bed's machines are emulated (TCG: three VMs and the load on two cores), so a connect, a
# health check or a gap between chunks takes up to seconds where a real machine takes
# milliseconds. With the production timers (80 ms connect, 500 ms check, 1 s silence) a replica
# left serving while its peer is away is marked down for being slow (HAProxy logs: check past
# 500 ms, connect past 80 ms), the pool empties for moments and the endpoint answers 503. The
# stack's `timers` and the recipe's silence budgets are set for the bed's speed, so that only the
# faults under test take a replica out; the production values are tested where the machine is
# real (tests/dataplane). A connect past its timeout on live traffic marks that replica down at
# once (observe layer4): with 1 s, while a node booted, 11 requests got HAProxy's 503 within
# 1.3 s, the first after 1.1 s and the rest at once, as when both replicas of the node left
# serving are marked down by one slow connect each. So the bed's connect timeout is 3 s.
BED_TIMERS = {"connect_timeout_ms": 3000, "check_timeout_ms": 2000, "check_inter_ms": 2000}
# The node agents check their replicas' health too, and with the production 1 s timeout a
# starved machine marked replicas that no fault touched DOWN (agent) three at once during a
# roll (`health check failed 3x: timeout`), cutting their sessions: the same slack as the
# balancer's checks, for the same reason.
BED_AGENT = {"intervals": {"health_timeout_s": 2.0, "health_s": 2.0}}
BED_SILENCE_MS = 5000
CONCURRENCY = 4
FULL_STRENGTH_S = 300.0
MACHINES = ("balancer", *NODES)
CUT_ERRORS = ("aborted", "closed")

pytestmark = pytest.mark.vm

# Docker for these nodes: `run` execs the container's command on the host with the container's
# env (its --env-file and -e values) and the simulator's code on the path; the rest only echo.
_DOCKER = r"""#!/bin/sh
[ "$1" = run ] || { echo docker "$@"; exit 0; }
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --env-file) set -a; . "$2"; set +a; shift 2 ;;
    -e) export "$2"; shift 2 ;;
    --name|-v|-p) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
shift
export PYTHONPATH=@SIM@
exec "$@"
"""


def stack_config(nodes: dict[str, Vm], recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    """A balancer host made on AWS, TLS on and API keys checked, in front of an office of two
    machines of two GPUs each; the overlay off. `recipe`: fields that replace the pool's."""
    access = {"admin_cidrs": [f"{HOST}/32"], "ssh_private_key": SECRET}
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
                    {"name": name, "address": vm.address, "gpu": "L40S", "gpus": 2}
                    for name, vm in nodes.items()
                ],
            },
        ],
        "denv:recipes": [
            {
                "name": POOL,
                "min_warm": 4,
                "spare": 0,
                "image": IMAGE,
                "command": list(COMMAND),
                "sites": [OFFICE],
                "first_token_timeout_ms": BED_SILENCE_MS,
                "stall_timeout_ms": BED_SILENCE_MS,
                **(recipe or {}),
            }
        ],
        "denv:balancer": {
            "sites": [BALANCER_SITE],
            "port": ENDPOINT_PORT,
            "tls_certificate": SECRET,
            "api_key_digests": [hashlib.sha256(API_KEY.encode()).hexdigest()],
            "overlay": {"enabled": False},
            "timers": BED_TIMERS,
        },
    }


@dataclass
class Stack:
    spec: StackSpec
    bed: Bed
    balancer: Vm
    nodes: dict[str, Vm]  # by node name
    specs: dict[str, NodeDeploySpec]  # by node name
    rendered: RenderedConfig
    tls: Tls
    url: str
    ids: dict[str, str] = field(default_factory=dict)  # provider ids, by machine
    state: dict[str, dict[str, Any]] = field(default_factory=dict)  # provider outs, by machine

    @property
    def replicas(self) -> dict[str, tuple[str, int]]:
        """(node name, port) of every replica, by id."""
        return {r.id: (n, r.port) for n, spec in self.specs.items() for r in spec.replicas}

    def node_inputs(self, name: str) -> dict[str, Any]:
        """What NodeSetup registers for the node (see NodeSetup.__init__)."""
        data = spec_to_json(self.specs[name])
        return {
            "host": self.nodes[name].address,
            "ssh_user": "root",
            "ssh_private_key": self.bed.key.read_text(),
            "node": {k: v for k, v in data.items() if k != "balancer_addresses"},
            "balancer_addresses": [self.balancer.address],
            "applied": None,
        }

    def balancer_inputs(self) -> dict[str, Any]:
        """What GlobalBalancer registers for the balancer host."""
        return {
            "host": self.balancer.address,
            "ssh_user": "root",
            "ssh_private_key": self.bed.key.read_text(),
            "balancer": {
                "haproxy_config": self.rendered.haproxy_cfg,
                "map_files": dict(sorted(self.rendered.files.items())),
                "map_dir": self.rendered.map_dir,
            },
            "tls_certificate": self.tls.pem,
            "balancer_firewall": {
                "admin_cidrs": list(self.spec.site(BALANCER_SITE).admin_cidrs),
                "stats_port": self.spec.balancer.prometheus_port,
            },
            "applied": None,
        }

    def inputs(self, machine: str) -> dict[str, Any]:
        return self.balancer_inputs() if machine == "balancer" else self.node_inputs(machine)

    def servers(self) -> dict[str, dict[str, str]]:
        """HAProxy's server rows of the pool, by replica id."""
        rows = parse_stats_csv(stats_socket(self.balancer, "show stat"))
        return {name: row for name, row in rows.items() if name in self.replicas}

    def at_full_strength(self) -> bool:
        rows = self.servers()
        return set(rows) == set(self.replicas) and all(
            row["status"] == "UP" for row in rows.values()
        )

    def wait(self, done: Callable[[], bool], what: str, limit_s: float = FULL_STRENGTH_S) -> float:
        """Seconds until `done` holds; fails naming `what` and HAProxy's view past `limit_s`."""
        start = time.monotonic()
        while not done():
            if time.monotonic() - start > limit_s:
                states = {k: v["status"] for k, v in self.servers().items()}
                raise AssertionError(f"{what}: not within {limit_s:.0f} s; servers {states}")
            time.sleep(0.5)
        return time.monotonic() - start

    def seen_by_replicas(self) -> dict[str, list[str]]:
        """Request id -> the live replicas that received it (their own /stats), per receipt."""
        seen: dict[str, list[str]] = {}
        for replica, (node, port) in self.replicas.items():
            out = self.nodes[node].ssh(
                f"curl -sf --max-time 5 http://127.0.0.1:{port}/stats", check=False
            )
            if not out:
                continue  # gone (killed, rebooted): its log with it
            for request_id, count in json.loads(out)["by_request_id"].items():
                seen.setdefault(request_id, []).extend([replica] * int(count))
        return seen


def _prepare_node(bed: Bed, vm: Vm, sim: Path) -> None:
    folder = bed.workdir / vm.name  # its own: the nodes are prepared at once
    folder.mkdir()
    make_gpu_machine(vm, folder)
    send_folder(vm, sim, SIM_IN_VM)
    docker = _DOCKER.replace("@SIM@", SIM_IN_VM)
    vm.ssh(
        "dpkg-divert --local --rename --divert /usr/bin/docker.standin --add /usr/bin/docker"
        f" >/dev/null && cat > /usr/bin/docker <<'EOF'\n{docker}EOF\n chmod 0755 /usr/bin/docker"
    )


def _simulator_code(workdir: Path) -> Path:
    """The product's package as it is here, for the simulator to run from in the VMs."""
    folder = workdir / "sim"
    shutil.copytree(ROOT / "denv_iac", folder / "denv_iac", ignore=_SKIP)
    simulator_dependencies(folder)
    return folder


_SKIP = shutil.ignore_patterns("__pycache__", "*.so")


def simulator_dependencies(folder: Path) -> None:
    """The simulator's packages from outside the standard library into `folder`, pure Python
    (websockets' C speedups left out: it falls back without them); the VMs have no way out to
    install them."""
    shutil.copytree(Path(websockets.__file__).parent, folder / "websockets", ignore=_SKIP)
    shutil.copytree(Path(h11.__file__).parent, folder / "h11", ignore=_SKIP)


def deploy_inputs(
    spec: StackSpec, nodes: dict[str, Vm]
) -> tuple[Placement, dict[str, NodeDeploySpec], RenderedConfig]:
    """The stack placed, each node's deploy spec (by node name) and the balancer's config, as
    the components make them, with the VMs' addresses as the machines'."""
    placement = make_plan(spec).placement
    by_id = node_deploy_specs(spec, placement)
    # The VMs have no way out: the driver comes from the stand-in NVIDIA repository in each.
    specs = {
        name: dataclasses.replace(
            by_id[f"{OFFICE}.{name}"],
            nvidia_repo=f"file://{standin.REPO_IN_ROOT}",
            agent=dataclasses.replace(by_id[f"{OFFICE}.{name}"].agent, config=BED_AGENT),
        )
        for name in NODES
    }

    def locate(replica: PlacedReplica) -> tuple[str, int, int]:
        node = specs[replica.node]
        port = next(r.port for r in node.replicas if r.id == replica.id)
        return nodes[replica.node].address, port, node.agent_port

    rendered = render_haproxy_config(
        balancer_pools(spec, placement, locate), balancer_settings(spec), CONFIG_DIR
    )
    return placement, specs, rendered


def _parallel(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def stack(bed: Bed) -> Stack:
    return build_stack(bed)


def build_stack(bed: Bed, recipe: dict[str, Any] | None = None) -> Stack:
    """The three VMs booted, prepared and deployed by the provider, every replica UP;
    `recipe` as in stack_config."""
    start = time.monotonic()
    balancer = bed.start("balancer1")
    nodes = {name: bed.start(name) for name in NODES}
    _parallel({vm.name: vm.wait_ssh for vm in (balancer, *nodes.values())})
    TIMINGS["stack: 3 VMs boot to SSH (in parallel)"] = time.monotonic() - start

    start = time.monotonic()
    sim = _simulator_code(bed.workdir)
    calls: dict[str, Callable[[], Any]] = {
        name: lambda vm=vm: _prepare_node(bed, vm, sim) for name, vm in nodes.items()
    }
    calls["balancer"] = lambda: offer_packages(balancer, bed.workdir, "haproxy")
    _parallel(calls)
    TIMINGS["stack: stand-in GPUs and package repositories"] = time.monotonic() - start

    spec = read_stack("vm", stack_config(nodes, recipe))
    _, specs, rendered = deploy_inputs(spec, nodes)
    made = Stack(
        spec,
        bed,
        balancer,
        nodes,
        specs,
        rendered,
        make_tls(bed.workdir, balancer.address),
        endpoint_url(spec, balancer.address),
    )
    assert made.url == f"https://{balancer.address}:{ENDPOINT_PORT}"
    assert len(made.replicas) == 4 and {n for n, _ in made.replicas.values()} == set(NODES)

    def create(machine: str) -> float:
        begin = time.monotonic()
        created = provider(bed, "create", made.inputs(machine))
        made.ids[machine], made.state[machine] = created["id"], created["outs"]
        return time.monotonic() - begin

    start = time.monotonic()
    took = _parallel({machine: lambda m=machine: create(m) for machine in MACHINES})
    for machine, seconds in took.items():
        what = "balancer host" if machine == "balancer" else f"join {machine}"
        TIMINGS[f"stack: {what} (provider create, in parallel)"] = seconds
    TIMINGS["stack: all three deploys"] = time.monotonic() - start
    for machine in MACHINES:
        assert made.state[machine]["applied"], f"{machine}: a fresh machine needs steps"
    TIMINGS["stack: first deploy to full strength"] = made.wait(
        made.at_full_strength, "every replica UP"
    )
    return made


@dataclass
class Counted:
    results: list[StreamResult]
    lost: list[StreamResult]
    cut: int
    replayed: int
    # What HAProxy showed while the load ran: (seconds into the load, {replica: status weight})
    # at each change; in a failure's message with when the lost requests started.
    seen: list[tuple[float, dict[str, str]]]
    # HAProxy's own log of servers going down or up while the load ran (its journal on the
    # balancer host): what the samples above miss between two of them.
    log: list[str]
    # The pool's replicas in rotation (UP, weight above 0) at each sample of HAProxy's view.
    ready: list[int] = field(default_factory=list)

    @property
    def why(self) -> str:
        starts = [round(r.started_s, 1) for r in self.lost]
        return f"{self.line}; lost at {starts}; HAProxy: {self.seen}; its log: {self.log}"

    @property
    def line(self) -> str:
        errors = Counter(r.error for r in self.lost)
        return (
            f"{len(self.results)} requests, lost {len(self.lost)} {dict(errors)},"
            f" cut {self.cut}, replayed {self.replayed}"
        )


def _in_rotation(row: dict[str, str]) -> bool:
    return row["status"].startswith("UP") and row["weight"] != "0"


def _state(row: dict[str, str]) -> str:
    """A server's status and weight; for one not UP, why (its last check's and agent's)."""
    state = f"{row['status']} {row['weight']}"
    if row["status"] != "UP":
        state += f" check {row['check_status']} agent {row['agent_status']}"
    return state


@contextmanager
def under_load(
    stack: Stack, label: str, max_s: float = 900.0, load: dict[str, int] | None = None
) -> Iterator[list[Counted]]:
    """Closed-loop load through the endpoint while the body runs, `load` workers of each
    protocol (streamed chat alone by default); afterwards the one item of the list it yields
    holds the counts."""
    folder = stack.bed.workdir / f"load-{label.replace(' ', '-')}"
    folder.mkdir()
    call = {
        "url": stack.url,
        "pool": POOL,
        "api_key": API_KEY,
        "load": load or {"chat": CONCURRENCY},
        "stop_file": str(folder / "stop"),
        "max_s": max_s,
    }
    (folder / "call.json").write_text(json.dumps(call))
    argv = [
        "ip", "netns", "exec", stack.bed.netns, "env", f"SSL_CERT_FILE={stack.tls.ca}",
        sys.executable, "-m", "tests.vm.load_call", str(folder / "call.json"),
        str(folder / "out.json"),
    ]  # fmt: skip
    process = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    since = stack.balancer.ssh("date +%s").strip()
    states: list[tuple[float, dict[str, str]]] = []
    ready: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            with contextlib.suppress(Exception):  # a slow SSH round: the next one tells
                rows = stack.servers()
                ready.append(sum(map(_in_rotation, rows.values())))
                now = {r: _state(row) for r, row in rows.items()}
                if not states or states[-1][1] != now:
                    states.append((round(time.monotonic() - t0, 1), now))
            done.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    counted: list[Counted] = []
    try:
        time.sleep(3)  # load flowing before the fault
        yield counted
        time.sleep(3)  # and after the recovery
    finally:
        (folder / "stop").touch()
        done.set()
        _, err = process.communicate(timeout=120)
        watcher.join(timeout=30)
    assert process.returncode == 0, err[-3000:]
    results = [
        StreamResult(**{**row, "gaps_ms": tuple(row["gaps_ms"])})
        for row in json.loads((folder / "out.json").read_text())
    ]
    seen = stack.seen_by_replicas()
    # Ended early after it started: a stream cut, or a realtime session closed mid-turn.
    cut = [r for r in results if r.error in CUT_ERRORS]
    lost = [r for r in results if r.error and r.error not in CUT_ERRORS]
    log = stack.balancer.ssh(
        f"journalctl -u haproxy.service -o short-precise --since @{since}"
        " | grep -E 'Server .* is (DOWN|UP)|no server available' | tail -n 40",
        check=False,
    ).splitlines()
    replayed = count_replayed(results, seen)
    counted.append(Counted(results, lost, len(cut), replayed, states, log, ready))


def test_a_traffic_reaches_replicas_on_both_nodes(stack: Stack) -> None:
    start = time.monotonic()
    with under_load(stack, "a traffic") as counted:
        time.sleep(10)
    (done,) = counted
    TIMINGS[f"a: load through the TLS endpoint ({done.line})"] = time.monotonic() - start
    served = Counter(r.replica for r in done.results if r.ok)
    assert set(served) == set(stack.replicas), served
    assert (done.lost, done.cut, done.replayed) == ([], 0, 0), done.why


def test_b_a_replica_killed_comes_back_by_systemd(stack: Stack) -> None:
    replica = sorted(stack.replicas)[0]
    node = stack.nodes[stack.replicas[replica][0]]
    unit = f"denv-replica-{replica}.service"
    with under_load(stack, "b kill -9 a replica") as counted:
        before = node.ssh(f"systemctl show -p MainPID --value {unit}").strip()
        start = time.monotonic()
        node.ssh(f"kill -9 {before}")

        def back() -> bool:
            pid = node.ssh(f"systemctl show -p MainPID --value {unit}").strip()
            return pid not in ("0", before) and stack.at_full_strength()

        stack.wait(back, f"{replica} back after kill -9")
        took = time.monotonic() - start
    (done,) = counted
    TIMINGS[f"b: kill -9 a replica to back in rotation ({done.line})"] = took
    assert (done.lost, done.replayed) == ([], 0), done.why


def test_c_a_rebooted_node_comes_back_in_rotation_by_itself(stack: Stack) -> None:
    node = stack.nodes["node2"]
    theirs = [r for r, (n, _) in stack.replicas.items() if n == "node2"]
    boot_id = node.boot_id()
    with under_load(stack, "c reboot node2") as counted:
        start = time.monotonic()
        node.ssh("systemctl reboot", check=False)
        stack.wait(
            lambda: all(stack.servers()[r]["status"] != "UP" for r in theirs),
            "node2's replicas out of rotation",
        )
        TIMINGS["c: reboot to node2 out of rotation"] = time.monotonic() - start
        stack.wait(stack.at_full_strength, "node2 back in rotation")
        took = time.monotonic() - start
    assert node.boot_id() != boot_id
    for unit in ("denv-agent.service", *(f"denv-replica-{r}.service" for r in theirs)):
        assert node.ssh(f"systemctl is-active {unit}", check=False).strip() == "active", unit
    (done,) = counted
    TIMINGS[f"c: reboot to node2 back in rotation ({done.line})"] = took
    assert (done.lost, done.replayed) == ([], 0), done.why


def repair(stack: Stack, name: str, level: str) -> dict[str, Any]:
    """`denv node repair` as an operator runs it: over SSH with the key, the node's spec file."""
    spec = stack.bed.workdir / f"{name}.json"
    spec.write_text(
        json.dumps(
            {**spec_to_json(stack.specs[name]), "balancer_addresses": [stack.balancer.address]}
        )
    )
    home = stack.bed.workdir / "home"
    home.mkdir(exist_ok=True)
    argv = [
        "env", f"HOME={home}", sys.executable, "-m", "denv_iac", "node", "repair",
        stack.nodes[name].address, "--user", "root", "--key", str(stack.bed.key),
        "--site", OFFICE, "--spec", str(spec), "--level", level, "--json",
    ]  # fmt: skip
    done = subprocess.run(
        ["ip", "netns", "exec", stack.bed.netns, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert done.returncode == 0, f"repair {level}: {done.stdout[-3000:]} {done.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.mark.parametrize("level", ["reset", "reload", "reinstall", "reboot"])
def test_d_every_repair_level_under_load_loses_nothing(stack: Stack, level: str) -> None:
    with under_load(stack, f"d repair {level}") as counted:
        start = time.monotonic()
        report = repair(stack, "node1", level)
        repaired = time.monotonic() - start
        assert report["ok"] and not report["drained"], report
        stack.wait(stack.at_full_strength, f"after repair {level}")
        took = time.monotonic() - start
    (done,) = counted
    steps = ", ".join(f"{s['name']} {s['seconds']:.0f} s" for s in report["steps"] if s["seconds"])
    waited = next(s["detail"] for s in report["steps"] if s["name"] == "wait for in-flight streams")
    TIMINGS[f"d: repair {level} (denv node repair: {steps}; the wait: {waited})"] = repaired
    TIMINGS[f"d: repair {level} to full strength ({done.line})"] = took
    assert (done.lost, done.cut, done.replayed) == ([], 0, 0), done.why


def run_again(stack: Stack, machine: str) -> tuple[dict[str, Any], list[str], float]:
    """The engine's diff of the machine's deploy, then its update anyway: (the diff, the steps
    the update applied, the update's seconds)."""
    inputs = stack.inputs(machine)
    olds, id_ = stack.state[machine], stack.ids[machine]
    diff = provider(stack.bed, "diff", id_, olds, inputs)
    begin = time.monotonic()
    outs = provider(stack.bed, "update", id_, olds, inputs)["outs"]
    stack.state[machine] = outs
    return diff, outs["applied"], time.monotonic() - begin


def assert_second_run_changes_nothing(stack: Stack, label: str) -> None:
    """Every machine's deploy run again at once: no diff, no step applied."""
    runs = _parallel({m: lambda m=m: run_again(stack, m) for m in MACHINES})
    for machine, (diff, applied, seconds) in runs.items():
        TIMINGS[f"{label}: second run {machine} (provider update, in parallel)"] = seconds
        assert diff == {"changes": False, "replaces": []}, (machine, diff)
        assert applied == [], (machine, applied)


def test_e_a_second_run_of_every_deploy_changes_nothing(stack: Stack) -> None:
    assert_second_run_changes_nothing(stack, "e")


def test_f_delete_leaves_no_unit_rule_or_mount_on_the_nodes(stack: Stack) -> None:
    start = time.monotonic()
    _parallel(
        {
            m: lambda m=m: provider(stack.bed, "delete", stack.ids[m], stack.state[m])
            for m in MACHINES
        }
    )
    TIMINGS["f: delete (provider delete, in parallel)"] = time.monotonic() - start
    for vm in stack.nodes.values():
        left = vm.ssh(
            "systemctl list-units --all --plain --no-legend 'denv-replica-*' 'denv-mig*'"
            " 'denv-firewall*'; ls /etc/systemd/system | grep -E '^denv-(replica|mig|firewall)'"
            "; nft list tables | grep -w denv; findmnt -rn -o TARGET | grep -i denv",
            check=False,
        )
        assert left.strip() == "", (vm.name, left)
    # The balancer host's machine goes with its BalancerHost (made on AWS here): its deploy's
    # delete leaves it serving until then, its firewall with it.
    tables = stack.balancer.ssh("nft list tables").splitlines()
    assert "table inet denv-balancer" in tables, tables
