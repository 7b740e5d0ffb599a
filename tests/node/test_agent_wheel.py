"""A node gets the agent installed here, as a wheel the deploy uploads; never a name on an index."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from denv_iac.node import plan_node
from denv_iac.node.agent_wheel import agent_wheel
from denv_iac.node.spec import AgentSettings, NodeDeploySpec, NodeSpecError, ReplicaSpec
from tests.wheelhouse import no_index

from .fixtures import node_facts

VERSION = version("denv-agent")
SPEC = NodeDeploySpec(
    node_id="office.rack-1",
    replicas=(ReplicaSpec("voice.office.rack-1.0", "ghcr.io/acme/voice:1.4", 8000, 0),),
    balancer_addresses=("203.0.113.10",),
    agent=AgentSettings(version=VERSION),
)


def _run(*args: str | Path) -> str:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_the_deploy_uploads_the_agent_here_and_installs_that_file() -> None:
    (step,) = [
        s for s in plan_node(node_facts(driver="580.95.05"), SPEC) if "install denv" in s.title
    ]
    name, data = agent_wheel()
    assert name == f"denv_agent-{VERSION}-py3-none-any.whl"
    assert step.file is not None and step.file.content == data
    assert step.file.path.endswith(f"/{name}")
    (command,) = step.commands
    assert command.endswith(f"--force-reinstall {step.file.path}")
    assert "denv-agent==" not in command


def test_packing_twice_gives_the_same_bytes() -> None:
    # The node compares the uploaded file by its digest: an unchanged agent must not look new.
    assert agent_wheel() == agent_wheel()


def test_an_agent_version_other_than_the_one_here_needs_its_wheel() -> None:
    spec = dataclasses.replace(SPEC, agent=AgentSettings(version="9.9.9"))
    with pytest.raises(NodeSpecError, match=r"agent\.version 9\.9\.9: the denv-agent here is "):
        plan_node(node_facts(driver="580.95.05"), spec)


def test_the_packed_wheel_installs_and_runs(tmp_path: Path) -> None:
    name, data = agent_wheel()
    wheel = tmp_path / name
    wheel.write_bytes(data)
    uv = shutil.which("uv")
    assert uv, "uv is not on PATH; `make setup` installs it"
    _run(uv, "venv", "--quiet", "--python", sys.executable, tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    _run(uv, "pip", "install", *no_index(), "--quiet", "--python", python, wheel)
    _run(python, "-m", "denv_agent", "--help")
    assert "GPU and replica health" in _run(tmp_path / "venv" / "bin" / "denv-agent", "--help")
    listed = _run(uv, "pip", "show", "--files", "--python", python, "denv-agent")
    assert f"Version: {VERSION}" in listed and "denv_agent/agent.py" in listed
