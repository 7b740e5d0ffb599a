"""The contract between Cluster and a site component: what a site is given, what it gives back."""

from collections.abc import Callable, Mapping, Sequence
from typing import TypedDict

import pulumi

from denv_iac.placement import PlacedNode
from denv_iac.spec.model import SiteSpec, StackSpec


class SiteContext(TypedDict):
    """What every site component may need, beyond its placed nodes."""

    stack: str  # the stack's name
    spec: StackSpec
    nodes: Sequence[PlacedNode]  # the placed nodes of this site
    secrets: Mapping[str, pulumi.Output[str]]  # this site's secret fields, by field name
    balancer_addresses: Mapping[str, pulumi.Output[str]]  # balancer site -> host address


# Makes a site's component (name, site, context, opts) and gives its node addresses by name.
SiteBuilder = Callable[
    [str, SiteSpec, SiteContext, pulumi.ResourceOptions], pulumi.Output[dict[str, str]]
]
