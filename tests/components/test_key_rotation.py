"""What a running machine keeps when the stack changes around it, read from what each provider
reads only at creation: a rotated SSH key (and the Nebius address kind and image family) never
replaces a GPU; the key reaches the machine through its deploy (tests/node/test_ssh_keys.py).
And what a machine launched after a rotation gets, a replacement included: the current key.

Under Pulumi's mocks the engine's diff does not run: the options each component sets are what
the engine uses to keep an input as it was (`ignore_changes`), and each Lambda provider's own
diff is called directly. A replacement is made from the new inputs with every ignored one put
back as it was (the engine's processIgnoreChanges, before its diff), which `_replacement` does.
For Nebius, `_applied` runs updates one after another as the engine would: it calls the
LaunchUserData provider's diff (as serialized into the resource) against the state, keeps the
outputs where it finds no change, and records each instance's inputs with ignored ones put back.
"""

import base64
import copy
from dataclasses import dataclass, field
from typing import Any

import dill
import pytest

from denv_iac.components.lambda_cloud import (
    API_KEY,
    LambdaInstanceProvider,
    LambdaSshKeyProvider,
    ssh_key_name,
)
from denv_iac.components.node_setup import ssh_keys
from denv_iac.components.preview import SECRET_MARK, SECRET_SIG, Registration
from denv_iac.components.secrets import public_key_of
from denv_iac.core.stack.exposure import stack_warnings
from denv_iac.core.stack.reader import read_stack
from denv_iac.core.stack.values import LAMBDA_NAME_LENGTH
from tests.components import stacks
from tests.components.harness import Run, cluster_outputs, run_program
from tests.components.test_lambda import LAMBDA_SITE, lambda_stack
from tests.components.test_nebius import NEBIUS_SITE, SSH_KEY, nebius_stack

# Each kind of machine the stack creates, and the argument its provider reads the SSH key from
# (as ignore_changes names it). Lambda's is not ignored: its own diff keeps it from relaunching.
# Nebius's is not either: it comes from a LaunchUserData, which keeps it as it was at launch.
KEY_ARGUMENTS = {
    "aws:ec2/instance:Instance": "keyName",
    "hcloud:index/server:Server": "sshKeys",
    "pulumi-python:dynamic/lambda:Instance": "ssh_key_names",
    "nebius:index/computeV1Instance:ComputeV1Instance": "cloudInitUserData",
}
IGNORED = {"aws:ec2/instance:Instance", "hcloud:index/server:Server"}
AWS_INSTANCE = "aws:ec2/instance:Instance"
HCLOUD_SERVER = "hcloud:index/server:Server"
LAMBDA_INSTANCE = "pulumi-python:dynamic/lambda:Instance"
NEBIUS_INSTANCE = "nebius:index/computeV1Instance:ComputeV1Instance"


def _runs(preview: bool) -> list[Run]:
    return [
        run_program(lambda args=args: cluster_outputs(args()), preview=preview)
        for args in (stacks.multicloud, lambda_stack, nebius_stack)
    ]


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_no_machine_is_replaced_for_a_rotated_key(preview: bool) -> None:
    seen = set()
    for run in _runs(preview):
        for type_, argument in KEY_ARGUMENTS.items():
            for machine in run.of_type(type_):
                seen.add(type_)
                assert (argument in machine.ignore_changes) == (type_ in IGNORED), machine.name
                # Only Nebius, whose instance names are unique, deletes before it replaces.
                assert machine.delete_before_replace == (type_ == NEBIUS_INSTANCE), machine.name
    assert seen == set(KEY_ARGUMENTS)  # every kind was looked at


def test_a_rotated_lambda_key_is_a_new_key_made_before_the_old_one_goes() -> None:
    old, new = (public_key_of(stacks.SSH_KEYS[s]) for s in ("office", "aws-use1"))
    olds = {API_KEY: "k", "name": ssh_key_name(old, "prod", "lambda-use1"), "public_key": old}
    news = {API_KEY: "k", "name": ssh_key_name(new, "prod", "lambda-use1"), "public_key": new}
    diff = LambdaSshKeyProvider().diff("key0", olds, news)
    # Names are unique per account: the new key has its own, so it can exist beside the old.
    assert olds["name"] != news["name"]
    assert diff.replaces == ["name", "public_key"] and diff.delete_before_replace is False
    # The instance records its new keys and is not relaunched for them.
    instance = {API_KEY: "k", "name": "n", "region": "us-east-1", "instance_type": "t"}
    rotated = LambdaInstanceProvider().diff(
        "i0", {**instance, "ssh_key_names": [olds["name"]]}, {**instance, "ssh_key_names": []}
    )
    assert rotated.changes and rotated.replaces == []


def test_a_lambda_key_name_keeps_its_digest_within_lambdas_length() -> None:
    key = public_key_of(stacks.SSH_KEYS["office"])
    name = ssh_key_name(key, "prod", "x" * 80)
    assert len(name) <= LAMBDA_NAME_LENGTH and name != ssh_key_name(key + " ", "prod", "y" * 80)
    assert name.endswith(ssh_key_name(key, "p")[-9:])


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_the_hcloud_balancer_host_ignores_the_firewall_ids_it_reads_back(preview: bool) -> None:
    # Created with firewall_ids, and the overlay's firewall attached by a FirewallAttachment:
    # the hcloud provider's FirewallAttachment docs require ignore_remote_firewall_ids then, or
    # a refresh records both firewalls and the next `up` detaches the overlay's.
    (run,) = _runs(preview)[:1]
    (server,) = run.of_type(HCLOUD_SERVER)
    attachments = run.of_type("hcloud:index/firewallAttachment:FirewallAttachment")
    assert attachments and server.inputs["firewallIds"]
    assert server.inputs["ignoreRemoteFirewallIds"] is True


def test_nebius_nodes_keep_their_address_and_disk_across_stop_start_and_new_defaults() -> None:
    run = run_program(lambda: cluster_outputs(nebius_stack()), preview=False)
    instances = run.of_type("nebius:index/computeV1Instance:ComputeV1Instance")
    assert instances
    for instance in instances:
        (interface,) = instance.inputs["networkInterfaces"]
        assert interface["publicIpAddress"] == {"static": True}
        assert "networkInterfaces[*].publicIpAddress.static" in instance.ignore_changes
    for disk in run.of_type("nebius:index/computeV1Disk:ComputeV1Disk"):
        assert "sourceImageFamily" in disk.ignore_changes
    rules = run.of_type("nebius:index/vpcV1SecurityRule:VpcV1SecurityRule")
    assert rules and all(rule.inputs.get("name") == rule.name for rule in rules)


def _nebius(**site: Any) -> Any:
    args = nebius_stack()
    args["sites"][0] = {**copy.deepcopy(NEBIUS_SITE), **site}
    for recipe in args["recipes"]:
        if "gpu_models" in recipe:
            recipe["gpu_models"] = [*recipe["gpu_models"], "B200"]
    return args


@pytest.mark.parametrize(
    ("site", "family"),
    [
        ({}, "ubuntu22.04-cuda12"),
        ({"platform": "gpu-b200-sxm", "preset": "8gpu-160vcpu-1792gb"}, "ubuntu24.04-cuda13.0"),
        (
            {"platform": "gpu-b200-sxm", "preset": "8gpu-160vcpu-1792gb", "image_family": "mine"},
            "mine",
        ),
    ],
    ids=["h100", "b200", "b200-given"],
)
def test_a_nebius_b200_site_boots_the_cuda_13_family_unless_told(
    site: dict[str, Any], family: str
) -> None:
    run = run_program(lambda: cluster_outputs(_nebius(**site)), preview=False)
    disks = run.of_type("nebius:index/computeV1Disk:ComputeV1Disk")
    assert disks and {d.inputs["sourceImageFamily"]["imageFamily"] for d in disks} == {family}


def _config(args: dict[str, Any]) -> dict[str, Any]:
    return {
        "denv:sites": args["sites"],
        "denv:recipes": args["recipes"],
        "denv:balancer": args["balancer"],
    }


@pytest.mark.parametrize(("region", "warned"), [("us-south-1", True), ("us-east-1", False)])
def test_a_lambda_site_in_us_south_1_is_warned_of_its_unfiltered_firewall(
    region: str, warned: bool
) -> None:
    args = lambda_stack()
    args["sites"][0] = {**copy.deepcopy(LAMBDA_SITE), "region": region}
    lines = [w for w in stack_warnings(read_stack("prod", _config(args))) if "firewall" in w]
    assert bool(lines) == warned
    if warned:
        (line,) = lines
        assert line.startswith("sites[0].region: Lambda applies no firewall rules in us-south-1")
        assert "\n" not in line


def _replacement(old: Registration, new: Registration) -> dict[str, Any]:
    """The inputs the engine creates a replacement of `old` with, as `new` registers it: the
    new inputs, each ignored top-level one put back as it was (processIgnoreChanges)."""
    kept = {path: old.inputs[path] for path in new.ignore_changes if path in old.inputs}
    return {**new.inputs, **kept}


def _rotated(args: Any, site: str, **changes: Any) -> Any:
    """`args` with the site's key rotated (another key) and `changes` made to the site."""
    rotated = copy.deepcopy(args)
    entry = next(s for s in rotated["sites"] if s["name"] == site)
    entry.update(changes, ssh_private_key={"secure": stacks.SSH_KEYS["office"]})
    return rotated


NEW_KEY = public_key_of(stacks.SSH_KEYS["office"])


def _before_after(args: Any, site: str, preview: bool, **changes: Any) -> tuple[Run, Run]:
    before = run_program(lambda: cluster_outputs(copy.deepcopy(args)), preview=False)
    rotated = _rotated(args, site, **changes)
    after = run_program(lambda: cluster_outputs(rotated), preview=preview)
    return before, after


def _pairs(before: Run, after: Run, type_: str) -> list[tuple[Registration, Registration]]:
    olds = {r.urn: r for r in before.of_type(type_)}
    pairs = [(olds[r.urn], r) for r in after.of_type(type_) if r.urn in olds]
    assert pairs, type_
    return pairs


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_an_aws_replacement_after_a_rotation_launches_with_the_current_key(preview: bool) -> None:
    # Whatever replaces an instance (a subnet, a type), the key it launches with.
    before, after = _before_after(stacks.multicloud(), "aws-use1", preview)
    key_pairs = {
        r.inputs["keyName"]: r.inputs["publicKey"] for r in after.of_type("aws:ec2/keyPair:KeyPair")
    }
    for old, new in _pairs(before, after, AWS_INSTANCE):
        if "-aws-use1-" not in new.name:
            continue
        assert old.inputs["keyName"] == new.inputs["keyName"], new.name  # rotation: no change
        assert key_pairs[_replacement(old, new)["keyName"]] == NEW_KEY, new.name
    for pair in after.of_type("aws:ec2/keyPair:KeyPair"):
        assert pair.delete_before_replace, pair.name  # EC2 names are unique per region


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_an_hcloud_replacement_after_a_rotation_is_made_with_the_current_key(
    preview: bool,
) -> None:
    # Another location replaces the balancer host's server; its key was rotated before.
    before, after = _before_after(stacks.multicloud(), "hetzner-fsn", preview, location="nbg1")
    keys = {
        r.inputs["name"]: r.inputs["publicKey"] for r in after.of_type("hcloud:index/sshKey:SshKey")
    }
    ((old, new),) = _pairs(before, after, HCLOUD_SERVER)
    assert old.inputs["location"] != new.inputs["location"]  # a new server
    assert old.inputs["sshKeys"] == new.inputs["sshKeys"]  # the rotation alone: no change
    (name,) = _replacement(old, new)["sshKeys"]
    assert keys[name] == NEW_KEY
    for key in after.of_type("hcloud:index/sshKey:SshKey"):
        assert key.delete_before_replace, key.name  # Hetzner names are unique per project


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_a_lambda_replacement_after_a_rotation_launches_with_the_current_key(
    preview: bool,
) -> None:
    before, after = _before_after(lambda_stack(), "lambda-use1", preview)
    names = {
        r.inputs["name"]: r.inputs["public_key"]
        for r in after.of_type("pulumi-python:dynamic/lambda:SshKey")
    }
    provider = LambdaInstanceProvider()
    for old, new in _pairs(before, after, LAMBDA_INSTANCE):
        olds, news = old.inputs, _replacement(old, new)
        # The rotation alone is recorded, not relaunched...
        assert not provider.diff("i0", olds, news).replaces
        # ...so another instance type launches with the current key's name.
        bigger = {**news, "instance_type": "gpu_8x_h100_sxm5"}
        assert provider.diff("i0", olds, bigger).replaces == ["instance_type"]
        assert [names[n] for n in bigger["ssh_key_names"]] == [NEW_KEY]


# The dynamic resources whose serialized provider's diff is called here, as the engine calls it.
ENGINE_DIFFED = ("pulumi-python:dynamic/nebius:LaunchUserData",)
NEBIUS_NODE_SETUP = "pulumi-python:dynamic/denv:NodeDeployment"
OLD_KEY = public_key_of(SSH_KEY)  # the Nebius site's key before its rotation


def _plain(value: Any) -> Any:
    """Serialized inputs with each secret's value in its place."""
    if isinstance(value, dict):
        if value.get(SECRET_SIG) == SECRET_MARK:
            return _plain(value.get("value"))
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


@dataclass
class State:
    """What the engine records: each resource's inputs, an ignored one as it was before
    (processIgnoreChanges), and the outputs of the resources in ENGINE_DIFFED."""

    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)


def _applied(args: Any, state: State, preview: bool) -> tuple[Run, State]:
    """The program run on `args` by an engine whose state is `state`: a resource in
    ENGINE_DIFFED whose provider's diff (the provider as serialized in its inputs) finds no
    change keeps its outputs (a same step); any other is updated to its new inputs. Repeated
    until what is kept no longer changes, since a kept output can change later inputs."""
    kept: dict[tuple[str, str], dict[str, Any]] = {}
    while True:
        run = run_program(
            lambda: cluster_outputs(copy.deepcopy(args)), preview=preview, kept_outputs=kept
        )
        found = {}
        for resource in run.registrations:
            if resource.type not in ENGINE_DIFFED or resource.urn not in state.outputs:
                continue
            olds, news = state.outputs[resource.urn], _plain(resource.inputs)
            provider = dill.loads(base64.b64decode(news["__provider"]))
            if not provider.diff(f"{resource.name}-id", olds, news).changes:
                found[(resource.type, resource.name)] = olds
        if found == kept:
            break
        kept = found
    after = State()
    for r in run.registrations:
        recorded = state.inputs.get(r.urn, {})
        ignored = {path: recorded[path] for path in r.ignore_changes if path in recorded}
        after.inputs[r.urn] = {**r.inputs, **ignored}
        if r.type in ENGINE_DIFFED:
            after.outputs[r.urn] = kept.get((r.type, r.name), _plain(r.inputs))
    return run, after


def _user_data(inputs: dict[str, Any]) -> str:
    return str(_plain(inputs["cloudInitUserData"]))


def _instances(run: Run) -> list[str]:
    urns = [r.urn for r in run.of_type(NEBIUS_INSTANCE)]
    assert urns
    return urns


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_a_nebius_rotation_changes_no_input_of_a_running_instance(preview: bool) -> None:
    args = nebius_stack()
    before, launched = _applied(args, State(), preview=False)
    after, rotated = _applied(_rotated(args, "nebius-eun1"), launched, preview)
    for urn in _instances(after):
        # As the engine diffs it: nothing changed, so neither an update nor a relaunch.
        assert rotated.inputs[urn] == launched.inputs[urn], urn
        assert OLD_KEY in _user_data(rotated.inputs[urn])
    # The running machine gets the new key from its deploy, which logs in with the old one
    # where the new one is refused, authorizes the new one and removes the old one.
    deploys = _pairs(before, after, NEBIUS_NODE_SETUP)
    nebius = [(o, n) for o, n in deploys if "-nebius-eun1-" in n.name]
    assert nebius
    for old, new in nebius:
        keys = ssh_keys(_plain(new.inputs), _plain(old.inputs))
        assert keys is not None and keys.key == NEW_KEY and keys.retired == (OLD_KEY,)


@pytest.mark.parametrize(
    "change",
    [
        {"platform": "gpu-b200-sxm", "preset": "8gpu-160vcpu-1792gb"},
        {"subnet_id": "vpcsubnet-e00new"},
    ],
    ids=["platform", "subnet"],
)
@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_a_nebius_replacement_after_a_rotation_boots_with_the_current_key(
    preview: bool, change: dict[str, str]
) -> None:
    # The key is rotated in one update; a later one changes what launches the instance again.
    args = _nebius()
    _, launched = _applied(args, State(), preview=False)
    _, rotated = _applied(_rotated(args, "nebius-eun1"), launched, preview=False)
    run, moved = _applied(_rotated(args, "nebius-eun1", **change), rotated, preview)
    for urn in _instances(run):
        assert OLD_KEY in _user_data(rotated.inputs[urn])  # the rotation left it as it was
        assert moved.inputs[urn] != rotated.inputs[urn]  # another platform or subnet: relaunched
        user_data = _user_data(moved.inputs[urn])
        assert NEW_KEY in user_data and OLD_KEY not in user_data, urn
