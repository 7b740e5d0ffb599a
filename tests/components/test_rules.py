"""Security rows, ports, names and tags: pure, table-tested."""

import pytest

from denv_iac.components.naming import aws_tags, child_name, hcloud_labels, machine_name
from denv_iac.core.ingress import (
    AGENT_PORT,
    IngressRule,
    OverlayAccess,
    balancer_ingress_rules,
    host_cidr,
    host_overlay_access,
    node_overlay_access,
    recipe_port_range,
    replica_port,
    site_ingress_rules,
    ssh_rules,
)
from denv_iac.core.overlay_plan import plan_overlay
from denv_iac.core.placement import PlacedReplica, place_replicas
from denv_iac.core.stack.model import WIREGUARD_PORT, BalancerSpec, RecipeSpec, SiteSpec
from denv_iac.core.stack.reader import read_stack
from tests.stacks import SECRET

ADMINS = ("203.0.113.0/24", "198.51.100.0/24")
AWS = SiteSpec("aws-use1", "aws", gpus_per_node=8, admin_cidrs=ADMINS)
VOICE = RecipeSpec("voice", "whole", (("aws-use1",),), 2)
SIDE = RecipeSpec("side", "1g.10gb", (("office",),), 1, port=8200)


def _replica(gpu: int, slice_index: int | None) -> PlacedReplica:
    return PlacedReplica("voice.s.n.0", "voice", "s", "n", gpu, slice_index, "whole", 0)


@pytest.mark.parametrize(
    ("gpu", "slice_index", "port"), [(0, None, 8000), (1, None, 8008), (7, 6, 8062), (0, 3, 8003)]
)
def test_replica_port_is_fixed_by_gpu_and_slice(
    gpu: int, slice_index: int | None, port: int
) -> None:
    assert replica_port(VOICE, _replica(gpu, slice_index)) == port


@pytest.mark.parametrize(
    ("gpus", "expected"), [(1, (8000, 8007)), (8, (8000, 8063)), (0, (8000, 8007))]
)
def test_recipe_port_range_covers_every_gpu_and_slice(gpus: int, expected: tuple[int, int]) -> None:
    assert recipe_port_range(VOICE, gpus) == expected


def test_ssh_only_from_admin_cidrs_in_sorted_order() -> None:
    rules = ssh_rules(ADMINS)
    assert [(r.source, r.from_port, r.to_port, r.from_machine) for r in rules] == [
        ("198.51.100.0/24", 22, 22, False),
        ("203.0.113.0/24", 22, 22, False),
    ]
    assert [r.name for r in rules] == ["ssh-198-51-100-0-24", "ssh-203-0-113-0-24"]


def test_site_rules_open_replica_and_agent_ports_to_balancers_only() -> None:
    rules = site_ingress_rules(AWS, (VOICE, SIDE), ("hetzner-fsn", "aws-use1"))
    by_name = {r.name: r for r in rules}
    assert by_name["agent-from-aws-use1"] == IngressRule(
        "agent-from-aws-use1",
        "agent-check from balancer aws-use1",
        AGENT_PORT,
        AGENT_PORT,
        "aws-use1",
        from_machine=True,
    )
    assert (
        by_name["voice-from-hetzner-fsn"].from_port,
        by_name["voice-from-hetzner-fsn"].to_port,
    ) == (
        8000,
        8063,
    )
    # side does not run on this site: nothing of it is opened
    assert not any(r.name.startswith("side") for r in rules)
    for rule in rules:
        if rule.from_port == 22:
            assert not rule.from_machine and rule.source in ADMINS
        else:
            assert rule.from_machine and rule.source in ("hetzner-fsn", "aws-use1")


def test_site_without_balancers_or_admins_opens_nothing() -> None:
    assert site_ingress_rules(SiteSpec("s", "aws"), (VOICE,), ()) == ()


def test_balancer_rules_endpoint_anywhere_metrics_and_ssh_from_admins() -> None:
    rules = balancer_ingress_rules(BalancerSpec(("aws-use1",), port=443), ("198.51.100.0/24",))
    assert [(r.name, r.source, r.from_port) for r in rules] == [
        ("endpoint-v4", "0.0.0.0/0", 443),
        ("endpoint-v6", "::/0", 443),
        ("metrics-198-51-100-0-24", "198.51.100.0/24", 8405),
        ("ssh-198-51-100-0-24", "198.51.100.0/24", 22),
    ]


def _rows(rules: tuple[IngressRule, ...]) -> list[tuple[str, str, int, int, str, bool]]:
    return [(r.name, r.protocol, r.from_port, r.to_port, r.source, r.from_machine) for r in rules]


def _ssh(cidr: str) -> tuple[str, str, int, int, str, bool]:
    return (f"ssh-{cidr.replace('.', '-').replace('/', '-')}", "tcp", 22, 22, cidr, False)


def _wg(peer: str, port: int = WIREGUARD_PORT) -> tuple[str, str, int, int, str, bool]:
    return (f"wireguard-from-{peer}", "udp", port, port, peer, True)


WG_ANYWHERE = [
    ("wireguard-v4", "udp", WIREGUARD_PORT, WIREGUARD_PORT, "0.0.0.0/0", False),
    ("wireguard-v6", "udp", WIREGUARD_PORT, WIREGUARD_PORT, "::/0", False),
]
TODAY_FROM_HETZNER = [
    ("agent-from-hetzner-fsn", "tcp", AGENT_PORT, AGENT_PORT, "hetzner-fsn", True),
    ("voice-from-hetzner-fsn", "tcp", 8000, 8063, "hetzner-fsn", True),
]
BALANCERS = ("hetzner-fsn", "aws-use1")
SITE_CASES = [
    # (overlay, the nodes' ingress): SSH from admins always; the rest from the balancer hosts
    (
        None,  # the overlay off: replica and agent ports from each balancer host, as before
        [
            *(_ssh(c) for c in sorted(ADMINS)),
            ("agent-from-aws-use1", "tcp", AGENT_PORT, AGENT_PORT, "aws-use1", True),
            ("voice-from-aws-use1", "tcp", 8000, 8063, "aws-use1", True),
            *TODAY_FROM_HETZNER,
        ],
    ),
    (
        OverlayAccess(WIREGUARD_PORT, BALANCERS),  # every host tunnels: WireGuard only
        [*(_ssh(c) for c in sorted(ADMINS)), _wg("aws-use1"), _wg("hetzner-fsn")],
    ),
    (
        OverlayAccess(443, ("aws-use1",)),  # one host joins, one does not; a chosen port
        [*(_ssh(c) for c in sorted(ADMINS)), _wg("aws-use1", 443), *TODAY_FROM_HETZNER],
    ),
    (
        OverlayAccess(WIREGUARD_PORT, BALANCERS, anywhere=True),  # a peer behind NAT
        [*(_ssh(c) for c in sorted(ADMINS)), *WG_ANYWHERE],
    ),
]


@pytest.mark.parametrize(("overlay", "expected"), SITE_CASES)
def test_node_rules_open_wireguard_instead_of_replica_ports_to_tunnelling_hosts(
    overlay: OverlayAccess | None, expected: list[tuple[str, str, int, int, str, bool]]
) -> None:
    rules = site_ingress_rules(AWS, (VOICE, SIDE), BALANCERS, overlay)
    assert _rows(rules) == expected


BALANCER = BalancerSpec(("aws-use1",), port=443)
HOST_CASES = [
    (None, []),
    (OverlayAccess(WIREGUARD_PORT, ("b.n-1", "a.n-0")), [_wg("a.n-0"), _wg("b.n-1")]),
    (OverlayAccess(WIREGUARD_PORT, ("a.n-0",), anywhere=True), WG_ANYWHERE),
]


@pytest.mark.parametrize(("overlay", "wireguard"), HOST_CASES)
def test_balancer_host_rules_keep_endpoint_metrics_and_ssh_and_add_wireguard(
    overlay: OverlayAccess | None, wireguard: list[tuple[str, str, int, int, str, bool]]
) -> None:
    rules = balancer_ingress_rules(BALANCER, ("198.51.100.0/24",), overlay)
    assert _rows(rules) == [
        ("endpoint-v4", "tcp", 443, 443, "0.0.0.0/0", False),
        ("endpoint-v6", "tcp", 443, 443, "::/0", False),
        ("metrics-198-51-100-0-24", "tcp", 8405, 8405, "198.51.100.0/24", False),
        *wireguard,
        _ssh("198.51.100.0/24"),
    ]


def _stack(nat: bool, overlay: dict[str, object], address: str) -> dict[str, object]:
    """A Hetzner balancer host and a second on AWS, GEX boxes, AWS nodes and an office."""
    office: list[dict[str, object]] = [
        {"name": "rack-1", "address": address, "gpu": "L40S", "gpus": 1}
    ]
    if nat:
        office[0]["behind_nat"] = True
    return {
        "denv:sites": [
            {
                "name": "hetzner-fsn",
                "kind": "hetzner",
                "ssh_private_key": SECRET,
                "nodes": [{"name": "gex-1", "address": "203.0.113.21", "server_model": "GEX44"}],
            },
            {
                "name": "aws-use1",
                "kind": "aws",
                "region": "us-east-1",
                "instance_type": "p5.4xlarge",
                "max_nodes": 2,
                "ssh_private_key": SECRET,
            },
            {"name": "office", "kind": "joined", "ssh_private_key": SECRET, "nodes": office},
        ],
        "denv:recipes": [
            {
                "name": "voice",
                "min_warm": 2,
                "spare": 1,
                "image": "vllm/vllm-openai:v0.11.0",
                "sites": ["hetzner-fsn", "aws-use1", "office"],
            }
        ],
        "denv:balancer": {"sites": ["hetzner-fsn", "aws-use1"], "overlay": overlay or {}},
    }


NODES = ("aws-use1.node-0", "aws-use1.node-1", "hetzner-fsn.gex-1", "office.rack-1")
HOSTS = tuple(sorted(BALANCERS))
ANYONE = OverlayAccess(51820, (), anywhere=True)
ACCESS_CASES = [
    # (behind NAT, overlay, the office's address, a site's nodes' access, a host's access)
    (False, {}, "192.0.2.10", OverlayAccess(51820, HOSTS), OverlayAccess(51820, NODES)),
    (True, {}, "192.0.2.10", OverlayAccess(51820, HOSTS), ANYONE),
    # listed by a host name: no provider's rule holds one
    (False, {}, "rack-1.office.example", OverlayAccess(51820, HOSTS), ANYONE),
    (False, {"port": 443}, "192.0.2.10", OverlayAccess(443, HOSTS), OverlayAccess(443, NODES)),
    (False, {"enabled": False}, "192.0.2.10", None, None),
]


@pytest.mark.parametrize(("nat", "overlay", "address", "node", "host"), ACCESS_CASES)
def test_overlay_access_of_nodes_and_hosts_follows_the_plan(
    nat: bool,
    overlay: dict[str, object],
    address: str,
    node: OverlayAccess | None,
    host: OverlayAccess | None,
) -> None:
    stack = read_stack("s", _stack(nat, overlay, address))
    plan = plan_overlay(stack, place_replicas(stack))
    for site in ("hetzner-fsn", "aws-use1", "office"):
        assert node_overlay_access(stack, site) == node, site
    for member in ("hetzner-fsn:balancer", "aws-use1:balancer"):
        assert host_overlay_access(plan, member) == host, member


def test_names_are_derived_only_from_their_parts() -> None:
    assert child_name("prod-aws-use1", "node-0", "cache") == "prod-aws-use1-node-0-cache"
    assert machine_name("prod", "aws-use1", "node-0") == "prod-aws-use1-node-0"


def test_aws_tags_stable_and_named_for_nodes() -> None:
    assert aws_tags("prod", "aws-use1", "gpu-node", "node-0") == {
        "Name": "prod-aws-use1-node-0",
        "denv:managed-by": "denv",
        "denv:node": "node-0",
        "denv:role": "gpu-node",
        "denv:site": "aws-use1",
        "denv:stack": "prod",
    }
    assert "Name" not in aws_tags("prod", "aws-use1", "gpu-node")


def test_hcloud_labels_keep_only_allowed_characters() -> None:
    labels = hcloud_labels("team/prod stack", "hetzner-fsn", "balancer")
    assert labels == {
        "denv-managed-by": "denv",
        "denv-role": "balancer",
        "denv-site": "hetzner-fsn",
        "denv-stack": "team-prod-stack",
    }
    assert len(hcloud_labels("x" * 100, "s", "r")["denv-stack"]) == 63


def test_one_hosts_address_as_a_source_cidr() -> None:
    # AWS security groups, Hetzner Cloud firewalls and the Kubernetes network policy alike.
    assert host_cidr("203.0.113.7") == "203.0.113.7/32"
    assert host_cidr("2001:db8::7") == "2001:db8::7/128"
