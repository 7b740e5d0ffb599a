"""`denv node`: clear one-line errors, exit 2 for bad input, never a traceback or a key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from denv_iac.cli.node import node
from denv_iac.local.processes import free_port
from denv_iac.node import NodeDeploySpec, firewall
from denv_iac.node.facts import NodeFacts


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(node, list(args))
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    return result.exit_code, result.output


def test_unreachable_host_is_one_clear_line() -> None:
    port = free_port()
    code, output = run("join", f"127.0.0.1:{port}", "--site", "s1")
    assert code == 1
    assert output.startswith(f"error: cannot connect to 127.0.0.1:{port}: ")
    assert output.count("\n") == 1


def test_unreadable_and_invalid_keys_are_named_never_shown(tmp_path: Path) -> None:
    code, output = run("drain", "box.example", "--key", str(tmp_path / "missing"))
    assert (code, output) == (
        2,
        f"error: --key {tmp_path / 'missing'}: cannot read it (No such file or directory)\n",
    )
    key = tmp_path / "id_bad"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n")
    code, output = run("join", f"127.0.0.1:{free_port()}", "--site", "s1", "--key", str(key))
    assert code == 1 and "c2VjcmV0" not in output and str(key) in output


def test_bad_spec_input_exits_2(tmp_path: Path) -> None:
    assert run("join", "@local", "--site", "s1", "--balancer", "lb.example") == (
        2,
        "error: balancer_addresses 'lb.example': give an IP address or CIDR\n",
    )
    assert run("join", "@chroot/nonexistent-root", "--site", "s1") == (
        2,
        "error: HOST @chroot/nonexistent-root: /nonexistent-root is not a root file system"
        " (no /bin/sh)\n",
    )
    code, output = run("repair", "@local", "--level", "reboot")
    assert code == 2 and output == (
        "error: --level reboot: @local is not a machine of its own; use SSH\n"
    )
    code, output = run("repair", "@local", "--level", "wipe")
    assert code == 2 and "'wipe' is not one of 'reset', 'reload', 'reinstall', 'reboot'" in output


def test_a_host_with_a_control_character_is_refused_in_one_line_per_problem() -> None:
    result = CliRunner().invoke(node, ["join", ":\r", "--site", "s", "--dry"])
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert all(line.startswith("error: ") for line in lines), lines
    assert "error: HOST ':\\r': the port after ':' must be a number" in lines


def test_a_join_the_firewall_would_shut_out_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    facts = NodeFacts(systemd=True, ssh_client="192.0.2.50", ssh_port=22)
    spec = NodeDeploySpec("joined.box", admin_cidrs=("198.51.100.0/24",))

    def refuse(*_: object, **__: object) -> list[object]:
        return firewall.plan(facts, spec)  # raises before anything is planned, let alone run

    monkeypatch.setattr("denv_iac.cli.node.prepare_node", refuse)
    assert run("join", "@local", "--site", "s1") == (
        2,
        "error: @local: admin_cidrs: this deploy reaches the machine from 192.0.2.50, which "
        "admin_cidrs does not hold, so the firewall would shut it out; add 192.0.2.50 (or a "
        "block holding it) to admin_cidrs\n",
    )


def test_admin_addresses_reach_the_join_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    joined: list[NodeDeploySpec] = []

    def record(_target: object, spec: NodeDeploySpec, **_: object) -> list[object]:
        joined.append(spec)
        return []

    monkeypatch.setattr("denv_iac.cli.node.prepare_node", record)
    code, _ = run("join", "@local", "--site", "s1", "--admin", "198.51.100.0/24", "--admin", "::1")
    assert code == 0 and joined[0].admin_cidrs == ("198.51.100.0/24", "::1")
    assert run("join", "@local", "--site", "s1", "--admin", "office") == (
        2,
        "error: admin_cidrs 'office': give an IP address or CIDR\n",
    )


@pytest.mark.parametrize(
    ("args", "port"),
    [(("192.0.2.1:2222",), 2222), (("192.0.2.1", "--port", "2200"), 2200), (("192.0.2.1",), 22)],
)
def test_the_port_a_join_reaches_sshd_on_is_the_one_the_firewall_guards(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], port: int
) -> None:
    joined: list[NodeDeploySpec] = []

    def record(_target: object, spec: NodeDeploySpec, **_: object) -> list[object]:
        joined.append(spec)
        return []

    monkeypatch.setattr("denv_iac.cli.node.prepare_node", record)
    assert run("join", *args, "--site", "s1")[0] == 0
    assert joined[0].ssh_port == port


def test_a_join_on_a_port_a_replica_uses_is_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "node.json"
    replica = {"id": "r0", "image": "ghcr.io/acme/voice:1", "port": 8000, "gpu": 0}
    spec.write_text(json.dumps({"node_id": "s1.box", "replicas": [replica]}))
    assert run("join", "192.0.2.1:8000", "--site", "s1", "--spec", str(spec)) == (
        2,
        "error: 192.0.2.1:8000: replica 'r0' port 8000: already used by SSH\n",
    )


def test_a_join_on_the_agents_port_is_one_line() -> None:
    assert run("join", "192.0.2.1:9100", "--site", "s1") == (
        2,
        "error: 192.0.2.1:9100: agent_port 9100: SSH listens there; pick another\n",
    )
