"""A balancer host's WireGuard rules under Pulumi's mocks, in the shapes the SDKs take: an AWS
security group's rules added after its nodes exist, and a second hcloud firewall on the server."""

from typing import Any

import pulumi
import pulumi_hcloud as hcloud
import pytest

from denv_iac.components.aws import SecurityGroupWiring
from denv_iac.components.hcloud_firewall import hcloud_rules, overlay_firewall
from denv_iac.core.ingress import OverlayAccess, balancer_ingress_rules, wireguard_rules
from denv_iac.core.stack.model import BalancerSpec
from tests.components.harness import Run, run_program

INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
FIREWALL = "hcloud:index/firewall:Firewall"
ATTACHMENT = "hcloud:index/firewallAttachment:FirewallAttachment"
ADMIN = "198.51.100.0/24"
NODES = {"aws-use1.node-0": "192.0.2.10", "office.rack-1": "2001:db8::10"}
PEERS = OverlayAccess(51820, tuple(NODES))
ANYONE = OverlayAccess(51820, (), anywhere=True)


class _Host(pulumi.ComponentResource):
    def __init__(self, name: str) -> None:
        super().__init__("denv:test:Host", name)


def _aws(access: OverlayAccess) -> Run:
    def program() -> dict[str, Any]:
        host = _Host("edge")
        # The host's group is made first, with the rows that name no machine made later ...
        rows = balancer_ingress_rules(BalancerSpec(("aws-use1",), port=443), (ADMIN,))
        security = SecurityGroupWiring(host, "edge", "balancer", {}, rows, {}, None, "us-east-1")
        # ... and the overlay's rules once its nodes exist.
        addresses = {n: pulumi.Output.from_input(a) for n, a in NODES.items()}
        security.allow(wireguard_rules(access), addresses)
        return {}

    return run_program(program, preview=False)


@pytest.mark.parametrize(
    ("access", "expected"),
    [
        (
            PEERS,
            {
                "edge-in-wireguard-from-aws-use1.node-0": ("cidrIpv4", "192.0.2.10/32"),
                "edge-in-wireguard-from-office.rack-1": ("cidrIpv6", "2001:db8::10/128"),
            },
        ),
        (
            ANYONE,
            {
                "edge-in-wireguard-v4": ("cidrIpv4", "0.0.0.0/0"),
                "edge-in-wireguard-v6": ("cidrIpv6", "::/0"),
            },
        ),
    ],
    ids=["peers", "behind-nat"],
)
def test_an_aws_host_takes_wireguard_over_udp_from_its_peers_or_anyone(
    access: OverlayAccess, expected: dict[str, tuple[str, str]]
) -> None:
    run = _aws(access)
    rules = {r.name: r.inputs for r in run.of_type(INGRESS)}
    wireguard = {name: rule for name, rule in rules.items() if "wireguard" in name}
    assert {
        name: next((k, rule[k]) for k in ("cidrIpv4", "cidrIpv6") if rule.get(k))
        for name, rule in wireguard.items()
    } == expected
    for rule in wireguard.values():
        assert (rule["ipProtocol"], rule["fromPort"], rule["toPort"]) == ("udp", 51820, 51820)
        assert rule["securityGroupId"] == "edge-sg-id"
    # The rest of the host's rules are as before: TCP, the endpoint, metrics and SSH.
    others = {name: rule for name, rule in rules.items() if "wireguard" not in name}
    assert sorted(others) == [
        "edge-in-endpoint-v4",
        "edge-in-endpoint-v6",
        "edge-in-metrics-198-51-100-0-24",
        "edge-in-ssh-198-51-100-0-24",
    ]
    assert {rule["ipProtocol"] for rule in others.values()} == {"tcp"}


def test_an_hcloud_host_gets_a_second_firewall_of_its_wireguard_rules_on_its_server() -> None:
    def program() -> dict[str, Any]:
        host = _Host("edge")
        server = hcloud.Server(
            "edge-vm",
            server_type="cpx22",
            image="ubuntu-24.04",
            opts=pulumi.ResourceOptions(parent=host),
        )
        addresses = {n: pulumi.Output.from_input(a) for n, a in NODES.items()}
        firewall = overlay_firewall(
            host,
            "edge",
            {"denv-role": "balancer"},
            wireguard_rules(PEERS),
            addresses,
            server.id.apply(int),
        )
        return {"server": server.id, "firewall": firewall.id}

    run = run_program(program, preview=False)
    (firewall,) = run.of_type(FIREWALL)
    assert firewall.name == "edge-fw-overlay"
    assert firewall.inputs["labels"] == {"denv-role": "balancer"}
    assert firewall.inputs["rules"] == [
        {
            "description": "WireGuard from overlay peer aws-use1.node-0",
            "direction": "in",
            "port": "51820",
            "protocol": "udp",
            "sourceIps": ["192.0.2.10/32"],
        },
        {
            "description": "WireGuard from overlay peer office.rack-1",
            "direction": "in",
            "port": "51820",
            "protocol": "udp",
            "sourceIps": ["2001:db8::10/128"],
        },
    ]
    (attachment,) = run.of_type(ATTACHMENT)
    # hcloud ids are integers: the attachment names the firewall and the server by theirs
    assert attachment.inputs["firewallId"] == int(run.outputs["firewall"])
    assert attachment.inputs["serverIds"] == [int(run.outputs["server"])]


def test_hcloud_rules_open_a_port_range_and_admin_cidrs_as_given() -> None:
    rows = balancer_ingress_rules(BalancerSpec(("h",), port=443), (ADMIN,), ANYONE)

    def program() -> dict[str, Any]:
        rules = hcloud_rules(rows, {})
        return {
            "rules": pulumi.Output.all(
                *(
                    pulumi.Output.all(r.protocol, r.port, pulumi.Output.all(*r.source_ips))
                    for r in rules
                )
            )
        }

    run = run_program(program, preview=False)
    assert run.outputs["rules"] == [
        ["tcp", "443", ["0.0.0.0/0"]],
        ["tcp", "443", ["::/0"]],
        ["tcp", "8405", [ADMIN]],
        ["udp", "51820", ["0.0.0.0/0"]],
        ["udp", "51820", ["::/0"]],
        ["tcp", "22", [ADMIN]],
    ]
