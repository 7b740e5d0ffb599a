"""The Cluster and its components under Pulumi's mocks, at `up` and at preview."""

from typing import Any

import pulumi
import pulumi_aws
import pulumi_hcloud
import pytest

from denv_iac.components import Cluster
from denv_iac.components.cluster import SITE_BUILDERS, validate_cluster
from denv_iac.components.preview import _address as mock_address
from denv_iac.components.secrets import public_key_of
from denv_iac.core.overlay_plan import plan_overlay
from denv_iac.core.sites import CLOUD_SITE_KINDS
from denv_iac.core.stack.model import SITE_KINDS
from denv_iac.core.stack.reader import StackError
from tests.components import stacks
from tests.components.harness import AMI_ID, Run, cluster_outputs, plain_strings, run_program
from tests.components.test_lambda import lambda_stack
from tests.components.test_nebius import nebius_stack

PREVIEW = pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
INSTANCE = "aws:ec2/instance:Instance"
INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
NODE_CREATES = {
    INSTANCE,
    "aws:ebs/volume:Volume",
    "aws:ec2/volumeAttachment:VolumeAttachment",
    "aws:ec2/eip:Eip",
    "denv:index:NodeSetup",
    "pulumi-python:dynamic/denv:NodeDeployment",
    "pulumi-python:dynamic/denv:WireGuardKey",
}


def _multicloud(preview: bool, args: Any = None) -> Run:
    return run_program(lambda: cluster_outputs(args or stacks.multicloud()), preview=preview)


@PREVIEW
def test_multicloud_registers_each_component_once_with_its_children(preview: bool) -> None:
    run = _multicloud(preview)
    components = sorted((r.type, r.name) for r in run.registrations if not r.custom)
    assert components == sorted(
        [
            ("denv:index:Cluster", "prod"),
            ("denv:index:AwsSite", "prod-aws-use1"),
            ("denv:index:AwsSite", "prod-aws-usw2"),
            ("denv:index:HetznerSite", "prod-hetzner-fsn"),
            ("denv:index:JoinedSite", "prod-office"),
            ("denv:index:WarmPool", "prod-pool-voice"),
            ("denv:index:WarmPool", "prod-pool-side"),
            ("denv:index:WarmPool", "prod-pool-assist"),
            ("denv:index:BalancerHost", "prod-balancer-hetzner-fsn"),
            ("denv:index:BalancerHost", "prod-balancer-aws-use1"),
            ("denv:index:GlobalBalancer", "prod-balancer"),
            ("denv:index:Overlay", "prod-overlay"),
            *[
                ("denv:index:NodeSetup", f"prod-{machine}-setup")
                for machine in (
                    "aws-use1-node-0",
                    "aws-use1-node-1",
                    "aws-use1-node-2",
                    "hetzner-fsn-gex-1",
                    "hetzner-fsn-gex-2",
                    "office-rack-1",
                    "office-rack-2",
                    "balancer-aws-use1",
                    "balancer-hetzner-fsn",
                )
            ],
        ]
    )
    urn_of = {r.name: r.urn for r in run.registrations}
    for registration in run.registrations:
        if registration.name != "prod":
            # every resource hangs under the component it is named from
            parent_name = registration.parent.rsplit("::", 1)[-1]
            assert registration.name.startswith(parent_name), registration.name
            assert registration.parent == urn_of[parent_name]
    # three voice replicas on whole H100s of aws-use1 (its home tier); usw2 stays empty
    instances = {r.name: r for r in run.of_type(INSTANCE)}
    assert sorted(instances) == [
        "prod-aws-use1-node-0",
        "prod-aws-use1-node-1",
        "prod-aws-use1-node-2",
        "prod-balancer-aws-use1-vm",
    ]
    node = instances["prod-aws-use1-node-0"]
    assert node.inputs["instanceType"] == "p5.4xlarge"
    assert node.inputs["metadataOptions"] == {"httpTokens": "required"}
    assert node.ignore_changes == ("ami", "keyName")
    assert node.inputs["tags"]["Name"] == "prod-aws-use1-node-0"
    volume = run.named("prod-aws-use1-node-0-cache").inputs
    assert (volume["size"], volume["type"], volume["encrypted"]) == (500, "gp3", True)
    attach = run.named("prod-aws-use1-node-0-cache-attach").inputs
    assert attach["deviceName"] == "/dev/sdf"
    assert run.of_type("hcloud:index/firewall:Firewall")[0].name == "prod-balancer-hetzner-fsn-fw"
    assert [r.name for r in run.of_type("hcloud:index/server:Server")] == [
        "prod-balancer-hetzner-fsn-vm"
    ]
    # the GPU AMI from the pinned Deep Learning AMI parameter, the balancer's from Ubuntu's
    params = sorted(a["name"] for t, a in run.invokes if t == "aws:ssm/getParameter:getParameter")
    assert params == sorted(
        [
            "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id",
            *[
                "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04"
                "/latest/ami-id"
            ]
            * 2,
        ]
    )
    if not preview:
        assert node.inputs["ami"] == AMI_ID


def test_balancer_config_routes_to_every_replica_address_and_port() -> None:
    run = _multicloud(preview=False)
    config = run.outputs["haproxy_config"]
    assert len(run.outputs["replica_ids"]) == 7
    for replica_id in run.outputs["replica_ids"]:
        assert f"server {replica_id} " in config
    # Nodes reached over SSH are reached through the overlay, at their overlay addresses.
    stack, placement, _ = validate_cluster("prod", stacks.multicloud())
    overlay = plan_overlay(stack, placement)
    for site, node in (("hetzner-fsn", "gex-1"), ("office", "rack-2")):
        assert f" {overlay.address_of(site, node)}:8000 " in config
    assert "203.0.113.21:8000 " not in config and "192.0.2.11:8000 " not in config
    assert "agent-port 9100" in config
    assert "/etc/haproxy/denv/api_keys.map" in config
    # the endpoint is the first balancer site's host (hetzner-fsn), TLS on 443
    endpoint = run.outputs["endpoint"]
    assert endpoint == f"https://{run.outputs['balancer_addresses'][0]}"


@PREVIEW
def test_two_runs_register_identical_inputs(preview: bool) -> None:
    first, second = _multicloud(preview), _multicloud(preview)
    assert [r.urn for r in first.registrations] != []
    assert first.by_urn() == second.by_urn()


def test_raising_min_warm_only_adds_the_new_node() -> None:
    before = _multicloud(preview=False).by_urn()
    raised = stacks.multicloud()
    raised["recipes"][0]["min_warm"] = 3
    after = _multicloud(False, raised).by_urn()
    changed = sorted(urn.rsplit("::", 1)[-1] for urn in before if after[urn] != before[urn])
    # The balancer hosts get the config that lists the new replica, and take WireGuard from
    # the new node: the hcloud host's overlay firewall gains its address.
    assert changed == [
        "prod-balancer-aws-use1-setup-deploy",
        "prod-balancer-hetzner-fsn-fw-overlay",
        "prod-balancer-hetzner-fsn-setup-deploy",
    ]
    added = sorted(urn.rsplit("::", 1)[-1] for urn in set(after) - set(before))
    assert added == [
        "prod-aws-use1-node-3",
        "prod-aws-use1-node-3-cache",
        "prod-aws-use1-node-3-cache-attach",
        "prod-aws-use1-node-3-eip",
        "prod-aws-use1-node-3-setup",
        "prod-aws-use1-node-3-setup-deploy",
        # the AWS host's rule for the new node's WireGuard packets
        "prod-balancer-aws-use1-in-wireguard-from-aws-use1.node-3",
        "prod-overlay-aws-use1.node-3",  # its overlay key; no other key changes
    ]
    added_types = {urn.split("::")[-2].split("$")[-1] for urn in set(after) - set(before)}
    assert added_types == NODE_CREATES | {INGRESS}


def test_adding_a_site_only_adds_that_sites_resources() -> None:
    before = _multicloud(preview=False).by_urn()
    grown = stacks.multicloud()
    grown["sites"].append(stacks.aws_site("aws-usw2-b", "us-west-2", "aws-usw2"))
    grown["recipes"][0]["sites"].append("aws-usw2-b")
    after = _multicloud(False, grown).by_urn()
    assert {urn: after[urn] for urn in before} == before
    added = {urn.rsplit("::", 1)[-1] for urn in set(after) - set(before)}
    assert added and all(name.startswith("prod-aws-usw2-b") for name in added), added


@PREVIEW
def test_no_secret_plaintext_in_any_registered_input(preview: bool) -> None:
    run = _multicloud(preview)
    for registration in run.registrations:
        strings = plain_strings(registration.inputs)
        for secret in stacks.SECRETS:
            for line in secret.splitlines()[1:-1]:  # the key material, not its armour
                assert not any(line in s for s in strings), registration.name
    # the public half is shown, so previews of the key pair stay readable
    key = run.named("prod-aws-use1-ssh-key").inputs
    if not preview:
        assert key["publicKey"] == public_key_of(stacks.SSH_KEYS["aws-use1"])


def _cidr_rules(run: Run, site: str) -> list[dict[str, Any]]:
    return [r.inputs for r in run.of_type(INGRESS) if r.name.startswith(f"prod-{site}-in-")]


def test_gpu_node_ports_open_only_to_balancer_hosts_and_ssh_to_admins() -> None:
    run = _multicloud(preview=False)
    balancers = {f"{address}/32" for address in run.outputs["balancer_addresses"]}
    assert len(balancers) == 2
    for site in ("aws-use1", "aws-usw2"):
        rules = _cidr_rules(run, site)
        # On the overlay: no replica or agent port on the public side, WireGuard instead.
        assert {(r["ipProtocol"], r["fromPort"], r["toPort"]) for r in rules} == {
            ("tcp", 22, 22),
            ("udp", 51820, 51820),
        }
        assert all("cidrIpv6" not in r for r in rules)
        assert {r["cidrIpv4"] for r in rules if r["fromPort"] == 22} == {stacks.ADMIN}
        # WireGuard: each balancer host, and nothing else
        sources = [r["cidrIpv4"] for r in rules if r["fromPort"] == 51820]
        assert sorted(sources) == sorted(balancers)


def test_balancer_host_takes_the_endpoint_from_anywhere_and_ssh_from_admins() -> None:
    run = _multicloud(preview=False)
    rules = {
        r.name.removeprefix("prod-balancer-aws-use1-in-"): r.inputs
        for r in run.of_type(INGRESS)
        if r.name.startswith("prod-balancer-aws-use1-in-")
    }
    assert rules["endpoint-v4"]["cidrIpv4"] == "0.0.0.0/0"
    assert rules["endpoint-v6"]["cidrIpv6"] == "::/0"
    assert rules["ssh-198-51-100-0-24"]["cidrIpv4"] == stacks.ADMIN
    assert rules["metrics-198-51-100-0-24"]["fromPort"] == 8405


@pytest.mark.parametrize("nat", [False, True], ids=["public", "behind-nat"])
def test_balancer_hosts_take_wireguard_from_their_nodes_or_anyone_behind_nat(nat: bool) -> None:
    args = stacks.multicloud()
    office = next(s for s in args["sites"] if s["name"] == "office")
    office["nodes"][1]["behind_nat"] = nat
    run = _multicloud(preview=False, args=args)
    nodes = {
        f"{site}.{node}": address
        for site, node, address in (
            ("hetzner-fsn", "gex-1", "203.0.113.21"),
            ("hetzner-fsn", "gex-2", "203.0.113.22"),
            ("office", "rack-1", "192.0.2.10"),
            ("office", "rack-2", "192.0.2.11"),
        )
    }
    eips = {r.name: r for r in run.of_type("aws:ec2/eip:Eip")}
    wireguard = {
        r.name.removeprefix("prod-balancer-aws-use1-in-"): r.inputs
        for r in run.of_type(INGRESS)
        if r.name.startswith("prod-balancer-aws-use1-in-wireguard")
    }
    expected = (
        {"wireguard-v4": "0.0.0.0/0", "wireguard-v6": "::/0"}
        if nat
        else {f"wireguard-from-{n}": f"{a}/32" for n, a in nodes.items()}
    )
    if not nat:  # the AWS nodes, by their Elastic IPs
        for site in ("aws-use1", "aws-usw2"):
            for eip in (e for e in eips if e.startswith(f"prod-{site}-node-")):
                node = eip.removeprefix(f"prod-{site}-").removesuffix("-eip")
                expected[f"wireguard-from-{site}.{node}"] = f"{mock_address(eip)}/32"
    assert {n: r.get("cidrIpv4") or r.get("cidrIpv6") for n, r in wireguard.items()} == expected
    assert {(r["ipProtocol"], r["fromPort"]) for r in wireguard.values()} == {("udp", 51820)}
    (firewall,) = [
        f for f in run.of_type("hcloud:index/firewall:Firewall") if f.name.endswith("fw-overlay")
    ]
    sources = sorted(s for rule in firewall.inputs["rules"] for s in rule["sourceIps"])
    assert sources == sorted(expected.values())
    assert {(r["protocol"], r["port"]) for r in firewall.inputs["rules"]} == {("udp", "51820")}


@PREVIEW
def test_local_stack_has_no_cloud_resources_and_a_loopback_endpoint(preview: bool) -> None:
    run = run_program(lambda: cluster_outputs(stacks.local(), "dev"), preview=preview)
    assert all(not r.custom for r in run.registrations)
    assert run.invokes == []
    if not preview:
        assert run.outputs["endpoint"] == "http://127.0.0.1:8080"
        assert "server voice.local.node-a.0 127.0.0.1:8000 " in run.outputs["haproxy_config"]


def _bad(args: Any) -> tuple[list[str], Run]:
    run = Run()
    with pytest.raises(StackError) as error:
        run_program(lambda: cluster_outputs(args), preview=False, run=run)
    return error.value.problems, run


def test_invalid_stack_names_every_problem_and_registers_nothing() -> None:
    args = stacks.multicloud()
    del args["sites"][0]["ssh_private_key"]
    args["sites"][1]["ssh_private_key"] = "plain-text-key"
    args["recipes"][0]["min_warm"] = 0
    args["balancer"]["sites"] = ["nowhere"]
    problems, run = _bad(args)
    assert len(problems) >= 4
    text = "\n".join(problems)
    assert "sites[0].ssh_private_key: missing" in text
    assert "sites[1].ssh_private_key: must be a Pulumi secret" in text
    assert "plain-text-key" not in text
    assert "nowhere" in text
    assert run.registrations == []


def test_every_site_kind_has_a_component() -> None:
    assert sorted(SITE_BUILDERS) == sorted(SITE_KINDS)


@pytest.mark.parametrize("kind", CLOUD_SITE_KINDS)
def test_a_bad_ssh_key_on_a_site_that_creates_machines_is_refused_before_registering(
    kind: str,
) -> None:
    args: Any = {"aws": stacks.multicloud, "lambda": lambda_stack, "nebius": nebius_stack}[kind]()
    site = next(s for s in args["sites"] if s["kind"] == kind)
    site["ssh_private_key"] = {"secure": "not-a-key"}
    problems, run = _bad(args)
    assert problems == [
        f"sites: {site['name']}.ssh_private_key: not an unencrypted OpenSSH or PEM private key; "
        "set it with 'pulumi config set --secret' from the key file"
    ]
    assert run.registrations == []


def test_recipes_whose_ports_collide_on_a_node_are_refused() -> None:
    args = stacks.local()
    # side's first slice, on GPU 1, would take 7992 + 8 = 8000: voice's port on GPU 0
    args["recipes"][1]["port"] = 7992
    problems, run = _bad(args)
    assert problems == [
        f"recipes: side: replica side.local.{node}.1.0 would take port 8000, used by "
        f"voice.local.{node}.0; give the recipes ports at least 128 apart"
        for node in ("node-a", "node-b")
    ]
    assert run.registrations == []


def test_each_aws_resource_and_lookup_is_in_its_sites_region() -> None:
    args = stacks.multicloud()
    args["sites"][1]["subnet_id"] = "subnet-0west"
    run = _multicloud(False, args)
    aws = [r for r in run.registrations if r.type.startswith("aws:")]
    for registration in aws:
        expected = "us-west-2" if "-aws-usw2-" in registration.name else "us-east-1"
        assert registration.inputs["region"] == expected, registration.name
    assert {(t, a["region"]) for t, a in run.invokes if t.startswith("aws:")} == {
        ("aws:ssm/getParameter:getParameter", "us-east-1"),
        ("aws:ssm/getParameter:getParameter", "us-west-2"),
        ("aws:ec2/getSubnet:getSubnet", "us-west-2"),
    }
    # the site's subnet decides the security group's VPC
    assert run.named("prod-aws-usw2-sg").inputs["vpcId"] == "vpc-0example"
    assert "vpcId" not in run.named("prod-aws-use1-sg").inputs


def test_explicit_providers_reach_every_child() -> None:
    def program() -> dict[str, Any]:
        aws = pulumi_aws.Provider("aws-team", region="us-east-1")
        hcloud = pulumi_hcloud.Provider("hcloud-team", token="not-a-token")
        cluster = Cluster(
            "prod",
            stacks.multicloud(),
            pulumi.ResourceOptions(providers={"aws": aws, "hcloud": hcloud}),
        )
        return {"endpoint": cluster.endpoint}

    run = run_program(program, preview=False)
    # Dynamic resources (NodeSetup's deploys) run in the program's own provider.
    own = ("pulumi:providers:", "pulumi-python:dynamic")
    children = [r for r in run.registrations if r.custom and not r.type.startswith(own)]
    # With an Elastic IP per AWS node and balancer host, one WireGuard rule per balancer host
    # on each AWS site's group where the replica and agent ports' two were, and the balancer
    # hosts' own WireGuard rules: one per node on the AWS host, a firewall and its attachment
    # on the hcloud one.
    assert len(children) == 48
    for registration in children:
        package = registration.type.split(":")[0]
        assert f"::{package}-team::" in registration.provider, registration.name


def test_a_replica_on_the_agents_port_is_refused() -> None:
    args = stacks.local()
    args["recipes"][0]["port"] = 9101
    problems, run = _bad(args)
    # Refused from the stack alone, before placement, as plain `denv plan` refuses it.
    assert problems[0] == (
        "recipes[0].port: replicas on site local take ports 9101-9116, which includes 9101 "
        "(the node agent); move the recipe's port clear of it"
    )
    assert run.registrations == []


def test_an_unreadable_ssh_key_is_refused_without_its_contents() -> None:
    args = stacks.multicloud()
    args["sites"][2]["ssh_private_key"] = {"secure": "v1:c2FtcGxlLWNpcGhlcnRleHQ="}
    problems, run = _bad(args)
    assert problems == [
        "sites: hetzner-fsn.ssh_private_key: not an unencrypted OpenSSH or PEM private key; set "
        "it with 'pulumi config set --secret' from the key file"
    ]
    assert run.registrations == []
