"""Hetzner Cloud firewalls of balancer hosts made on `hetzner` sites: ingress rows as hcloud rules.

A host's own firewall is made with its server. The WireGuard rules of the overlay name the
host's peers, nodes made after it (their rules name the host in turn), so they go in a second
firewall, made once the nodes exist and attached to the same server: hcloud applies every
firewall attached to a server, and a packet any of them accepts is let in.
"""

from collections.abc import Mapping, Sequence

import pulumi
import pulumi_hcloud as hcloud

from denv_iac.components.naming import child_name
from denv_iac.core.ingress import IngressRule, host_cidr


def hcloud_rules(
    rules: Sequence[IngressRule], addresses: Mapping[str, pulumi.Input[str]]
) -> list[hcloud.FirewallRuleArgs]:
    """One inbound rule per row, of its protocol; a machine's row opens to its address."""
    out = []
    for rule in rules:
        if rule.from_machine:
            source = pulumi.Output.from_input(addresses[rule.source]).apply(host_cidr)
        else:
            source = pulumi.Output.from_input(rule.source)
        ports = str(rule.from_port)
        if rule.to_port != rule.from_port:
            ports = f"{rule.from_port}-{rule.to_port}"
        out.append(
            hcloud.FirewallRuleArgs(
                direction="in",
                protocol=rule.protocol,
                port=ports,
                source_ips=[source],
                description=rule.description,
            )
        )
    return out


def overlay_firewall(
    parent: pulumi.Resource,
    name: str,
    labels: Mapping[str, str],
    rules: Sequence[IngressRule],
    addresses: Mapping[str, pulumi.Input[str]],
    server_id: pulumi.Input[int],
) -> hcloud.Firewall:
    """A firewall of the host's WireGuard rules (`security.wireguard_rules`), on its server."""
    child = pulumi.ResourceOptions(parent=parent)
    firewall = hcloud.Firewall(
        child_name(name, "fw-overlay"),
        labels=dict(labels),
        rules=hcloud_rules(rules, addresses),
        opts=child,
    )
    hcloud.FirewallAttachment(
        child_name(name, "fw-overlay-attach"),
        firewall_id=firewall.id.apply(int),
        server_ids=[server_id],
        opts=child,
    )
    return firewall
