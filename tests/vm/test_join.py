"""NodeSetup's dynamic provider on a booted VM over SSH: create joins the node, a second run
changes nothing, delete leaves no replica unit behind. Called as the engine calls it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from denv_iac.components.node_setup import spec_to_json
from denv_iac.node import NodeDeploySpec, ReplicaSpec
from tests.node import standin
from tests.vm.bed import HOST, Bed, Vm
from tests.vm.conftest import TIMINGS
from tests.vm.standin_vm import make_gpu_machine

ROOT = Path(__file__).resolve().parents[2]


def provider(bed: Bed, method: str, *args: Any) -> Any:
    """One provider call in a process of its own inside the bed's namespace."""
    # A home of its own, as on a fresh runner: no ~/.ssh, and no host key of an earlier run.
    home = bed.workdir / "home"
    home.mkdir(exist_ok=True)
    done = bed.netns_run_input(
        ["env", f"HOME={home}", sys.executable, "-m", "tests.vm.provider_call"],
        json.dumps({"method": method, "args": list(args)}),
        cwd=ROOT,
        timeout=900,
    )
    if done.returncode != 0:
        raise AssertionError(f"provider {method} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def node(bed: Bed) -> Vm:
    vm = bed.start("node1")
    TIMINGS["boot to SSH"] = vm.wait_ssh()
    make_gpu_machine(vm, bed.workdir)
    return vm


def props(bed: Bed, node: Vm) -> dict[str, Any]:
    """What NodeSetup registers for a joined node: the spec's JSON, the key, the balancers."""
    spec = NodeDeploySpec(
        node_id="joined.node1",
        replicas=(
            ReplicaSpec("voice.joined.node1.0", "ghcr.io/acme/voice:1.4", 8000, 0),
            ReplicaSpec("voice.joined.node1.1", "ghcr.io/acme/voice:1.4", 8001, 1),
        ),
        nvidia_repo=f"file://{standin.REPO_IN_ROOT}",
    )
    data = spec_to_json(spec)
    return {
        "host": node.address,
        "ssh_user": "root",
        "ssh_private_key": bed.key.read_text(),
        "node": {k: v for k, v in data.items() if k != "balancer_addresses"},
        "balancer_addresses": [HOST],
        "applied": None,
    }


def units(node: Vm) -> list[str]:
    out = node.ssh("ls /etc/systemd/system/ | grep '^denv-' || true")
    return sorted(out.split())


def test_create_joins_then_a_second_run_changes_nothing_and_delete_cleans_up(
    bed: Bed, node: Vm
) -> None:
    inputs = props(bed, node)
    start = time.monotonic()
    created = provider(bed, "create", inputs)
    TIMINGS["join (provider create)"] = time.monotonic() - start
    assert created["id"] == "joined.node1"
    assert created["outs"]["applied"], "a fresh machine needs steps"
    assert "ssh_private_key" in created["outs"]
    replicas = [u for u in units(node) if u.startswith("denv-replica-")]
    assert len(replicas) == 2, units(node)
    assert node.ssh("systemctl is-active denv-agent.service", check=False).strip() == "active"
    assert node.ssh("nvidia-smi --query-gpu=index --format=csv,noheader").split() == ["0", "1"]

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
