"""NebiusSite in a Cluster under Pulumi's mocks: instances, disks, filesystem, security group."""

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from denv_iac.components.cluster import validate_cluster
from denv_iac.components.nebius import (
    CACHE_MOUNT_POINT,
    CACHE_MOUNT_TAG,
    cloud_init,
    offering_parts,
    port_groups,
)
from denv_iac.components.secrets import public_key_of
from denv_iac.core.ingress import IngressRule
from denv_iac.core.overlay_plan import plan_overlay
from denv_iac.core.sites import CLOUD_SSH_USER
from denv_iac.core.stack.reader import StackError
from tests.components import stacks
from tests.components.harness import Run, cluster_outputs, plain_strings, run_program
from tests.components.snapshots import assert_golden, site_snapshot

PREVIEW = pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
INSTANCE = "nebius:index/computeV1Instance:ComputeV1Instance"
DISK = "nebius:index/computeV1Disk:ComputeV1Disk"
RULE = "nebius:index/vpcV1SecurityRule:VpcV1SecurityRule"
NODE_SETUP = "denv:index:NodeSetup"
NODE_DEPLOYMENT = "pulumi-python:dynamic/denv:NodeDeployment"
LAUNCH_USER_DATA = "pulumi-python:dynamic/nebius:LaunchUserData"
SSH_KEY = stacks._private_key(8)
NEBIUS_SITE = {
    "name": "nebius-eun1",
    "kind": "nebius",
    "region": "eu-north1",
    "project_id": "project-e00example",
    "subnet_id": "vpcsubnet-e00example",
    "platform": "gpu-h100-sxm",
    "preset": "1gpu-16vcpu-200gb",
    "max_nodes": 4,
    "admin_cidrs": [stacks.ADMIN],
    "ssh_private_key": {"secure": SSH_KEY},
}


def nebius_stack() -> dict[str, Any]:
    """Voice on Nebius H100s, behind a balancer on the Hetzner site of the multicloud stack."""
    args: dict[str, Any] = dict(stacks.multicloud())
    hetzner = next(s for s in args["sites"] if s["name"] == "hetzner-fsn")
    assist = next(r for r in args["recipes"] if r["name"] == "assist")
    voice = next(r for r in args["recipes"] if r["name"] == "voice")
    voice["sites"] = ["nebius-eun1"]
    args["sites"] = [copy.deepcopy(NEBIUS_SITE), hetzner]
    args["recipes"] = [voice, assist | {"image": "vllm/vllm-openai:v0.11.0"}]
    args["balancer"]["sites"] = ["hetzner-fsn"]
    return args


def _run(preview: bool, args: Any = None) -> Run:
    return run_program(lambda: cluster_outputs(args or nebius_stack()), preview=preview)


@PREVIEW
def test_each_node_boots_a_driver_image_and_mounts_the_sites_filesystem(preview: bool) -> None:
    run = _run(preview)
    site = run.named("prod-nebius-eun1")
    assert site.type == "denv:index:NebiusSite" and not site.custom
    nodes = [f"prod-nebius-eun1-node-{i}" for i in range(3)]
    assert sorted(r.name for r in run.of_type(INSTANCE)) == nodes
    assert sorted(r.name for r in run.of_type(DISK)) == [f"{n}-boot" for n in nodes]
    cache = run.named("prod-nebius-eun1-cache").inputs
    assert (cache["parentId"], cache["type"], cache["sizeGibibytes"]) == (
        "project-e00example",
        "NETWORK_SSD",
        500,
    )
    for name in nodes:
        boot = run.named(f"{name}-boot").inputs
        assert boot["sourceImageFamily"] == {"imageFamily": "ubuntu22.04-cuda12"}
        node = run.named(name)
        assert node.parent == site.urn
        inputs = node.inputs
        assert inputs["parentId"] == "project-e00example"
        assert inputs["resources"] == {"platform": "gpu-h100-sxm", "preset": "1gpu-16vcpu-200gb"}
        (interface,) = inputs["networkInterfaces"]
        assert interface["subnetId"] == "vpcsubnet-e00example"
        assert interface["publicIpAddress"] == {"static": True}  # kept across stop/start
        assert interface["securityGroups"] == [{"id": "prod-nebius-eun1-sg-id"}]
        assert inputs["filesystems"] == [
            {
                "attachMode": "READ_WRITE",
                "mountTag": CACHE_MOUNT_TAG,
                "existingFilesystem": {"id": "prod-nebius-eun1-cache-id"},
            }
        ]
        if not preview:
            assert inputs["bootDisk"]["existingDisk"] == {"id": f"{name}-boot-id"}
            assert inputs["labels"]["denv-node"] == name.removeprefix("prod-nebius-eun1-")


def test_cloud_init_carries_the_public_key_and_mounts_the_cache() -> None:
    run = _run(preview=False)
    user_data = run.named("prod-nebius-eun1-node-0").inputs["cloudInitUserData"]
    # The SDK keeps user data secret; what it holds is the public half only.
    assert user_data["value"] == cloud_init(public_key_of(SSH_KEY))
    for line in SSH_KEY.splitlines()[1:-1]:
        assert line not in user_data["value"]
    config = yaml.safe_load(user_data["value"])
    assert user_data["value"].startswith("#cloud-config\n")
    (user,) = config["users"]
    assert (user["name"], user["ssh_authorized_keys"]) == (CLOUD_SSH_USER, [public_key_of(SSH_KEY)])
    assert config["mounts"] == [
        [CACHE_MOUNT_TAG, CACHE_MOUNT_POINT, "virtiofs", "defaults,nofail", "0", "0"]
    ]


def _overlay_off() -> dict[str, Any]:
    args = nebius_stack()
    args["balancer"]["overlay"] = {"enabled": False}
    return args


@pytest.mark.parametrize(
    ("args", "balancer_rules"),
    [
        # The overlay on (the default): WireGuard only; replicas and agent ride the tunnel.
        (nebius_stack, {"in-wireguard-from-hetzner-fsn": ("UDP", [51820])}),
        (
            _overlay_off,
            {
                "in-agent-from-hetzner-fsn": ("TCP", [9100]),
                "in-voice-from-hetzner-fsn": ("TCP", list(range(8000, 8008))),
            },
        ),
    ],
    ids=["overlay", "overlay-off"],
)
def test_node_ports_open_only_to_balancer_hosts_and_ssh_to_admins(
    args: Callable[[], dict[str, Any]], balancer_rules: dict[str, tuple[str, list[int]]]
) -> None:
    run = _run(preview=False, args=args())
    (balancer,) = run.outputs["balancer_addresses"]
    rules = {r.name.removeprefix("prod-nebius-eun1-"): r.inputs for r in run.of_type(RULE)}
    assert sorted(rules) == sorted(["in-ssh-198-51-100-0-24", "out", *balancer_rules])
    ingress = {
        name: (rule["protocol"], rule["ingress"]) for name, rule in rules.items() if name != "out"
    }
    ssh = ("TCP", {"destinationPorts": [22], "sourceCidrs": [stacks.ADMIN]})
    assert ingress == {
        "in-ssh-198-51-100-0-24": ssh,
        **{
            name: (protocol, {"destinationPorts": ports, "sourceCidrs": [f"{balancer}/32"]})
            for name, (protocol, ports) in balancer_rules.items()
        },
    }
    assert all(rules[n]["access"] == "ALLOW" for n in ingress)
    assert rules["out"]["egress"] == {"destinationCidrs": ["0.0.0.0/0"]}
    group = run.named("prod-nebius-eun1-sg").inputs
    assert group["networkId"] == "vpcnetwork-e00example"  # the site subnet's network
    assert all(rule["parentId"] == "prod-nebius-eun1-sg-id" for rule in rules.values())


def test_a_balancer_host_on_ipv6_is_one_host_of_128_bits() -> None:
    """Its rule's source is the host alone (/128), as on every other provider; /32 would open
    the port to a 2^96-address range around it."""
    args = nebius_stack()
    office = next(s for s in stacks.multicloud()["sites"] if s["name"] == "office")
    office["nodes"][0]["address"] = "2001:db8::10"
    args["sites"] = [copy.deepcopy(NEBIUS_SITE), office]
    args["recipes"] = [r for r in args["recipes"] if r["name"] == "voice"]
    args["balancer"]["sites"] = ["office"]
    run = _run(preview=False, args=args)
    assert run.outputs["balancer_addresses"] == ["2001:db8::10"]
    rule = run.named("prod-nebius-eun1-in-wireguard-from-office").inputs
    assert rule["ingress"]["sourceCidrs"] == ["2001:db8::10/128"]


@pytest.mark.parametrize("overlay", [True, False], ids=["overlay", "overlay-off"])
def test_the_balancer_routes_voice_to_the_instances_addresses(overlay: bool) -> None:
    args = nebius_stack() if overlay else _overlay_off()
    run = _run(preview=False, args=args)
    servers = [
        line.split()[1:3]
        for line in run.outputs["haproxy_config"].splitlines()
        if "server voice." in line
    ]
    # Each replica is one server of its tier and one of each twin (realtime, speech).
    names = [f"voice.nebius-eun1.node-{i}.0" for i in range(3)]
    assert sorted(s[0] for s in servers) == sorted(names * 3)
    if overlay:  # through the tunnel, at the nodes' overlay addresses
        stack, placement, _ = validate_cluster("prod", args)
        plan = plan_overlay(stack, placement)
        expected = {f"{plan.address_of('nebius-eun1', f'node-{i}')}:8000" for i in range(3)}
        assert {a for _, a in servers} == expected
    else:  # the public address, without Nebius's /32 suffix
        assert all(
            a.startswith("198.18.") and a.endswith(":8000") and "/" not in a for _, a in servers
        )


def test_registered_inputs_match_the_golden_snapshot() -> None:
    assert_golden(site_snapshot(_run(preview=False), "prod-nebius-eun1"), "nebius.json")


@PREVIEW
def test_two_runs_register_identical_inputs(preview: bool) -> None:
    first, second = _run(preview), _run(preview)
    assert first.of_type(INSTANCE) != []
    assert first.by_urn() == second.by_urn()


def _site_resources(run: Run) -> dict[str, dict[str, Any]]:
    return {urn: inputs for urn, inputs in run.by_urn().items() if "::prod-nebius-eun1" in urn}


def test_raising_min_warm_by_one_adds_exactly_one_node() -> None:
    before = _site_resources(_run(preview=False))
    raised = nebius_stack()
    raised["recipes"][0]["min_warm"] = 3
    after = _site_resources(_run(False, raised))
    assert {urn: after[urn] for urn in before} == before
    added = sorted(
        urn.split("::")[-2].rsplit("$", 1)[-1] + " " + urn.rsplit("::", 1)[-1]
        for urn in set(after) - set(before)
    )
    assert added == [
        f"{NODE_SETUP} prod-nebius-eun1-node-3-setup",
        f"{DISK} prod-nebius-eun1-node-3-boot",
        f"{INSTANCE} prod-nebius-eun1-node-3",
        f"{NODE_DEPLOYMENT} prod-nebius-eun1-node-3-setup-deploy",
        f"{LAUNCH_USER_DATA} prod-nebius-eun1-node-3-user-data",
    ]


@PREVIEW
def test_no_ssh_key_plaintext_in_any_registered_input(preview: bool) -> None:
    run = _run(preview)
    key_lines = SSH_KEY.splitlines()[1:-1]
    for registration in run.registrations:
        strings = plain_strings(registration.inputs)
        assert not any(line in s for s in strings for line in key_lines), registration.name


def test_an_unknown_preset_is_one_line_and_nothing_is_registered() -> None:
    args = nebius_stack()
    args["sites"][0]["preset"] = "3gpu-48vcpu"
    del args["recipes"][0]["gpu_models"]  # else the recipe's H100s are missing too
    run = Run()
    with pytest.raises(StackError) as error:
        run_program(lambda: cluster_outputs(args), preview=False, run=run)
    (problem,) = error.value.problems
    assert problem.startswith(
        'sites[0].preset: "gpu-h100-sxm/3gpu-48vcpu" is not a GPU offering we know on nebius; '
    )
    assert "gpu-h100-sxm/1gpu-16vcpu-200gb" in problem
    assert run.registrations == []


@pytest.mark.parametrize(
    ("stack", "problem"),
    [
        (
            "Prod_eu.1",
            'sites[0]: the stack name "Prod_eu.1" begins the host name of each machine of this '
            "Nebius site (Prod_eu.1-nebius-eun1-node-3), which Nebius takes in lower-case "
            "letters, digits and '-' only; use a stack name of those",
        ),
        (
            "p" * 45,
            f"sites[0]: Nebius host names of this site, like {'p' * 45}-nebius-eun1-node-3, take "
            "64 characters, past Nebius's 63; shorten the site or the stack name",
        ),
    ],
)
def test_a_host_name_nebius_would_refuse_is_one_line_and_nothing_is_registered(
    stack: str, problem: str
) -> None:
    run = Run()
    with pytest.raises(StackError) as error:
        run_program(lambda: cluster_outputs(nebius_stack(), stack), preview=False, run=run)
    assert error.value.problems == [problem]
    assert run.registrations == []


def test_a_host_name_of_63_characters_is_taken() -> None:
    stack = "p" * 44  # 44 + "-nebius-eun1-node-3"
    run = run_program(lambda: cluster_outputs(nebius_stack(), stack), preview=False)
    hosts = [r.inputs["hostname"] for r in run.of_type(INSTANCE)]
    assert hosts and max(map(len, hosts)) == 63


@PREVIEW
def test_an_instance_is_deleted_before_its_replacement_is_created(preview: bool) -> None:
    # Nebius refuses a second instance of one name in a project, and the name stays the same.
    instances = _run(preview).of_type(INSTANCE)
    assert instances and all(instance.delete_before_replace for instance in instances)


@pytest.mark.parametrize(
    ("ports", "groups"),
    [
        ((22, 22), [[22]]),
        ((8000, 8007), [list(range(8000, 8008))]),
        ((8000, 8017), [list(range(8000, 8008)), list(range(8008, 8016)), [8016, 8017]]),
    ],
)
def test_port_ranges_split_into_rules_of_at_most_eight_ports(
    ports: tuple[int, int], groups: list[list[int]]
) -> None:
    assert port_groups(IngressRule("r", "d", *ports, "198.51.100.0/24")) == groups


def test_eight_gpu_nodes_get_their_replica_ports_in_rules_of_eight() -> None:
    args = _overlay_off()  # with it on, replica ports are reached through the tunnel only
    args["sites"][0]["preset"] = "8gpu-128vcpu-1600gb"
    run = _run(False, args)
    voice = sorted(
        (r.name, r.inputs["ingress"]["destinationPorts"])
        for r in run.of_type(RULE)
        if "-in-voice-" in r.name
    )
    assert [name for name, _ in voice] == [
        f"prod-nebius-eun1-in-voice-from-hetzner-fsn-{i}" for i in range(8)
    ]
    assert [port for _, ports in voice for port in ports] == list(range(8000, 8064))


def test_offering_parts_are_platform_and_preset() -> None:
    assert offering_parts("gpu-h200-sxm/8gpu-128vcpu-1600gb") == (
        "gpu-h200-sxm",
        "8gpu-128vcpu-1600gb",
    )
