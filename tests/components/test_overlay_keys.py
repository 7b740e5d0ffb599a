"""The overlay's keys: made by a dynamic resource, the private half a secret everywhere."""

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pulumi
import pytest
from click.testing import CliRunner

from denv_iac.cli import main
from denv_iac.components.overlay import (
    Overlay,
    WireGuardKeyProvider,
    new_key_pair,
    wireguard_public_key,
)
from denv_iac.components.preview import (
    SECRET_MARK,
    SECRET_SHOWN,
    SECRET_SIG,
    run_program,
    shown,
)
from denv_iac.core.overlay_plan import PRIVATE_KEY_PLACEHOLDER, plan_overlay
from denv_iac.core.placement import place_replicas
from denv_iac.core.stack.reader import read_stack
from tests.test_overlay import HUB, config

KEY_TYPE = "pulumi-python:dynamic/denv:WireGuardKey"
STACKS = Path(__file__).resolve().parents[2] / "stacks"


def test_a_key_pair_is_two_base64_curve25519_keys_that_belong_together() -> None:
    private, public = new_key_pair()
    assert len(base64.b64decode(private, validate=True)) == 32
    assert len(base64.b64decode(public, validate=True)) == 32
    assert wireguard_public_key(private) == public
    assert new_key_pair()[0] != private


@pytest.mark.skipif(shutil.which("wg") is None, reason="wireguard-tools is not installed")
def test_wg_derives_the_same_public_key() -> None:
    private, public = new_key_pair()
    derived = subprocess.run(
        ["wg", "pubkey"], input=private, capture_output=True, text=True, check=True, timeout=10
    )
    assert derived.stdout.strip() == public


def test_the_provider_makes_a_key_on_create_and_replaces_it_only_for_another_machine() -> None:
    provider = WireGuardKeyProvider()
    made = provider.create({"member": "office.rack-1"})
    assert made.id == "office.rack-1"
    assert wireguard_public_key(made.outs["private_key"]) == made.outs["public_key"]
    assert (
        provider.create({"member": "office.rack-1"}).outs["private_key"]
        != (made.outs["private_key"])
    )
    same = provider.diff("office.rack-1", made.outs, {"member": "office.rack-1"})
    assert (same.changes, same.replaces) == (False, [])
    moved = provider.diff("office.rack-1", made.outs, {"member": "office.rack-2"})
    assert (moved.changes, moved.replaces) == (True, ["member"])


def _overlay_program() -> tuple[Any, Any]:
    stack = read_stack("s", config())
    plan = plan_overlay(stack, place_replicas(stack))
    made: dict[str, Overlay] = {}

    def program() -> dict[str, pulumi.Output[Any]]:
        overlay = Overlay("s-overlay", plan, {HUB: pulumi.Output.from_input("198.18.0.9")})
        made["overlay"] = overlay
        return {
            "configs": overlay.configs,
            "public_keys": overlay.public_keys,
            "private": pulumi.Output.all(*overlay.private_keys.values()),
        }

    return plan, program


def test_one_key_per_machine_each_private_key_masked() -> None:
    plan, program = _overlay_program()
    run = run_program(program, preview=True)
    keys = run.of_type(KEY_TYPE)
    # Named by the member, a machine made for the balancer without the ':' of its member name.
    names = [m.name if m.node else f"{m.site}-balancer-host" for m in plan.members]
    assert sorted(r.name for r in keys) == sorted(f"s-overlay-{name}" for name in names)
    assert HUB not in names and not any(":" in r.name for r in keys)
    assert sorted(r.inputs["member"] for r in keys) == sorted(m.name for m in plan.members)
    for registration in keys:
        assert shown(registration.inputs)["private_key"] == SECRET_SHOWN
        assert registration.inputs["private_key"][SECRET_SIG] == SECRET_MARK
    assert all(r.parent.endswith("denv:index:Overlay::s-overlay") for r in keys)


def test_the_configs_name_each_peer_by_its_public_key_and_hold_no_private_key() -> None:
    plan, program = _overlay_program()
    run = run_program(program, preview=False)
    configs, public = run.outputs["configs"], run.outputs["public_keys"]
    assert sorted(configs) == sorted(m.name for m in plan.members)
    for member in plan.members:
        text = configs[member.name]
        assert f"PrivateKey = {PRIVATE_KEY_PLACEHOLDER}" in text
        for peer in plan.peers(member.name):
            assert f"PublicKey = {public[peer.name]}" in text
    # The balancer host made for the stack is dialled at the address it got once created.
    assert "Endpoint = 198.18.0.9:51820" in configs["office.rack-1"]
    assert json.dumps(configs).count("Endpoint") == 5 + 4  # the NAT'd node is never dialled


def test_denv_plan_resources_shows_the_overlay_with_every_private_key_masked(
    tmp_path: Path,
) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--stack", "voice-multicloud", "--stacks-dir", str(STACKS), "--resources"]
    result = CliRunner().invoke(main, [*args, "--json", str(out)], terminal_width=300)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    members = [m["name"] for m in document["overlay"]["members"]]
    keys = [r for r in document["resources"] if r["type"] == KEY_TYPE]
    assert sorted(k["inputs"]["member"] for k in keys) == sorted(members) and len(members) > 5
    assert all(k["inputs"]["private_key"] == SECRET_SHOWN for k in keys)
    assert all(k["parent"] == "voice-multicloud-overlay" for k in keys)
    shown_on_screen = CliRunner().invoke(main, args, terminal_width=300).output
    masked = re.findall(r"(?<!ssh_)(?<!overlay_)private_key=\[secret\]", shown_on_screen)
    assert len(masked) == len(members)
    # Each member's deploy takes its key as a secret too.
    deploys = [r for r in document["resources"] if "overlay_private_key" in r["inputs"]]
    assert len(deploys) == len(members)
    assert all(r["inputs"]["overlay_private_key"] == SECRET_SHOWN for r in deploys)
    assert len(re.findall(r"overlay_private_key=\[secret\]", shown_on_screen)) == len(members)
