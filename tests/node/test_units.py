"""The systemd units the node deploy writes, checked by systemd itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from denv_iac.node import agent, replicas

from .test_plan import spec


def _units() -> list[tuple[str, str]]:
    node = spec()
    written = [agent.unit(), *(replicas.unit(node, replica) for replica in node.replicas)]
    return [(Path(f.path).name, f.content.decode()) for f in written]


@pytest.mark.parametrize(("name", "text"), _units(), ids=[name for name, _ in _units()])
def test_units_restart_for_good(name: str, text: str) -> None:
    # systemd's default start limit would leave a crash-looping unit stopped for ever.
    assert "Restart=always" in text
    unit_section = text.split("[Service]", 1)[0]
    assert "StartLimitIntervalSec=0" in unit_section


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize(("name", "text"), _units(), ids=[name for name, _ in _units()])
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
