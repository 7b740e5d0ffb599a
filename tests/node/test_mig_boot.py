"""The MIG layout comes back after a reboot: a oneshot unit recreates the GPU instances before
the replicas that run on them start, and does nothing where they are there already."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from denv_iac.node import (
    MigSlice,
    NodeDeploySpec,
    ReplicaSpec,
    Step,
    firewall,
    mig,
    plan_node,
    replicas,
)
from denv_iac.node.plan import removal_steps
from denv_iac.node.steps import unit_path, wants_link

from .fixtures import DEBIAN_12, converged, node_facts

RUNTIME = {"docker.io": "26.1.5", "nvidia-container-toolkit": "1.17.8-1", "cuda-keyring": "1.1-1"}
FRESH = {"nvidia-open": "580.95.05-1", "nvidia-driver-pinning-580": "580.95.05-1", **RUNTIME}
SLICED = ReplicaSpec("llm.n1.1.0", "img:1", 8001, 1, mig_profile="3g.40gb", mig_instance=1)
WHOLE = ReplicaSpec("voice.n1.0", "img:1", 8000, 0)
MIG_SPEC = NodeDeploySpec(
    node_id="n1",
    mig=(MigSlice(1, "3g.40gb", 2), MigSlice(1, "1g.10gb")),
    replicas=(WHOLE, SLICED),
)
NO_MIG = dataclasses.replace(MIG_SPEC, mig=(), replicas=(WHOLE,))


def boot(steps: list[Step]) -> list[str]:
    return [s.title for s in steps if s.area == "mig" and not s.title.startswith("GPU")]


def test_boot_unit_recreates_the_layout_after_the_driver_and_before_the_replicas() -> None:
    script, unit = mig.files(MIG_SPEC)
    assert (script.path, script.mode, unit.path) == (
        mig.RESTORE,
        "0755",
        unit_path("denv-mig.service"),
    )
    text = unit.content.decode()
    assert "Type=oneshot\nRemainAfterExit=yes\n" in text
    assert "After=systemd-modules-load.service nvidia-persistenced.service" in text
    assert f"ExecStart={mig.RESTORE} 1=3g.40gb,3g.40gb,1g.10gb\n" in text
    assert text.endswith("[Install]\nWantedBy=multi-user.target\n")
    sliced = replicas.unit(MIG_SPEC, SLICED).content.decode()
    assert "After=docker.service denv-agent.service denv-mig.service\n" in sliced
    assert "Requires=docker.service denv-mig.service\n" in sliced
    # A whole GPU needs no instance: its replica starts whatever the MIG unit does.
    assert "denv-mig" not in replicas.unit(MIG_SPEC, WHOLE).content.decode()
    assert mig.files(NO_MIG) == []


@pytest.mark.parametrize(
    ("case", "facts", "spec", "titles"),
    [
        (
            "fresh node with a layout",
            node_facts(),
            MIG_SPEC,
            [
                f"write {mig.RESTORE}",
                "write /etc/systemd/system/denv-mig.service",
                "enable the boot unit",
            ],
        ),
        (
            "image build (no systemd)",
            node_facts(os=DEBIAN_12, systemd=False),
            MIG_SPEC,
            [
                f"write {mig.RESTORE}",
                "write /etc/systemd/system/denv-mig.service",
                "enable the boot unit (no systemd)",
            ],
        ),
        ("no layout, never had one", node_facts(), NO_MIG, []),
        (
            "layout dropped",
            converged(node_facts(), MIG_SPEC, FRESH),
            NO_MIG,
            ["remove the boot unit (no MIG layout)"],
        ),
    ],
)
def test_boot_unit_steps(case: str, facts: object, spec: NodeDeploySpec, titles: list[str]) -> None:
    steps = plan_node(facts, spec)  # type: ignore[arg-type]
    assert boot(steps) == titles, case
    if spec is MIG_SPEC and facts.systemd:  # type: ignore[attr-defined]
        order = [s.title for s in steps]
        # Written and known to systemd before the replica unit that Requires it is started.
        assert order.index(titles[-1]) < order.index(f"{SLICED.id}: (re)start"), case


def test_second_run_changes_nothing_and_removal_is_final() -> None:
    after = converged(node_facts(), MIG_SPEC, FRESH)
    assert wants_link(mig.UNIT) in after.links
    assert plan_node(after, MIG_SPEC) == []
    removed = dataclasses.replace(
        converged(after, NO_MIG, FRESH),
        files={k: v for k, v in after.files.items() if k not in mig.PATHS},
    )
    assert boot(plan_node(removed, NO_MIG)) == []


STANDIN_SMI = """#!/bin/sh
# nvidia-smi -L lists $NODE/gpus; `mig -i N -cgi P,P -C` adds N's instances, logged.
if [ "$1" = -L ]; then cat "$NODE/gpus"; exit 0; fi
echo "$*" >> "$NODE/log"
gpu=$3
for p in $(echo "$5" | tr , ' '); do
  awk -v g="$gpu" -v p="$p" '{ print }
    $1 == "GPU" && $2 == g":" { print "  MIG " p " Device 0: (UUID: MIG-x)" }' \
    "$NODE/gpus" > "$NODE/gpus.new" && mv "$NODE/gpus.new" "$NODE/gpus"
done
"""


def test_restore_script_creates_missing_instances_once(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text(STANDIN_SMI)
    smi.chmod(0o755)
    script = tmp_path / "restore"
    script.write_bytes(mig.files(MIG_SPEC)[0].content)
    script.chmod(0o755)
    # After a reboot: MIG mode kept, instances gone; GPU 0 is outside the layout.
    (tmp_path / "gpus").write_text(
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\n"
    )
    env = {"PATH": f"{tmp_path}/bin:/usr/bin:/bin", "NODE": str(tmp_path)}
    argv = [str(script), "1=3g.40gb,3g.40gb,1g.10gb"]
    for _ in range(2):  # the second run finds the instances there and changes nothing
        subprocess.run(argv, env=env, check=True)
    assert (tmp_path / "log").read_text() == "mig -i 1 -cgi 3g.40gb,3g.40gb,1g.10gb -C\n"
    assert (tmp_path / "gpus").read_text().count("  MIG ") == 3


@pytest.mark.parametrize(
    ("case", "spec", "titles"),
    [
        (
            "MIG node",
            MIG_SPEC,
            [
                f"{SLICED.id}: remove (no longer placed here)",
                f"{WHOLE.id}: remove (no longer placed here)",
                "remove the boot unit (no MIG layout)",
                "remove the node's firewall",
            ],
        ),
        (
            "whole GPUs only",
            NO_MIG,
            [f"{WHOLE.id}: remove (no longer placed here)", "remove the node's firewall"],
        ),
    ],
)
def test_leaving_the_stack_removes_the_replicas_then_the_boot_unit_then_the_firewall(
    case: str, spec: NodeDeploySpec, titles: list[str]
) -> None:
    facts = converged(node_facts(), spec, FRESH)
    steps = removal_steps(facts, spec)
    assert [s.title for s in steps] == titles, case
    gone = dataclasses.replace(
        facts,
        replica_units=frozenset(),
        files={
            k: v
            for k, v in facts.files.items()
            if k not in (*mig.PATHS, firewall.RULES, unit_path(firewall.UNIT))
        },
    )
    assert removal_steps(gone, spec) == []
    (remove_firewall,) = [s for s in steps if s.area == "firewall"]
    # Stopping the unit runs its ExecStop, which deletes the table; then its files go.
    assert remove_firewall.commands == (
        f"systemctl disable --now {firewall.UNIT}",
        f"rm -f {firewall.RULES} {unit_path(firewall.UNIT)} {wants_link(firewall.UNIT)}",
    )
