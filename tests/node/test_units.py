"""The systemd units the node deploy writes, checked by systemd itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from denv_iac.node import ReplicaSpec, agent, replicas
from denv_iac.node.wireguard import UNIT as OVERLAY_UNIT

from .test_plan import spec

OVERLAY_ADDRESS = "10.99.4.7"


def _units() -> list[tuple[str, str]]:
    written = []
    for node in (spec(), spec(listen_address=OVERLAY_ADDRESS)):
        written += [agent.unit(node), *(replicas.unit(node, r) for r in node.replicas)]
    # Each overlay unit is written to a folder of its own, under the same name.
    return [(Path(f.path).name, f.content.decode()) for f in written]


def _ids() -> list[str]:
    return [f"{name}{'-overlay' if OVERLAY_UNIT in text else ''}" for name, text in _units()]


@pytest.mark.parametrize(("name", "text"), _units(), ids=_ids())
def test_units_restart_for_good(name: str, text: str) -> None:
    # systemd's default start limit would leave a crash-looping unit stopped for ever.
    assert "Restart=always" in text
    unit_section = text.split("[Service]", 1)[0]
    assert "StartLimitIntervalSec=0" in unit_section


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize(("name", "text"), _units(), ids=_ids())
def test_systemd_reads_each_unit_without_a_complaint(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    checked = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Executables the unit names (docker, the agent) are not on this machine: that is all
    # systemd may say; an unknown or misplaced setting would be reported too.
    complaints = [
        line
        for line in checked.stderr.splitlines()
        if "is not executable" not in line
        and "No such file or directory" not in line
        and "not found" not in line
        and line.strip()
    ]
    assert complaints == [], checked.stderr


@pytest.mark.parametrize("listen_address", ["", OVERLAY_ADDRESS])
def test_units_that_bind_the_overlay_address_start_after_it_and_go_down_with_it(
    listen_address: str,
) -> None:
    node = spec(listen_address=listen_address)
    for unit in [agent.unit(node), *(replicas.unit(node, r) for r in node.replicas)]:
        section = unit.content.decode().split("[Service]", 1)[0].splitlines()
        expected = [f"After={OVERLAY_UNIT}", f"Requires={OVERLAY_UNIT}"] if listen_address else []
        assert [line for line in section if OVERLAY_UNIT in line] == expected, unit.path


def test_each_replica_is_told_its_own_port_which_its_recipe_env_cannot_move() -> None:
    # Host networking: two replicas of one recipe on a node must listen on different ports.
    base = spec()
    moved = ReplicaSpec(
        "voice.hetzner.gex44-1.1", "ghcr.io/acme/voice:1.4", 8001, 1, env={"PORT": "9999"}
    )
    node = spec(replicas=(base.replicas[0], moved))
    texts = [replicas.env_file(node, r).content.decode() for r in node.replicas]
    assert [line for t in texts for line in t.splitlines() if line.startswith("PORT=")] == [
        "PORT=8000",
        "PORT=8001",
    ]
