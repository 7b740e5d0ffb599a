"""The contract between Cluster and a site component: what a site is given, what it gives back."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

import pulumi

from denv_iac.components.gateway_tls import GatewayTls
from denv_iac.core.placement import PlacedNode
from denv_iac.core.stack.model import SiteSpec, StackSpec


class SiteContext(TypedDict):
    """What every site component may need, beyond its placed nodes."""

    stack: str  # the stack's name
    spec: StackSpec
    nodes: Sequence[PlacedNode]  # the placed nodes of this site
    secrets: Mapping[str, pulumi.Output[str]]  # this site's secret fields, by field name
    # Each recipe's `secure:` env values: recipe name -> variable -> secret.
    env_secrets: Mapping[str, Mapping[str, pulumi.Output[str]]]
    balancer_addresses: Mapping[str, pulumi.Output[str]]  # balancer site -> host address
    # The stack's gateway CA and certificates, when Kubernetes gateways are reached over TLS.
    gateway_tls: NotRequired[GatewayTls]
    # On a Kubernetes site: what each pool's workload waits on before it rolls, by pool (the
    # pool's previous rollout units, denv_iac.core.rollout.rollout_after).
    waits_on: NotRequired[Mapping[str, Sequence[pulumi.Resource]]]


@dataclass(frozen=True)
class SiteNodes:
    """A site's component, and what it gives back about its nodes, by node name."""

    component: pulumi.Resource  # the parent of what is set up on the site's nodes
    addresses: pulumi.Output[dict[str, str]]
    # The block device of each node's own cache volume, where the site gives nodes one (AWS).
    cache_devices: pulumi.Output[dict[str, str]] | None = None
    # What a node's deploy must wait for, by node name: a firewall on its path (Robot's).
    ready: Mapping[str, Sequence[pulumi.Resource]] = field(default_factory=dict)
    # What rolls each pool's replicas on the site, by pool, where the site does (Kubernetes:
    # the StatefulSet): what the pool's next rollout unit waits on.
    workloads: Mapping[str, pulumi.Resource] = field(default_factory=dict)


# Makes a site's component (name, site, context, opts) and gives it back with its nodes.
SiteBuilder = Callable[[str, SiteSpec, SiteContext, pulumi.ResourceOptions], SiteNodes]
