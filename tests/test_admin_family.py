"""admin_cidrs of an IP family the site is not reached over: one warning line with the fix."""

import pytest

from denv_iac.core.stack.contradictions import admin_family_warnings
from denv_iac.core.stack.model import NodeSpec, SiteSpec

V4_ONLY = "add the IPv4 addresses you administer from, e.g. 198.51.100.7/32"
V6_ONLY = "add the IPv6 addresses you administer from, e.g. 2001:db8::7/128"


def cloud(kind: str, *cidrs: str) -> SiteSpec:
    return SiteSpec("gpus", kind, admin_cidrs=cidrs)


def nodes(*addresses: str, cidrs: tuple[str, ...], kind: str = "joined") -> SiteSpec:
    machines = tuple(
        NodeSpec(f"n{i}", "L40S", 1, address=address) for i, address in enumerate(addresses)
    )
    return SiteSpec("rack", kind, nodes=machines, admin_cidrs=cidrs)


def refused(cidrs: str, version: int, reached: str) -> str:
    fix = V4_ONLY if version == 4 else V6_ONLY
    return (
        f"sites[0].admin_cidrs: {cidrs} holds no IPv{version} block, but {reached}, so the"
        f" firewall refuses the deploy's SSH over IPv{version}; {fix}"
    )


@pytest.mark.parametrize(
    ("site", "warnings"),
    [
        # Created machines have a public IPv4 address only.
        (
            cloud("aws", "2001:db8::/32"),
            [
                refused(
                    "2001:db8::/32",
                    4,
                    "aws gives the machines it creates a public IPv4 address only",
                )
            ],
        ),
        (
            cloud("lambda", "2001:db8::/48", "2001:db8:1::/48"),
            [
                refused(
                    "2001:db8::/48, 2001:db8:1::/48",
                    4,
                    "lambda gives the machines it creates a public IPv4 address only",
                )
            ],
        ),
        (
            cloud("nebius", "::/0"),
            [refused("::/0", 4, "nebius gives the machines it creates a public IPv4 address only")],
        ),
        (cloud("aws", "198.51.100.0/24"), []),
        (cloud("nebius", "2001:db8::/32", "198.51.100.0/24"), []),  # both families
        (cloud("aws"), []),  # none at all: the exposure checks say so
        # Existing machines are reached at their node address.
        (
            nodes("203.0.113.21", cidrs=("2001:db8::/32",), kind="hetzner"),
            [refused("2001:db8::/32", 4, "node n0 is reached at 203.0.113.21")],
        ),
        (
            nodes("2001:db8:5::21", cidrs=("198.51.100.0/24",)),
            [refused("198.51.100.0/24", 6, "node n0 is reached at 2001:db8:5::21")],
        ),
        (nodes("203.0.113.21", cidrs=("198.51.100.0/24",)), []),
        (nodes("2001:db8:5::21", cidrs=("2001:db8::/32",)), []),
        (nodes("2001:db8:5::21", cidrs=("2001:db8::/32", "198.51.100.0/24")), []),
        # Nodes of both families: the family no block admits is named, by its first node.
        (
            nodes("203.0.113.21", "2001:db8:5::21", "2001:db8:5::22", cidrs=("198.51.100.0/24",)),
            [refused("198.51.100.0/24", 6, "node n1 is reached at 2001:db8:5::21")],
        ),
        (
            nodes("2001:db8:5::21", "203.0.113.21", cidrs=("2001:db8::/32",)),
            [refused("2001:db8::/32", 4, "node n1 is reached at 203.0.113.21")],
        ),
        (nodes("203.0.113.21", "2001:db8:5::21", cidrs=("198.51.100.0/24", "::/0")), []),
        # A host name may resolve to either family: it says nothing.
        (nodes("gpu-1.example.com", cidrs=("2001:db8::/32",)), []),
        (
            nodes("gpu-1.example.com", "203.0.113.21", cidrs=("2001:db8::/32",)),
            [refused("2001:db8::/32", 4, "node n1 is reached at 203.0.113.21")],
        ),
        # Sites without a firewall of the stack's hold no admin_cidrs.
        (nodes("127.0.0.1", cidrs=(), kind="local"), []),
        (SiteSpec("k8s", "kubernetes"), []),
    ],
)
def test_admin_cidrs_of_a_family_the_site_is_not_reached_over(
    site: SiteSpec, warnings: list[str]
) -> None:
    assert admin_family_warnings([site]) == warnings


def test_each_site_is_named_by_its_index() -> None:
    sites = [cloud("aws", "198.51.100.0/24"), cloud("lambda", "2001:db8::/32")]
    assert [w.split(":")[0] for w in admin_family_warnings(sites)] == ["sites[1].admin_cidrs"]
