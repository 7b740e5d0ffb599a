"""An HGX H100 node on a VM: eight stand-in GPUs behind four NVSwitches, a MIG layout on two of
them with replicas on its instances, joined through NodeSetup's provider as the engine calls it.

The stand-in driver behaves where it matters here as the real one does: a GPU reset is refused
while any process holds the device (the agent through NVML, persistenced, fabric manager), a MIG
mode change waits for that reset, and GPU instances live in /run, so a reboot loses them. The
stand-in NVIDIA repository holds fabric manager at the driver's version under a revision of its
own, beside a later 580 release and the 590 branch's unsuffixed packages, neither to be taken.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from denv_iac.node import MigSlice, NodeDeploySpec, ReplicaSpec
from denv_iac.node.holders import AGENT, FABRICMANAGER, PERSISTENCED
from denv_iac.node.mig import UNIT as MIG_UNIT
from tests.node import standin
from tests.vm.bed import HOST, Bed, Vm
from tests.vm.conftest import TIMINGS
from tests.vm.standin_vm import make_gpu_machine
from tests.vm.test_join import agent_healthz, provider, spec_props

pytestmark = pytest.mark.vm

GPUS, NVSWITCHES = 8, 4
IMAGE = "ghcr.io/acme/llm:2.0"
SLICED = (
    ReplicaSpec("llm.joined.hgx1.0.0", IMAGE, 8000, 0, mig_profile="3g.40gb", mig_instance=0),
    ReplicaSpec("llm.joined.hgx1.0.1", IMAGE, 8001, 0, mig_profile="3g.40gb", mig_instance=1),
    ReplicaSpec("llm.joined.hgx1.1.0", IMAGE, 8002, 1, mig_profile="1g.10gb", mig_instance=1),
)
WHOLE = ReplicaSpec("llm.joined.hgx1.2", IMAGE, 8003, 2)
SPEC = NodeDeploySpec(
    node_id="joined.hgx1",
    mig=(MigSlice(0, "3g.40gb", 2), MigSlice(1, "1g.10gb", 2)),
    replicas=(*SLICED, WHOLE),
    nvidia_repo=f"file://{standin.REPO_IN_ROOT}",
    admin_cidrs=(f"{HOST}/32",),
)
# What nvidia-smi -L and the agent show once the layout is there (the stand-in's MIG UUIDs).
LAYOUT = {
    0: ["MIG-0-0-3g.40gb", "MIG-0-1-3g.40gb"],
    1: ["MIG-1-0-1g.10gb", "MIG-1-1-1g.10gb"],
}
FABRIC = ("nvidia-fabricmanager-580", "libnvidia-nscq-580")
HOLDERS = (AGENT, FABRICMANAGER, PERSISTENCED)
JOINED: dict[str, Any] = {}  # the provider's outputs after the join, as the engine keeps them


@pytest.fixture(scope="module")
def node(bed: Bed) -> Vm:
    vm = bed.start("hgx1")
    TIMINGS["HGX: boot to SSH"] = vm.wait_ssh()
    start = time.monotonic()
    make_gpu_machine(vm, bed.workdir, gpus=GPUS, nvswitches=NVSWITCHES)
    TIMINGS["HGX: stand-in GPU machine made"] = time.monotonic() - start
    return vm


def instances(node: Vm) -> dict[int, list[str]]:
    """The MIG instances nvidia-smi -L lists, per GPU that has any."""
    found: dict[int, list[str]] = {}
    gpu = -1
    for line in node.ssh("nvidia-smi -L").splitlines():
        if line.startswith("GPU "):
            gpu = int(line.split()[1].rstrip(":"))
        elif line.lstrip().startswith("MIG "):
            found.setdefault(gpu, []).append(line.rsplit("UUID: ", 1)[1].rstrip(")"))
    return found


def active(node: Vm, *units: str) -> list[str]:
    out = node.ssh(f"systemctl is-active {' '.join(units)}", check=False)
    return out.split()


def replica_devices(node: Vm, replica: ReplicaSpec, boot: str = "") -> str:
    """The device the replica's container was given in this boot (what its docker run says)."""
    journal = node.ssh(f"journalctl -o cat {boot} -u {replica.unit}")
    return next(
        (w.split("=", 1)[1] for w in journal.split() if w.startswith("NVIDIA_VISIBLE_DEVICES=")),
        "",
    )


def agent_mig(node: Vm) -> dict[int, list[str]]:
    """The MIG instances the agent reads through NVML, per GPU that has any."""

    def has_layout(doc: dict[str, Any]) -> bool:
        return all(gpu["mig"]["devices"] == LAYOUT.get(gpu["index"], []) for gpu in doc["gpus"])

    doc = agent_healthz(node, has_layout)
    return {gpu["index"]: gpu["mig"]["devices"] for gpu in doc["gpus"] if gpu["mig"]["devices"]}


def monotonic_us(node: Vm, unit: str, field: str) -> int:
    return int(node.ssh(f"systemctl show -P {field} {unit}").strip())


def test_1_join_makes_the_layout_with_the_holders_stopped_and_fabric_manager_at_the_driver(
    bed: Bed, node: Vm
) -> None:
    start = time.monotonic()
    created = provider(bed, "create", spec_props(bed, node, SPEC))
    TIMINGS["HGX: join with MIG and fabric manager (provider create)"] = time.monotonic() - start
    assert created["outs"]["applied"], "a fresh machine needs steps"
    JOINED.update(created)

    # The reset under each mode change is refused while anything holds the device, so the
    # layout being there means persistenced and fabric manager (started earlier in this run)
    # were stopped around it; they and the agent run again.
    assert instances(node) == LAYOUT
    assert active(node, *HOLDERS) == ["active"] * len(HOLDERS)
    for unit in (PERSISTENCED, FABRICMANAGER):  # around each of the two GPUs' changes
        log = node.ssh(f"journalctl -o cat -u {unit}")
        assert log.count("Stopped ") >= 2 and log.count("Started ") >= 3, (unit, log)
    assert agent_mig(node) == LAYOUT

    # Each replica on its own instance (its UUID looked up when the unit started).
    units = [r.unit for r in SPEC.replicas]
    assert active(node, *units) == ["active"] * len(units)
    assert [replica_devices(node, r) for r in SLICED] == [
        LAYOUT[0][0],
        LAYOUT[0][1],
        LAYOUT[1][1],
    ]
    assert replica_devices(node, WHOLE) == "GPU-00000002-aaaa-bbbb-cccc-000000000002"
    for replica in SLICED:
        deps = node.ssh(f"systemctl show --value -p Requires -p After {replica.unit}")
        assert MIG_UNIT in deps.split(), deps
    assert node.ssh(f"systemctl is-enabled {MIG_UNIT}").strip() == "enabled"

    # Fabric manager: the running driver's upstream version under its own revision, not the
    # later 580 release nor the 590 branch's packages; enabled and running.
    versions = dict(
        line.split("\t")
        for line in node.ssh(
            "dpkg-query -W -f '${Package}\\t${Version}\\n' 'nvidia-fabricmanager*' "
            "'libnvidia-nscq*' nvidia-open"
        ).splitlines()
        if "\t" in line and line.split("\t")[1]
    )
    fabric = f"{standin.DRIVER}-{standin.FABRIC_REVISION}"
    assert versions == {"nvidia-open": f"{standin.DRIVER}-1", **dict.fromkeys(FABRIC, fabric)}
    assert node.ssh(f"systemctl is-enabled {FABRICMANAGER}").strip() == "enabled"
    # ... and it stays there: an upgrade would not move it off the driver's version, as it
    # would with the branch's pinning package alone (to the later 580 release).
    upgrade = "apt-get -s -o Debug::NoLocking=1 {} upgrade | grep '^Inst ' || true"
    assert node.ssh(upgrade.format("")) == ""
    branch_pin_only = node.ssh(
        "mkdir -p /tmp/branch-pin && cp /etc/apt/preferences.d/nvidia-driver-pinning-580"
        " /tmp/branch-pin/ && " + upgrade.format("-o Dir::Etc::PreferencesParts=/tmp/branch-pin")
    )
    assert f"Inst {FABRIC[0]} [{fabric}] ({standin.LATER_FABRIC}-" in branch_pin_only


def test_2_reboot_brings_the_layout_back_before_the_replicas(node: Vm) -> None:
    start = node.reboot()
    TIMINGS["HGX: reboot to SSH"] = time.monotonic() - start
    units = [r.unit for r in SPEC.replicas]
    deadline = time.monotonic() + 300
    layout_back = None
    while time.monotonic() < deadline:
        if layout_back is None and instances(node) == LAYOUT:
            layout_back = time.monotonic() - start
        if layout_back is not None and active(node, *units) == ["active"] * len(units):
            break
        time.sleep(1)
    replicas_back = time.monotonic() - start
    assert layout_back is not None, "the MIG layout did not come back"
    assert active(node, *units) == ["active"] * len(units), node.ssh("systemctl --failed")
    TIMINGS["HGX: reboot to MIG layout back (seen over SSH)"] = layout_back
    TIMINGS["HGX: reboot to replicas active (seen over SSH)"] = replicas_back

    # Made in this boot by the boot unit (the reboot lost them), before any replica started,
    # and no replica failed for want of its instance.
    made = node.ssh(f"journalctl -b -o cat -u {MIG_UNIT}")
    assert made.count("Successfully created GPU instance") == 4, made
    ready = monotonic_us(node, MIG_UNIT, "ActiveEnterTimestampMonotonic")
    for replica in SPEC.replicas:
        started = monotonic_us(node, replica.unit, "InactiveExitTimestampMonotonic")
        if replica.mig_profile:
            assert ready <= started, (replica.unit, ready, started)
        assert node.ssh(f"systemctl show -P NRestarts {replica.unit}").strip() == "0"
    assert [replica_devices(node, r, "-b") for r in SLICED] == [
        LAYOUT[0][0],
        LAYOUT[0][1],
        LAYOUT[1][1],
    ]
    last = max(monotonic_us(node, r.unit, "ActiveEnterTimestampMonotonic") for r in SPEC.replicas)
    TIMINGS["HGX: kernel start to MIG layout made (guest clock)"] = ready / 1e6
    TIMINGS["HGX: kernel start to last replica active (guest clock)"] = last / 1e6
    assert active(node, *HOLDERS) == ["active"] * len(HOLDERS)
    assert agent_mig(node) == LAYOUT


def test_3_a_second_run_changes_nothing(bed: Bed, node: Vm) -> None:
    inputs = spec_props(bed, node, SPEC)
    start = time.monotonic()
    again = provider(bed, "update", JOINED["id"], JOINED["outs"], inputs)
    TIMINGS["HGX: second run after the reboot (provider update)"] = time.monotonic() - start
    assert again["outs"]["applied"] == []


def test_4_a_mode_change_with_the_agent_running_stops_it_and_starts_it_after(
    bed: Bed, node: Vm
) -> None:
    # The agent holds the device through NVML now: the reset under GPU 3's mode change is
    # refused unless it is stopped too. The replicas on other GPUs keep running.
    changed = dataclasses.replace(SPEC, mig=(*SPEC.mig, MigSlice(3, "7g.80gb", 1)))
    pids = {r.unit: node.ssh(f"systemctl show -P MainPID {r.unit}") for r in SPEC.replicas}
    agent_starts = node.ssh(f"journalctl -o cat -u {AGENT}").count("Started ")
    start = time.monotonic()
    out = provider(bed, "update", JOINED["id"], JOINED["outs"], spec_props(bed, node, changed))
    TIMINGS["HGX: MIG mode change with the agent running (provider update)"] = (
        time.monotonic() - start
    )
    assert [title for title in out["outs"]["applied"] if "GPU" in title] == ["mig: GPU 3: 7g.80gb"]
    assert instances(node) == {**LAYOUT, 3: ["MIG-3-0-7g.80gb"]}
    assert active(node, *HOLDERS) == ["active"] * len(HOLDERS)
    assert node.ssh(f"journalctl -o cat -u {AGENT}").count("Started ") == agent_starts + 1
    assert {r.unit: node.ssh(f"systemctl show -P MainPID {r.unit}") for r in SPEC.replicas} == pids
