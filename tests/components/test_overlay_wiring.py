"""The overlay wired into the deploy: each machine's NodeSetup gets its config and its key."""

import copy
import re
from typing import Any

import pytest

from denv_iac.components.cluster import validate_cluster
from denv_iac.components.node_setup import NodeSetupProvider
from denv_iac.components.overlay import new_key_pair
from denv_iac.components.preview import SECRET_MARK, SECRET_SHOWN, SECRET_SIG, shown
from denv_iac.core.overlay_plan import PRIVATE_KEY_PLACEHOLDER, plan_overlay
from denv_iac.node import NodeDeploySpec, ReplicaSpec
from denv_iac.node.firewall import BalancerAccess
from denv_iac.node.spec import spec_to_json
from tests.components import stacks
from tests.components.harness import cluster_outputs, plain_strings, run_program
from tests.components.test_node_setup import BALANCER, DEPLOYMENT, KEY, Recorder

PRIVATE, _ = new_key_pair()
CONFIG = (
    "[Interface]\nAddress = 10.99.4.7/16\nListenPort = 51820\n"
    f"PrivateKey = {PRIVATE_KEY_PLACEHOLDER}\n"
)
SPEC = NodeDeploySpec(
    node_id="office.rack-1",
    replicas=(ReplicaSpec("side.office.rack-1.0", "ghcr.io/acme/side:2", 8000, 0),),
    listen_address="10.99.4.7",
)
NODE = {
    "host": "192.0.2.10",
    "ssh_user": "root",
    "ssh_private_key": KEY,
    "node": spec_to_json(SPEC),
    "balancer_addresses": ["10.99.0.9"],
    "overlay_config": CONFIG,
    "overlay_private_key": PRIVATE,
    "overlay_senders": ["203.0.113.9"],
}


def test_the_node_deploy_gets_its_config_with_the_key_filled_in_and_its_peers() -> None:
    recorder = Recorder(steps=1)
    result = NodeSetupProvider(recorder.runner()).create(dict(NODE))
    (spec,) = [what for kind, _, what in recorder.calls if kind == "node"]
    assert (spec.listen_address, spec.overlay_senders) == ("10.99.4.7", ("203.0.113.9",))
    assert spec.balancer_addresses == ("10.99.0.9",)
    ((config, _),) = recorder.extras  # then the login's keys (tests/node/test_ssh_keys.py)
    assert config == CONFIG.replace(PRIVATE_KEY_PLACEHOLDER, PRIVATE)
    # What the deploy reports holds no key (the outs keep it only as the secret input it is).
    assert result.outs is not None and PRIVATE not in str(result.outs["applied"])


@pytest.mark.parametrize(
    "change",
    [
        {"overlay_private_key": new_key_pair()[0]},  # this machine's key rotated
        {"overlay_config": CONFIG + "\n[Peer]\n# a peer's key rotated or a node added\n"},
        {"overlay_senders": ["203.0.113.9", "203.0.113.10"]},
    ],
    ids=["own-key", "peers", "senders"],
)
def test_a_changed_key_or_config_reruns_the_deploy_in_place(change: dict[str, Any]) -> None:
    provider = NodeSetupProvider(Recorder().runner())
    diff = provider.diff("office.rack-1", dict(NODE), {**NODE, **change})
    assert (diff.changes, diff.replaces) == (True, [])


def test_off_the_overlay_the_node_deploy_gets_no_config() -> None:
    recorder = Recorder()
    off = {k: v for k, v in NODE.items() if not k.startswith("overlay_")}
    off["node"] = spec_to_json(NodeDeploySpec(node_id="office.rack-1"))
    NodeSetupProvider(recorder.runner()).create(off)
    ((config, _),) = recorder.extras
    assert config is None
    assert "listen_address" not in off["node"]  # the state of a stack without it is unchanged


def test_a_balancer_host_gets_its_config_and_its_wireguard_guard() -> None:
    recorder = Recorder(steps=1)
    on = {
        **BALANCER,
        "overlay_config": CONFIG,
        "overlay_private_key": PRIVATE,
        "overlay_senders": ["198.18.0.2", "198.18.0.1"],
        "overlay_port": 51820.0,  # as the engine hands it
    }
    NodeSetupProvider(recorder.runner()).create(on)
    ((access, _, _, _, config, _),) = recorder.extras
    assert access == BalancerAccess((), 0, 51820, ("198.18.0.1", "198.18.0.2"))
    assert config == CONFIG.replace(PRIVATE_KEY_PLACEHOLDER, PRIVATE)


def test_a_config_without_its_key_is_refused_before_the_deploy() -> None:
    recorder = Recorder()
    with pytest.raises(ValueError, match="not a base64 Curve25519 key"):
        NodeSetupProvider(recorder.runner()).create({**NODE, "overlay_private_key": ""})
    assert recorder.calls == []


def _deploys(preview: bool) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    run = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=preview)
    return {r.name: r.inputs for r in run.of_type(DEPLOYMENT)}, run.outputs


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_every_machine_on_the_overlay_gets_its_config_plain_and_its_key_a_secret(
    preview: bool,
) -> None:
    deploys, outputs = _deploys(preview)
    stack, placement, _ = validate_cluster("prod", stacks.multicloud())
    plan = plan_overlay(stack, placement)
    expected = {
        f"prod-{m.site}-{m.node_name}-setup-deploy"
        if m.node
        else f"prod-balancer-{m.site}-setup-deploy"
        for m in plan.members
    }
    on = {name for name, inputs in deploys.items() if "overlay_config" in inputs}
    assert on == expected and len(on) == len(plan.members)
    for name in on:
        inputs = deploys[name]
        assert shown(inputs)["overlay_private_key"] == SECRET_SHOWN
        if not preview:
            assert inputs["overlay_private_key"][SECRET_SIG] == SECRET_MARK
            config = inputs["overlay_config"]
            assert isinstance(config, str) and f"PrivateKey = {PRIVATE_KEY_PLACEHOLDER}" in config
        assert not any(re.search(r"PrivateKey = (?!\()", s) for s in plain_strings(inputs))
    if not preview:
        # HAProxy reaches every replica of an SSH site at its node's overlay address.
        for member in (m for m in plan.members if m.node):
            address = plan.address_of(member.site, member.node_name)
            assert f" {address}:" in outputs["haproxy_config"], member.name
        rack = deploys["prod-office-rack-1-setup-deploy"]
        assert rack["balancer_addresses"] == list(plan.hub_addresses)
        assert rack["node"]["listen_address"] == plan.address_of("office", "rack-1")


def test_turning_the_overlay_off_changes_no_other_resources_name_or_type() -> None:
    on = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=True)
    args = copy.deepcopy(stacks.multicloud())
    args["balancer"] = {**args["balancer"], "overlay": {"enabled": False}}
    off = run_program(lambda: cluster_outputs(args), preview=True)
    overlay = {r.urn for r in on.registrations if "overlay" in r.name}
    # The AWS nodes' groups take WireGuard rules instead of replica and agent ones.
    rules = {r.urn for r in [*on.registrations, *off.registrations] if "-in-" in r.name}
    kept = {r.urn for r in off.registrations} - rules
    assert overlay and kept == {r.urn for r in on.registrations} - overlay - rules
    deploys = [r for r in off.of_type(DEPLOYMENT)]
    assert deploys and not any("overlay_config" in r.inputs for r in deploys)
