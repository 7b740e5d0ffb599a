"""Sites whose machines already exist: joined hosts, Hetzner GEX boxes, this machine.

They create no cloud resources: their nodes are listed in the stack, and the node deploy
(driver, runtime, agent, host firewall) reaches them over SSH.
"""

from collections.abc import Sequence
from typing import TypedDict

import pulumi

from denv_iac.components.naming import resolved
from denv_iac.core.placement import PlacedNode

LOOPBACK = "127.0.0.1"


class ExistingNodesArgs(TypedDict):
    nodes: Sequence[PlacedNode]  # the placed nodes of this site


class _ExistingNodes(pulumi.ComponentResource):
    node_addresses: pulumi.Output[dict[str, str]]
    """Address of each node, by node name."""

    type_token = ""

    def __init__(
        self, name: str, args: ExistingNodesArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__(self.type_token, name, None, opts)
        self.node_addresses = resolved(
            {node.name: node.address or LOOPBACK for node in args["nodes"]}
        )
        self.register_outputs({"node_addresses": self.node_addresses})


class JoinedSite(_ExistingNodes):
    """Machines joined over SSH (on-prem, any Linux host with GPUs)."""

    type_token = "denv:index:JoinedSite"


class HetznerSite(_ExistingNodes):
    """Hetzner dedicated GEX servers: ordered through Robot, joined over SSH.

    Hetzner Cloud has no GPU servers, so there is nothing to create for the GPU nodes; a
    balancer host on this site is an hcloud server made by BalancerHost.
    """

    type_token = "denv:index:HetznerSite"


class LocalSite(_ExistingNodes):
    """This machine: the local runner's simulated nodes, all on the loopback address."""

    type_token = "denv:index:LocalSite"
