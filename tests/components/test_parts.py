"""WarmPool, GlobalBalancer and the Hetzner balancer host on their own."""

from typing import Any

import pulumi
import pytest

from denv_iac.components import BalancerHost, GlobalBalancer, JoinedSite, WarmPool
from denv_iac.components.pool import ReplicaEndpointArgs
from denv_iac.components.secrets import public_key_of
from denv_iac.core.placement import PlacedNode, place_replicas
from denv_iac.core.stack.catalog import load_catalog
from denv_iac.core.stack.model import BalancerSpec, SiteSpec
from denv_iac.core.stack.site_reader import HETZNER_LOCATIONS
from denv_iac.stacks_dir import load_stack
from tests.components import stacks
from tests.components.harness import Run, run_program
from tests.components.test_stack_program import PROGRAM


def _replica(index: int, address: pulumi.Input[str]) -> ReplicaEndpointArgs:
    return {
        "id": f"voice.office.rack-{index}.0",
        "site": "office",
        "node": f"rack-{index}",
        "tier": 0,
        "address": address,
        "port": 8000,
        "agent_port": 9100,
    }


def test_warm_pool_lists_its_replicas_once_addresses_resolve() -> None:
    def program() -> dict[str, Any]:
        later = pulumi.Output.from_input("192.0.2.11")
        pool = WarmPool(
            "voice",
            {"recipe": "voice", "replicas": [_replica(1, "192.0.2.10"), _replica(2, later)]},
        )
        return {"replicas": pool.replicas}

    run = run_program(program, preview=False)
    assert [r["address"] for r in run.outputs["replicas"]] == ["192.0.2.10", "192.0.2.11"]
    assert run.outputs["replicas"][1] == {**_replica(2, "192.0.2.11")}
    assert [(r.type, r.name, r.custom) for r in run.registrations] == [
        ("denv:index:WarmPool", "voice", False)
    ]


def test_joined_site_outputs_its_listed_addresses() -> None:
    nodes = [
        PlacedNode("office", "rack-2", "A100-80GB", 2, False, "", "192.0.2.11", 1),
        PlacedNode("office", "rack-1", "A100-80GB", 2, False, "", "192.0.2.10", 1),
    ]

    def program() -> dict[str, Any]:
        return {"nodes": JoinedSite("office", {"nodes": nodes}).node_addresses}

    run = run_program(program, preview=True)
    assert run.outputs["nodes"] == {"rack-1": "192.0.2.10", "rack-2": "192.0.2.11"}


def test_global_balancer_renders_from_the_pools_and_exports_digests_only() -> None:
    stack = load_stack(PROGRAM.parent, "local")
    placement = place_replicas(stack, ())
    endpoints: list[ReplicaEndpointArgs] = [
        {
            "id": r.id,
            "site": r.site,
            "node": r.node,
            "tier": r.tier,
            "address": "127.0.0.1",
            "port": 8000 + i,
            "agent_port": 9100,
        }
        for i, r in enumerate(placement.replicas)
    ]

    def program() -> dict[str, Any]:
        balancer = GlobalBalancer(
            "dev-balancer",
            {
                "stack": stack,
                "placement": placement,
                "pools": [endpoints],
                "hosts": {"local": "127.0.0.1"},
            },
        )
        return {
            "cfg": balancer.haproxy_config,
            "endpoint": balancer.endpoint,
            "maps": balancer.map_files,
        }

    run = run_program(program, preview=False)
    assert run.outputs["endpoint"] == "http://127.0.0.1:8080"
    for i, replica in enumerate(placement.replicas):
        assert f"server {replica.id} 127.0.0.1:{8000 + i} " in run.outputs["cfg"]
    assert run.outputs["maps"]  # the pool map files HAProxy reads
    assert [r.custom for r in run.registrations] == [False]


def _hetzner_balancer_host(location: str, preview: bool) -> Run:
    site = SiteSpec("hetzner-fsn", "hetzner", region=location, admin_cidrs=(stacks.ADMIN,))

    def program() -> dict[str, Any]:
        host = BalancerHost(
            "prod-balancer-hetzner-fsn",
            {
                "stack": "prod",
                "site": site,
                "balancer": BalancerSpec(("hetzner-fsn",), port=443),
                # Hetzner's key is found by its fingerprint first: a real public key.
                "public_key": public_key_of(stacks.SSH_KEYS["hetzner-fsn"]),
            },
        )
        return {"address": host.address}

    return run_program(program, preview=preview)


def test_hetzner_balancer_host_is_a_firewalled_server_with_numeric_ids() -> None:
    run = _hetzner_balancer_host("nbg1", preview=False)
    firewall = run.named("prod-balancer-hetzner-fsn-fw")
    server = run.named("prod-balancer-hetzner-fsn-vm").inputs
    assert [(r["port"], r["sourceIps"]) for r in firewall.inputs["rules"]] == [
        ("443", ["0.0.0.0/0"]),
        ("443", ["::/0"]),
        ("8405", [stacks.ADMIN]),
        ("22", [stacks.ADMIN]),
    ]
    assert server["location"] == "nbg1"
    assert len(server["firewallIds"]) == 1 and float(server["firewallIds"][0]).is_integer()
    assert server["labels"]["denv-role"] == "balancer"
    assert run.outputs["address"].startswith("198.18.")


@pytest.mark.parametrize("location", HETZNER_LOCATIONS)
def test_hetzner_balancer_server_type_is_one_the_api_offers_at_its_location(location: str) -> None:
    run = _hetzner_balancer_host(location, preview=True)
    server_type = run.named("prod-balancer-hetzner-fsn-vm").inputs["serverType"]
    types = load_catalog().hcloud_types
    assert server_type not in types.removed
    assert location in types.types[server_type].locations
