"""The container runtime area: which engines count, so none is installed over a working one."""

from __future__ import annotations

import pytest

from denv_iac.node import NodeDeploySpec, runtime

from .fixtures import node_facts

TOOLKIT = {"nvidia-container-toolkit": "1.17.8-1"}
DOCKER_CE = {"docker-ce": "5:28.0.4-1~ubuntu.22.04~jammy", "containerd.io": "1.7.27-1"}
SPEC = NodeDeploySpec(node_id="n1")


@pytest.mark.parametrize(
    ("case", "packages", "docker_cli", "active", "installed"),
    [
        ("nothing there", {}, False, (), "docker.io"),
        ("Docker CE from Docker's repository", DOCKER_CE, True, ("docker.service",), ""),
        ("Docker CE installed, daemon stopped", DOCKER_CE, True, (), ""),
        ("static docker binaries, daemon running", {}, True, ("docker.service",), ""),
        ("a docker command without a daemon (podman-docker)", {}, True, (), "docker.io"),
        ("Debian's docker.io", {"docker.io": "20.10.24"}, True, (), ""),
    ],
)
def test_a_working_engine_is_kept_and_never_replaced_by_docker_io(
    case: str,
    packages: dict[str, str],
    docker_cli: bool,
    active: tuple[str, ...],
    installed: str,
) -> None:
    facts = node_facts(
        packages={
            **packages,
            **(TOOLKIT if installed != "docker.io nvidia-container-toolkit" else {}),
        },
        docker_cli=docker_cli,
        active_units=frozenset(active),
    )
    steps = runtime.plan(facts, SPEC)
    installs = [s.title.removeprefix("install ") for s in steps if s.title.startswith("install")]
    assert installs == ([installed] if installed else []), case
    text = "\n".join(c for s in steps for c in s.commands)
    if not installed:
        assert "docker.io" not in text, case
