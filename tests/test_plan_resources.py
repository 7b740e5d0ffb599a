"""`denv plan --resources`: the stack's resource graph under Pulumi's mocks, secrets masked."""

import asyncio
import copy
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml
from click.testing import CliRunner
from rich.console import Console

from denv_iac.cli import main
from denv_iac.cli.plan_view import key_inputs, render_resources
from denv_iac.components.preview import PreviewResource, preview_cluster, run_program, shown
from tests.components import stacks

ROOT = Path(__file__).resolve().parents[1]
CIPHERTEXT = "v1:c2FtcGxlLWNpcGhlcnRleHQtdGVzdA=="


def _secret_lines() -> list[str]:
    # The inner lines of each PEM key and certificate: any one of them is plaintext leaking.
    return [line for secret in stacks.SECRETS for line in secret.splitlines()[1:-1]]


def _with_secure(value: Any, secure: str | None) -> Any:
    """The config with every `{secure: ...}` value replaced by `secure` (None: kept)."""
    if isinstance(value, dict):
        if set(value) == {"secure"}:
            return {"secure": value["secure"] if secure is None else secure}
        return {k: _with_secure(v, secure) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_secure(v, secure) for v in value]
    return value


def _write_stack(folder: Path, secure: str | None = None) -> Path:
    args = stacks.multicloud()
    config = {
        "denv:sites": args["sites"],
        "denv:recipes": args["recipes"],
        "denv:balancer": args["balancer"],
    }
    text = yaml.safe_dump({"config": _with_secure(copy.deepcopy(config), secure)})
    (folder / "Pulumi.mc.yaml").write_text(text, "utf-8")
    return folder


def _plan(*args: str) -> Any:
    return CliRunner().invoke(main, ["plan", *args])


def test_local_plan_prints_the_tree_beside_the_placement() -> None:
    result = _plan("--stack", "local", "--stacks-dir", str(ROOT / "stacks"), "--resources")
    assert result.exit_code == 0, result.output
    assert "voice.local.node-a.0" in result.output  # the placement is still there
    tree = result.output[result.output.index("Resources (8") :]  # a pool each: voice side tts stt
    assert "└── local denv:index:Cluster" in tree
    for child in ("local-local denv:index:LocalSite", "local-balancer denv:index:GlobalBalancer"):
        assert f"    ├── {child}" in tree or f"    └── {child}" in tree


def test_json_lists_each_resource_with_its_parent_and_inputs(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    folder = _write_stack(tmp_path, CIPHERTEXT)
    result = _plan("--stack", "mc", "--stacks-dir", str(folder), "--resources", "--json", str(out))
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert set(plan) >= {"replicas", "nodes", "cost", "resources"}
    by_name = {r["name"]: r for r in plan["resources"]}
    assert all(set(r) == {"type", "name", "parent", "inputs"} for r in plan["resources"])
    assert by_name["mc"] == {"type": "denv:index:Cluster", "name": "mc", "parent": "", "inputs": {}}
    node = by_name["mc-aws-use1-node-0"]
    assert node["type"] == "aws:ec2/instance:Instance"
    assert node["parent"] == "mc-aws-use1"
    assert node["inputs"]["instanceType"] == "p5.4xlarge"
    assert by_name["mc-aws-use1"]["parent"] == "mc"
    # Offline a key cannot be decrypted: its public half is unknown, never read from ciphertext.
    assert by_name["mc-aws-use1-ssh-key"]["inputs"]["publicKey"] == "[unknown]"
    assert CIPHERTEXT not in out.read_text() and CIPHERTEXT not in result.output


def test_plaintext_secure_values_never_reach_the_output(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    folder = _write_stack(tmp_path)  # `{secure: <plaintext key>}`, as the engine would decrypt
    result = _plan("--stack", "mc", "--stacks-dir", str(folder), "--resources", "--json", str(out))
    assert result.exit_code == 0, result.output
    for line in _secret_lines():
        assert line not in result.output
        assert line not in out.read_text()


def test_secrets_given_to_the_components_stay_masked_in_tree_and_json() -> None:
    resources = preview_cluster("prod", stacks.multicloud)
    # 50 (an Elastic IP per AWS machine among them; the AWS nodes' groups take one WireGuard
    # rule per balancer host), a NodeSetup and its deploy per machine reached over SSH, and the
    # overlay with a key per machine (9), and the balancer hosts' WireGuard rules: one per node
    # on the AWS host (7), the hcloud host's overlay firewall and its attachment
    assert len(resources) == 87
    screen = io.StringIO()
    render_resources(resources, Console(file=screen, width=300))
    printed = screen.getvalue()
    dumped = json.dumps([r.to_json() for r in resources])
    for line in _secret_lines():
        assert line not in printed and line not in dumped
    # The public half of a key is no secret and is shown as derived.
    key = next(r for r in resources if r.name == "prod-aws-use1-ssh-key")
    assert key.inputs["publicKey"].startswith("ssh-ed25519 ")


def test_a_secret_input_shows_as_secret_never_its_value() -> None:
    def program() -> dict[str, pulumi.Output[Any]]:
        thing = pulumi.CustomResource(
            "test:index:Thing", "thing", {"token": pulumi.Output.secret("hunter2"), "size": 8}
        )
        return {"id": thing.id}

    registration = run_program(program, preview=True).named("thing")
    inputs = shown(registration.inputs)
    assert inputs == {"token": "[secret]", "size": 8}
    assert key_inputs(PreviewResource("test:index:Thing", "thing", "", inputs)) == (
        "size=8 token=[secret]"
    )
    assert "hunter2" not in json.dumps(inputs)


@pytest.mark.parametrize(
    ("rule", "shown_as"),
    [
        # Lambda's ruleset
        (
            {"protocol": "udp", "port_range": [51820.0, 51820.0], "source_network": "1.2.3.4/32"},
            "udp/51820 from 1.2.3.4/32",
        ),
        (
            {"protocol": "tcp", "port_range": [8000, 8007], "source_network": "1.2.3.4/32"},
            "tcp/8000-8007 from 1.2.3.4/32",
        ),
        # Robot's, a discard rule among them, and a reply rule with no source
        (
            {"protocol": "udp", "dst_port": "51820", "action": "discard"},
            "deny udp/51820 from any",
        ),
        ({"protocol": "icmp", "action": "accept"}, "icmp from any"),
        # hcloud's
        (
            {"direction": "in", "protocol": "udp", "port": "51820", "sourceIps": ["::/0"]},
            "udp/51820 from ::/0",
        ),
    ],
)
def test_a_firewalls_rules_show_at_a_glance(rule: dict[str, Any], shown_as: str) -> None:
    resource = PreviewResource("test:index:Firewall", "fw", "", {"rules": [rule, rule]})
    assert key_inputs(resource) == f"rules=[{shown_as}, {shown_as}]"


def test_voice_multicloud_lists_every_site_kinds_resources_with_secrets_masked(
    tmp_path: Path,
) -> None:
    out = tmp_path / "plan.json"
    stack_args = ["--stack", "voice-multicloud", "--stacks-dir", str(ROOT / "stacks")]
    result = _plan(*stack_args, "--resources", "--json", str(out))
    assert result.exit_code == 0, result.output
    resources = json.loads(out.read_text())["resources"]
    types = {r["type"] for r in resources}
    assert {
        "denv:index:AwsSite",
        "denv:index:LambdaSite",
        "denv:index:NebiusSite",
        "denv:index:HetznerSite",
        "denv:index:JoinedSite",
    } <= types
    # the machines each cloud site creates for its nodes
    assert {
        "aws:ec2/instance:Instance",
        "pulumi-python:dynamic/lambda:Instance",
        "nebius:index/computeV1Instance:ComputeV1Instance",
    } <= types
    by_name = {r["name"]: r["inputs"] for r in resources}
    assert by_name["voice-multicloud-lambda-use1-node-0"]["api_key"] == "[secret]"
    # each GEX box's Robot firewall, its webservice credentials masked
    firewalls = sorted(
        r["name"] for r in resources if r["type"] == "pulumi-python:dynamic/hetzner:RobotFirewall"
    )
    assert firewalls == [
        "voice-multicloud-hetzner-fsn-robot-firewall-gex-1",
        "voice-multicloud-hetzner-fsn-robot-firewall-gex-2",
    ]
    firewall = by_name[firewalls[0]]
    assert (firewall["robot_user"], firewall["robot_password"]) == ("[secret]", "[secret]")
    assert firewall["address"] == "203.0.113.21"
    text = yaml.safe_load((ROOT / "stacks" / "Pulumi.voice-multicloud.yaml").read_text())
    ciphertexts = [v for v in _secure_values(text) if v]
    assert ciphertexts
    for ciphertext in ciphertexts:
        assert ciphertext not in out.read_text() and ciphertext not in result.output


def _secure_values(value: Any) -> list[str]:
    if isinstance(value, dict):
        if set(value) == {"secure"}:
            return [str(value["secure"])]
        return [s for v in value.values() for s in _secure_values(v)]
    if isinstance(value, list):
        return [s for v in value for s in _secure_values(v)]
    return []


def test_a_plain_plan_does_not_import_pulumi() -> None:
    code = "import sys, denv_iac.cli; print('pulumi' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_a_duplicate_urn_is_refused_as_the_engine_would() -> None:
    def program() -> dict[str, pulumi.Output[Any]]:
        first = pulumi.CustomResource("test:index:Thing", "thing", {"size": 1})
        pulumi.CustomResource("test:index:Thing", "thing", {"size": 2})
        return {"id": first.id}

    with pytest.raises(Exception, match=r"duplicate URN .*test:index:Thing::thing"):
        run_program(program, preview=True)


def test_the_preview_runs_after_asyncio_run_left_the_thread_without_a_loop() -> None:
    asyncio.run(asyncio.sleep(0))  # as any asyncio program before it would
    run = run_program(lambda: {"answer": pulumi.Output.from_input(42)}, preview=False)
    assert run.outputs == {"answer": 42}
