"""Warnings about settings that are each valid but work against each other.

Each is one line naming the field and the fix; `denv plan` prints them with the exposure
warnings (denv_iac.core.stack.exposure) and `denv plan --strict` refuses the stack on them.
"""

import ipaddress
from collections.abc import Sequence

from denv_iac.core.stack.model import SiteSpec, StackSpec

# Networks container runtimes and Kubernetes distributions route on a node by default (a
# bridge, a pod network): an overlay that overlaps one sends the balancer's traffic into it.
# Service ranges are left out: they are virtual addresses, matched one by one, not routed.
CONTAINER_RANGES = (
    ("Docker's default bridge", "172.17.0.0/16"),
    ("Flannel's default pod network", "10.244.0.0/16"),
    ("k3s's default pod network", "10.42.0.0/16"),
)


# Kinds whose machines the stack creates with a public IPv4 address only (an Elastic IP on
# AWS, the instance's address on Lambda and Nebius): the deploy reaches them over IPv4.
IPV4_ONLY_KINDS = ("aws", "lambda", "nebius")
# A block of each family to show in a fix (documentation ranges, RFC 5737 and RFC 3849).
EXAMPLE_BLOCKS = {4: "198.51.100.7/32", 6: "2001:db8::7/128"}


def contradiction_warnings(stack: StackSpec) -> list[str]:
    return (
        _probe_budget_warnings(stack)
        + _overlay_range_warnings(stack)
        + admin_family_warnings(stack.sites)
    )


def _probe_budget_warnings(stack: StackSpec) -> list[str]:
    """A probe budget past the balancer's first-token timeout: the balancer has already given
    up on a replica (and sent the request elsewhere) before the agent would call it slow, so
    the probe never takes a slow replica out first."""
    out = []
    for index, recipe in enumerate(stack.recipes):
        budget = recipe.ttft_budget_ms
        if budget is not None and budget > recipe.first_token_timeout_ms:
            out.append(
                f"recipes[{index}].ttft_budget_ms: {budget} is longer than its"
                f" first_token_timeout_ms ({recipe.first_token_timeout_ms}), so the balancer"
                " retries a slow replica's requests elsewhere before its agent would call it"
                f" slow; make it at most {recipe.first_token_timeout_ms}"
            )
    return out


def _overlay_range_warnings(stack: StackSpec) -> list[str]:
    overlay = stack.balancer.overlay
    if not overlay.enabled:
        return []
    ours = ipaddress.ip_network(overlay.cidr, strict=False)
    return [
        f"balancer.overlay.cidr: {overlay.cidr} overlaps {name} ({cidr}), so on a node that"
        " runs it the overlay's traffic can be routed into that network; pick a range clear"
        " of it, e.g. the default 10.99.0.0/16"
        for name, cidr in CONTAINER_RANGES
        if ours.overlaps(ipaddress.ip_network(cidr))
    ]


def admin_family_warnings(sites: Sequence[SiteSpec]) -> list[str]:
    """admin_cidrs of one IP family on a site reached over the other: a connection comes from an
    address of the family it goes to, so the firewall admits SSH from no address the deploy
    (or an admin) connects from, and the deploy cannot reach the machines."""
    out = []
    for index, site in enumerate(sites):
        if not site.admin_cidrs:
            continue  # none at all is warned about by the exposure checks
        admitted = {ipaddress.ip_network(c, strict=False).version for c in site.admin_cidrs}
        for version, reached in _reached_over(site):
            if version not in admitted:
                out.append(
                    f"sites[{index}].admin_cidrs: {', '.join(site.admin_cidrs)} holds no IPv"
                    f"{version} block, but {reached}, so the firewall refuses the deploy's SSH"
                    f" over IPv{version}; add the IPv{version} addresses you administer from,"
                    f" e.g. {EXAMPLE_BLOCKS[version]}"
                )
    return out


def _reached_over(site: SiteSpec) -> list[tuple[int, str]]:
    """(IP version, what is reached over it) for each family the deploy reaches the site's
    machines over: a node given by host name may resolve to either, so it says nothing."""
    if site.kind in IPV4_ONLY_KINDS:
        return [(4, f"{site.kind} gives the machines it creates a public IPv4 address only")]
    found: dict[int, str] = {}
    for node in site.nodes:
        try:
            version = ipaddress.ip_address(node.address).version
        except ValueError:
            continue
        found.setdefault(version, f"node {node.name} is reached at {node.address}")
    return sorted(found.items())
