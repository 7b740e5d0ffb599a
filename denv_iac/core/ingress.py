"""Who may reach what on a site, as plain data: the components turn these rows into rules.

With the WireGuard overlay on (the default), a node's replica and agent ports are not open on
its public address at all: the balancer reaches them through the tunnel, and the only port open
to it is WireGuard's, from its peers' public addresses. With the overlay off, or for a balancer
that joins none (one on a local site), replica and agent ports are open to the balancer hosts
only. SSH (and the balancer's metrics port) only from the site's admin CIDRs; the balancer's
endpoint port to everyone.
"""

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from denv_iac.core.overlay_plan import OverlayPlan, node_peer_sites, wireguard_senders
from denv_iac.core.stack.model import BalancerSpec, RecipeSpec, SiteSpec, StackSpec
from denv_iac.core.stack.ports import (
    AGENT_PORT,
    AGENT_PORTS,
    MAX_GPUS_PER_NODE,
    PORTS_PER_GPU,
    SSH_PORT,
    recipe_port_range,
    replica_port,
)

# The port plan lives with the stack model (pure); components read it from here too.
__all__ = [
    "AGENT_PORT",
    "AGENT_PORTS",
    "MAX_GPUS_PER_NODE",
    "PORTS_PER_GPU",
    "SSH_PORT",
    "IngressRule",
    "OverlayAccess",
    "balancer_ingress_rules",
    "host_cidr",
    "host_overlay_access",
    "node_overlay_access",
    "recipe_port_range",
    "replica_port",
    "site_ingress_rules",
    "ssh_rules",
    "wireguard_rules",
]
ANYWHERE = {"v4": "0.0.0.0/0", "v6": "::/0"}
Protocol = Literal["tcp", "udp"]


@dataclass(frozen=True)
class IngressRule:
    name: str  # stable suffix of the rule's resource name
    description: str
    from_port: int
    to_port: int
    # A CIDR; or, when from_machine, the name of a machine whose public address the wiring is
    # given: a balancer site on a node's rules, an overlay member on a balancer host's.
    source: str
    from_machine: bool = False
    protocol: Protocol = "tcp"


@dataclass(frozen=True)
class OverlayAccess:
    """Who may send WireGuard packets to a machine of the overlay, and to which UDP port."""

    port: int
    peers: tuple[str, ...]  # machines whose public addresses may (names, as in IngressRule)
    anywhere: bool = False  # a peer is behind NAT, so its address is unknown: any source


def node_overlay_access(stack: StackSpec, site_name: str) -> OverlayAccess | None:
    """What a site's nodes take from the overlay: WireGuard from each balancer host (by site).

    None when its nodes join no overlay. The hosts always have public addresses: a node behind
    NAT cannot host the balancer (`denv_iac.core.stack.overlay_reader`).
    """
    hosts = node_peer_sites(stack, site_name)
    return OverlayAccess(stack.balancer.overlay.port, hosts) if hosts else None


def host_overlay_access(plan: OverlayPlan, member: str) -> OverlayAccess | None:
    """What a balancer host (an overlay member) takes: WireGuard from each node it peers with.

    None when the overlay links nothing. From anywhere when a peer is behind NAT, or is listed
    by a host name, which no provider's rule can hold (as for the node's own firewall,
    `denv_iac.core.overlay_plan.wireguard_sources`).
    """
    if not plan.on:
        return None
    senders = wireguard_senders(plan, member)
    if senders is None or any(_named(plan.member(s).public_address) for s in senders):
        return OverlayAccess(plan.spec.port, (), anywhere=True)
    return OverlayAccess(plan.spec.port, senders)


def _named(address: str) -> bool:
    """A machine listed by a host name; "" is one the stack makes, with an address once made."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return bool(address)
    return False


def _cidr_slug(cidr: str) -> str:
    return cidr.replace(".", "-").replace(":", "-").replace("/", "-")


def ssh_rules(admin_cidrs: tuple[str, ...]) -> list[IngressRule]:
    return [
        IngressRule(f"ssh-{_cidr_slug(c)}", f"SSH from admin {c}", SSH_PORT, SSH_PORT, c)
        for c in sorted(admin_cidrs)
    ]


def wireguard_rules(overlay: OverlayAccess) -> list[IngressRule]:
    """WireGuard's UDP port from each peer's public address, or from anywhere.

    Open to anywhere (a peer behind NAT sends from an address nobody knows), the port still
    reveals nothing: WireGuard sends no reply to a packet without a valid key, so a scan cannot
    tell it from a closed port, and only the peers' keys get in.
    """
    port = overlay.port
    if overlay.anywhere:
        return [
            IngressRule(
                f"wireguard-{family}",
                "WireGuard from anywhere: a peer behind NAT",
                port,
                port,
                cidr,
                protocol="udp",
            )
            for family, cidr in ANYWHERE.items()
        ]
    return [
        IngressRule(
            f"wireguard-from-{peer}",
            f"WireGuard from overlay peer {peer}",
            port,
            port,
            peer,
            from_machine=True,
            protocol="udp",
        )
        for peer in sorted(overlay.peers)
    ]


def site_ingress_rules(
    site: SiteSpec,
    recipes: tuple[RecipeSpec, ...],
    balancer_sites: tuple[str, ...],
    overlay: OverlayAccess | None = None,
) -> tuple[IngressRule, ...]:
    """Ingress to a site's GPU nodes from the balancer hosts, and SSH from admins.

    A host that reaches the nodes through the overlay (`overlay.peers`) gets WireGuard's port
    only; any other (the overlay off) gets the agent port and, per recipe that may run here,
    its replica ports.
    """
    rules = ssh_rules(site.admin_cidrs)
    tunnelled = set(overlay.peers) if overlay else set()
    if overlay:
        rules += wireguard_rules(overlay)
    for host in sorted(balancer_sites):
        if host in tunnelled:
            continue
        rules.append(
            IngressRule(
                f"agent-from-{host}",
                f"agent-check from balancer {host}",
                AGENT_PORT,
                AGENT_PORT,
                host,
                from_machine=True,
            )
        )
        for recipe in recipes:
            if site.name not in recipe.sites:
                continue
            low, high = recipe_port_range(recipe, site.gpus_per_node)
            rules.append(
                IngressRule(
                    f"{recipe.name}-from-{host}",
                    f"{recipe.name} replicas from balancer {host}",
                    low,
                    high,
                    host,
                    from_machine=True,
                )
            )
    return tuple(rules)


def balancer_ingress_rules(
    balancer: BalancerSpec, admin_cidrs: tuple[str, ...], overlay: OverlayAccess | None = None
) -> tuple[IngressRule, ...]:
    """Ingress to a balancer host: the endpoint from anywhere, metrics and SSH from admins, and
    WireGuard from its nodes when it joins the overlay."""
    rules = [
        IngressRule(f"endpoint-{family}", "the endpoint", balancer.port, balancer.port, cidr)
        for family, cidr in ANYWHERE.items()
    ]
    rules += [
        IngressRule(
            f"metrics-{_cidr_slug(c)}",
            f"Prometheus metrics from admin {c}",
            balancer.prometheus_port,
            balancer.prometheus_port,
            c,
        )
        for c in sorted(admin_cidrs)
    ]
    if overlay:
        rules += wireguard_rules(overlay)
    return (*rules, *ssh_rules(admin_cidrs))


def host_cidr(address: str) -> str:
    """One host's address as a CIDR, as firewalls and policies take a source: /32, or /128 for
    an IPv6 address."""
    return f"{address}/128" if ":" in address else f"{address}/32"


def ipv4_source(rule: IngressRule, addresses: Mapping[str, str]) -> str | None:
    """The rule's source as an IPv4 CIDR, for firewalls that filter IPv4 only (Lambda, Robot):
    a machine's row takes that machine's address from `addresses`. None where the source is
    empty or IPv6, which such a firewall has no place for (the node's own firewall filters it)."""
    source = addresses[rule.source] if rule.from_machine else rule.source
    if not source or ":" in source:
        return None
    return source if "/" in source else host_cidr(source)
