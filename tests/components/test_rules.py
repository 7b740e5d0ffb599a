"""Security rows, ports, names and tags: pure, table-tested."""

import pytest

from denv_iac.components.naming import aws_tags, child_name, hcloud_labels, machine_name
from denv_iac.components.security import (
    AGENT_PORT,
    IngressRule,
    balancer_ingress_rules,
    recipe_port_range,
    replica_port,
    site_ingress_rules,
    ssh_rules,
)
from denv_iac.placement import PlacedReplica
from denv_iac.spec.model import BalancerSpec, RecipeSpec, SiteSpec

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
    assert [(r.source, r.from_port, r.to_port, r.from_balancer) for r in rules] == [
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
        from_balancer=True,
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
            assert not rule.from_balancer and rule.source in ADMINS
        else:
            assert rule.from_balancer and rule.source in ("hetzner-fsn", "aws-use1")


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
