"""NodeSetup's dynamic provider on a booted VM over SSH: create joins the node, a second run
changes nothing, delete leaves no replica unit or node firewall behind. Called as the engine
calls it.

The join is the first deploy of a machine as unkind as a fresh cloud instance (tests/vm/
first_boot.py): started and reported running at once, its sshd 30 s late, cloud-init's stages
still running, and the package locks held for 60 s from early in its boot.

The joined node is also its site's balancer host, as on a joined site: its firewall is proven
from both sides of the bridge, the test's own address (admin and balancer) and the outside one.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from denv_iac.node import NodeDeploySpec, ReplicaSpec
from denv_iac.node.agent import CONFIG
from denv_iac.node.facts import AGENT_VENV
from denv_iac.node.spec import spec_to_json
from tests.node import standin
from tests.vm.bed import HOST, OUTSIDE, Bed, Vm
from tests.vm.conftest import TIMINGS
from tests.vm.first_boot import FirstBoot, first_boot_ahead, first_boot_record
from tests.vm.standin_vm import make_gpu_machine, set_nvml_faults

ROOT = Path(__file__).resolve().parents[2]


STATS_PORT = 8405  # the balancer's prometheus_port
ENDPOINT_PORT = 8080  # the balancer's port: open to everyone
REACH_TIMEOUT_S = 4.0
# cloud-init's stages end before the locks are let go: the deploy meets each wait on its own.
# cloud-init ends well after sshd is up (its final stage runs late, as on clouds), so that
# the deploy finds it running however long its connect takes on a loaded machine; the locks
# are held past it, so apt meets them after the cloud-init wait.
FIRST_BOOT = FirstBoot(ssh_late_s=30, cloud_init_s=60, lock_s=80)
CLOUD_INIT_WAIT = "base: wait for cloud-init's first boot to finish"


def in_netns(bed: Bed, module: str, call: Any, timeout: float = 900) -> tuple[int, str, str]:
    """`python -m module` in a process of its own inside the bed's namespace, `call` as JSON."""
    # A home of its own, as on a fresh runner: no ~/.ssh, and no host key of an earlier run.
    home = bed.workdir / "home"
    home.mkdir(exist_ok=True)
    done = bed.netns_run_input(
        ["env", f"HOME={home}", sys.executable, "-m", module],
        json.dumps(call),
        cwd=ROOT,
        timeout=timeout,
    )
    return done.returncode, done.stdout, done.stderr


def provider(bed: Bed, method: str, *args: Any) -> Any:
    """One provider call, as the engine's provider host makes it."""
    code, out, err = in_netns(bed, "tests.vm.provider_call", {"method": method, "args": args})
    if code != 0:
        raise AssertionError(f"provider {method} failed: {err[-3000:]}")
    return json.loads(out)


def reach(bed: Bed, node: Vm, tries: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """Each (source address, port): open, refused (reachable, nothing listens) or timeout."""
    call = {"host": node.address, "timeout_s": REACH_TIMEOUT_S, "tries": tries}
    code, out, err = in_netns(bed, "tests.vm.reach", call, timeout=60)
    assert code == 0, err[-3000:]
    return dict(zip(tries, json.loads(out), strict=True))


@pytest.fixture(scope="module")
def node(bed: Bed) -> Vm:
    vm = bed.start("node1")
    TIMINGS["boot to SSH"] = vm.wait_ssh()
    make_gpu_machine(vm, bed.workdir)
    return vm


def props(bed: Bed, node: Vm, admin_cidrs: tuple[str, ...] = (f"{HOST}/32",)) -> dict[str, Any]:
    """What NodeSetup registers for a joined node: the spec's JSON, the key, the balancers."""
    spec = NodeDeploySpec(
        node_id="joined.node1",
        replicas=(
            ReplicaSpec("voice.joined.node1.0", "ghcr.io/acme/voice:1.4", 8000, 0),
            ReplicaSpec("voice.joined.node1.1", "ghcr.io/acme/voice:1.4", 8001, 1),
        ),
        nvidia_repo=f"file://{standin.REPO_IN_ROOT}",
        admin_cidrs=admin_cidrs,
    )
    return spec_props(bed, node, spec)


def spec_props(bed: Bed, node: Vm, spec: NodeDeploySpec) -> dict[str, Any]:
    """NodeSetup's inputs for `spec` on the VM, reached over SSH from the bed's own address."""
    data = spec_to_json(spec)
    return {
        "host": node.address,
        "ssh_user": "root",
        "ssh_private_key": bed.key.read_text(),
        "node": {k: v for k, v in data.items() if k != "balancer_addresses"},
        "balancer_addresses": [HOST],
        "applied": None,
    }


# The agent's /healthz, at the address its own config gives, read by its own Python in the VM.
_HEALTHZ = (
    "import urllib.request; from pathlib import Path; from denv_agent.config import load;"
    " from denv_agent.control import control_url;"
    f" url = control_url(load(Path({CONFIG!r}))) + '/healthz';"
    " print(urllib.request.urlopen(url, timeout=5).read().decode())"
)


def agent_healthz(
    node: Vm, until: Callable[[dict[str, Any]], bool] = lambda doc: True
) -> dict[str, Any]:
    """What the joined node's agent reads through pynvml and the stand-in NVML library, once NVML
    has started (the agent may have been started a moment ago) and `until` holds, or after 60 s."""
    deadline = time.monotonic() + 60
    while True:
        doc: dict[str, Any] = json.loads(
            node.ssh(f"{AGENT_VENV}/bin/python -c {shlex.quote(_HEALTHZ)}")
        )
        started = doc["nvml"]["state"] != "initializing"
        if (started and until(doc)) or time.monotonic() > deadline:
            return doc
        time.sleep(1)


def units(node: Vm) -> list[str]:
    out = node.ssh("ls /etc/systemd/system/ | grep '^denv-' || true")
    return sorted(out.split())


def test_create_joins_then_a_second_run_changes_nothing_and_delete_cleans_up(
    bed: Bed, node: Vm
) -> None:
    inputs = props(bed, node)
    # admin_cidrs without the deploy's own address: refused in one line before any change.
    locked_out = props(bed, node, admin_cidrs=(f"{OUTSIDE}/32",))
    code, _, err = in_netns(
        bed, "tests.vm.provider_call", {"method": "create", "args": [locked_out]}
    )
    assert code != 0
    assert f"admin_cidrs: this deploy reaches the machine from {HOST}, which admin_cidrs" in err
    assert units(node) == [], "a refused deploy changes nothing"

    # The machine boots again as a new cloud instance boots, and the first deploy starts as
    # soon as it is reported running.
    first_boot_ahead(node, FIRST_BOOT)
    start = node.power_cycle()
    created = provider(bed, "create", inputs)
    TIMINGS["join from reported running (provider create)"] = time.monotonic() - start
    assert created["id"] == "joined.node1"
    assert created["outs"]["applied"], "a fresh machine needs steps"
    # What it met: sshd held back, cloud-init still running when the deploy read the facts,
    # and the package locks still held once cloud-init was done, when apt came first.
    met = first_boot_record(node)  # uptimes, in hundredths: 58.8 - 28.8 is 29.999... as floats
    assert round(met["sshd-up"] - met["sshd-held"], 1) >= FIRST_BOOT.ssh_late_s, met
    assert CLOUD_INIT_WAIT in created["outs"]["applied"]
    assert met["locks-released"] - met["cloud-init-done"] >= 10, met
    assert "ssh_private_key" in created["outs"]
    replicas = [u for u in units(node) if u.startswith("denv-replica-")]
    assert len(replicas) == 2, units(node)
    assert node.ssh("systemctl is-active denv-agent.service", check=False).strip() == "active"
    assert node.ssh("nvidia-smi --query-gpu=index --format=csv,noheader").split() == ["0", "1"]
    start = time.monotonic()
    health = agent_healthz(node)
    assert health["nvml"] == {
        "state": "ok",
        "error": None,
        "driver_version": standin.DRIVER,
        "gpu_count": 2,
    }, health["nvml"]
    smi = node.ssh("nvidia-smi --query-gpu=uuid --format=csv,noheader").split()
    assert [g["uuid"] for g in health["gpus"]] == smi
    assert [g["xid_events"] for g in health["gpus"]] == ["registered", "registered"]
    # A fault scripted in the VM's NVML reaches the agent; the operator's command clears it.
    set_nvml_faults(node, "xid 1 48")
    faulted = agent_healthz(node, lambda doc: doc["gpus"][1]["xids"] == {"48": 1})
    assert faulted["gpus"][1]["reasons"] == ["xid 48 double-bit ecc error"], faulted["gpus"]
    set_nvml_faults(node)
    node.ssh("denv-agent clear-faults")
    cleared = agent_healthz(node, lambda doc: doc["gpus"][1]["reasons"] == [])
    assert [g["reasons"] for g in cleared["gpus"]] == [[], []]
    TIMINGS["agent over the stand-in NVML (read, fault, clear)"] = time.monotonic() - start

    start = time.monotonic()
    check_firewalls(bed, node)
    TIMINGS["firewalls (node, balancer host)"] = time.monotonic() - start

    olds = created["outs"]
    assert provider(bed, "diff", created["id"], olds, inputs) == {"changes": False, "replaces": []}
    start = time.monotonic()
    again = provider(bed, "update", created["id"], olds, inputs)
    TIMINGS["second run (provider update)"] = time.monotonic() - start
    assert again["outs"]["applied"] == []

    moved = {**inputs, "host": "10.77.0.99"}
    assert provider(bed, "diff", created["id"], olds, moved)["replaces"] == ["host"]

    provider(bed, "delete", created["id"], again["outs"])
    assert [u for u in units(node) if u.startswith("denv-replica-")] == []
    left = node.ssh("systemctl list-units --all --plain --no-legend 'denv-replica-*' || true")
    assert left.strip() == ""
    # The node's own table went with it; the balancer host's (managed apart) stays.
    tables = node.ssh("nft list tables").splitlines()
    assert "table inet denv" not in tables and "table inet denv-balancer" in tables, tables
    assert "denv-firewall.service" not in units(node)


def check_firewalls(bed: Bed, node: Vm) -> None:
    """SSH, replica and agent ports answer the admin and balancer (HOST) only; then the same
    machine as its site's balancer host: its stats port likewise, its endpoint open to all."""
    guarded = [22, 8000, 8001, 9100]
    seen = reach(bed, node, [(source, port) for source in (OUTSIDE, HOST) for port in guarded])
    assert {port: seen[OUTSIDE, port] for port in guarded} == dict.fromkeys(guarded, "timeout")
    assert seen[HOST, 22] == "open" and seen[HOST, 9100] == "open", seen  # sshd, the agent
    assert "timeout" not in (seen[HOST, 8000], seen[HOST, 8001]), seen

    balancer = {"host": node.address, "key": str(bed.key), "stats_port": STATS_PORT}
    balancer["admin_cidrs"] = [f"{HOST}/32"]
    code, out, err = in_netns(bed, "tests.vm.balancer_firewall_call", balancer)
    assert code == 0, err[-3000:]
    assert "firewall: restart the firewall" in json.loads(out)
    tries = [(OUTSIDE, STATS_PORT), (OUTSIDE, ENDPOINT_PORT), (OUTSIDE, 22), (HOST, STATS_PORT)]
    seen = reach(bed, node, tries)
    assert seen == {
        (OUTSIDE, STATS_PORT): "timeout",
        (OUTSIDE, ENDPOINT_PORT): "refused",  # reachable: nothing listens in this VM
        (OUTSIDE, 22): "timeout",
        (HOST, STATS_PORT): "refused",
    }
    code, out, err = in_netns(bed, "tests.vm.balancer_firewall_call", balancer)
    assert code == 0, err[-3000:]
    assert json.loads(out) == [], "a second run changes nothing"
