"""What holds the GPUs is stopped around a reset, a module reload and a MIG change, and started
again after, also when the command in the middle fails.

The commands run in a shell against a stand-in node: `systemctl` keeps units as files, and
`nvidia-smi -r`, `nvidia-smi -mig` and `modprobe -r` fail while any unit holding the device runs,
as the real ones do ("In use by another client"); `denv-agent` answers only while its unit runs.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from denv_iac.node import NodeDeploySpec, NodeFacts, ReplicaSpec, plan_node
from denv_iac.node.facts import FactQuery
from denv_iac.node.holders import AGENT, DCGM, DCGM_EXPORTER, FABRICMANAGER, PERSISTENCED
from denv_iac.node.repair import RepairLevel, repair_session
from denv_iac.node.spec import MigSlice

from .fixtures import node_facts

BUSY = 'if [ -n "$(ls "$NODE/active")" ]; then echo "In use by another client"; exit 255; fi'
TOOLS = {
    "systemctl": """
verb=$1; shift
[ "$verb" = is-active ] && { [ -e "$NODE/active/$2" ]; exit; }
echo "systemctl $verb $*" >> "$NODE/log"
[ "$verb $1" = "enable --now" ] && { shift; verb=start; }
for unit; do
  case $verb in
    stop) rm -f "$NODE/active/$unit" ;;
    start|restart) touch "$NODE/active/$unit" ;;
  esac
done
""",
    "nvidia-smi": f"""
echo "nvidia-smi $*" >> "$NODE/log"
case " $* " in
  *" -r "*|*" -mig "*)
    {BUSY}
    if [ -e "$NODE/fail" ]; then echo "GPU reset failed"; exit 1; fi ;;
  *uuid*) echo "0, GPU-0, 580.95.05" ;;
  *--query-gpu*) echo "0, 580.95.05" ;;
esac
""",
    "modprobe": f"""
echo "modprobe $*" >> "$NODE/log"
if [ "$1" = -r ]; then
  {BUSY}
  if [ -e "$NODE/fail" ]; then echo "modprobe: FATAL: Module nvidia is in use"; exit 1; fi
fi
""",
    "denv-agent": f"""
echo "denv-agent $*" >> "$NODE/log"
[ -e "$NODE/active/{AGENT}" ] || {{ echo "agent not running"; exit 1; }}
""",
    "ss": "",
    "curl": "",
}


class StandInNode:
    """A NodeSession's run and facts, against the stand-in tools."""

    can_reboot = False

    def __init__(self, root: Path, facts: NodeFacts, running: set[str], fail: bool) -> None:
        self.root, self.base = root, facts
        (root / "active").mkdir(parents=True)
        (root / "bin").mkdir()
        for name, body in TOOLS.items():
            tool = root / "bin" / name
            tool.write_text(f"#!/bin/sh\n{body}\nexit 0\n")
            tool.chmod(0o755)
        for unit in running:
            (root / "active" / unit).touch()
        if fail:
            (root / "fail").touch()

    def run(self, command: str) -> tuple[bool, str]:
        env = {"PATH": f"{self.root}/bin:/usr/bin:/bin", "NODE": str(self.root)}
        done = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)
        return done.returncode == 0, (done.stdout + done.stderr).strip()

    def facts(self, query: FactQuery | None = None) -> NodeFacts:
        return dataclasses.replace(self.base, active_units=frozenset(self.running()))

    def reboot(self) -> None:
        raise AssertionError("no reboot at this level")

    def running(self) -> set[str]:
        return set(os.listdir(self.root / "active"))

    def log(self) -> list[str]:
        path = self.root / "log"
        return path.read_text().splitlines() if path.exists() else []


REPLICA = ReplicaSpec("voice.n1.0", "ghcr.io/acme/voice:1.4", 8000, 0)
SPEC = NodeDeploySpec(node_id="n1", replicas=(REPLICA,))
ALL = {AGENT, DCGM_EXPORTER, DCGM[0], FABRICMANAGER, PERSISTENCED}
PLAIN = {AGENT, PERSISTENCED}


def working() -> NodeFacts:
    return node_facts(gpus=1, driver="580.95.05", packages={"nvidia-open": "580.95.05-1"})


@pytest.mark.parametrize(
    ("level", "running", "fail", "ok"),
    [
        (RepairLevel.RESET, ALL, False, True),
        (RepairLevel.RESET, PLAIN, False, True),  # DCGM not on this node: not touched
        (RepairLevel.RESET, ALL, True, False),
        (RepairLevel.RELOAD, ALL, False, True),
        (RepairLevel.RELOAD, PLAIN, True, False),
    ],
)
def test_repair_stops_the_holders_around_the_fix_and_never_leaves_the_agent_stopped(
    tmp_path: Path, level: RepairLevel, running: set[str], fail: bool, ok: bool
) -> None:
    node = StandInNode(tmp_path, working(), running | {REPLICA.unit}, fail)
    result = repair_session(node, SPEC, level)  # type: ignore[arg-type]
    assert result.ok is ok, result.steps
    log = node.log()
    stops = [line for line in log if line.startswith("systemctl stop")]
    # The replicas first, on their own; then the holders in order, readers before NVML's keepers.
    order = [
        u for u in (AGENT, DCGM_EXPORTER, DCGM[0], FABRICMANAGER, PERSISTENCED) if u in running
    ]
    assert stops == [f"systemctl stop {REPLICA.unit}", f"systemctl stop {' '.join(order)}"]
    fix = next(i for i, line in enumerate(log) if line.startswith(("nvidia-smi -r", "modprobe -r")))
    starts = [line.split()[-1] for line in log[fix:] if line.startswith("systemctl start")]
    assert starts[: len(order)] == order[::-1]  # persistenced first, the agent last
    assert "nvidia-dcgm.service" not in "\n".join(log) or DCGM[0] in running
    if ok:
        assert node.running() == running | {REPLICA.unit}
        assert log[-1] == "denv-agent undrain"
    else:
        # Left drained with its replicas stopped, but the agent and the GPU daemons run again.
        assert node.running() == running and result.drained


@pytest.mark.parametrize("fail", [False, True])
def test_mig_mode_change_runs_with_the_holders_stopped_and_starts_them_after(
    tmp_path: Path, fail: bool
) -> None:
    replica = ReplicaSpec("llm.n1.0.0", "img:1", 8001, 0, mig_profile="3g.40gb")
    spec = NodeDeploySpec(node_id="n1", mig=(MigSlice(0, "3g.40gb", 2),), replicas=(replica,))
    running = {*ALL, replica.unit}
    node = StandInNode(tmp_path, working(), running, fail)
    (step,) = [
        s for s in plan_node(node.facts(), spec) if s.area == "mig" and s.title.startswith("GPU")
    ]
    (command,) = step.commands
    ok, output = node.run(command)
    assert ok is not fail, output
    assert "nvidia-smi -i 0 -mig 1" in node.log()
    assert node.running() == running  # the agent and the GPU's replica run again either way


@pytest.mark.parametrize(
    ("nvswitches", "started"),
    [(0, {PERSISTENCED}), (4, {PERSISTENCED, FABRICMANAGER})],
    ids=["PCIe", "NVSwitch board"],
)
def test_first_deploy_with_a_mig_layout_stops_the_daemons_it_started_before_the_mode_change(
    tmp_path: Path, nvswitches: int, started: set[str]
) -> None:
    # A fresh machine: nothing runs when it is probed; the driver steps start persistenced
    # (and fabric manager on an NVSwitch board) in this same run, before the MIG step.
    spec = NodeDeploySpec(node_id="n1", mig=(MigSlice(0, "3g.40gb", 2),))
    node = StandInNode(tmp_path, node_facts(gpus=1, nvswitches=nvswitches), set(), False)
    steps = plan_node(node.facts(), spec)
    for step in steps[: next(i for i, s in enumerate(steps) if s.title.startswith("GPU 0"))]:
        for command in step.commands:
            if step.area == "driver" and command.startswith("systemctl"):  # no apt here
                assert node.run(command)[0], command
    assert node.running() == started
    (command,) = next(s for s in steps if s.title.startswith("GPU 0")).commands
    ok, output = node.run(command)
    assert ok, output
    assert "nvidia-smi -i 0 -r" in node.log()
    assert node.running() == started


@pytest.mark.parametrize("fail", [False, True])
def test_deploy_reload_of_a_mismatched_driver_stops_and_restarts_what_holds_it(
    tmp_path: Path, fail: bool
) -> None:
    facts = node_facts(
        gpus=1,
        packages={"nvidia-open": "580.95.05-1"},
        smi_error="Failed to initialize NVML: Driver/library version mismatch",
    )
    running = {AGENT, PERSISTENCED, REPLICA.unit}
    node = StandInNode(tmp_path, facts, running, fail)
    (step,) = [s for s in plan_node(node.facts(), SPEC) if s.title == "reload the kernel modules"]
    ok, output = node.run(step.commands[0])
    assert ok is not fail, output
    assert node.running() == running
