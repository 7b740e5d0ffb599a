"""WarmPool: a recipe's placed replicas with the addresses they answer on."""

from collections.abc import Sequence
from typing import Any, TypedDict, cast

import pulumi


class ReplicaEndpoint(TypedDict):
    id: str  # pool.site.node.gpu[.slice]
    site: str
    node: str
    tier: int  # 0 = the recipe's most preferred sites
    address: str
    port: int
    agent_port: int


class ReplicaEndpointArgs(TypedDict):
    id: str
    site: str
    node: str
    tier: int
    address: pulumi.Input[str]  # known once the node exists
    port: int
    agent_port: int


class WarmPoolArgs(TypedDict):
    recipe: str
    replicas: Sequence[ReplicaEndpointArgs]


class WarmPool(pulumi.ComponentResource):
    """`min_warm` replicas always loaded plus `spare`, as placed; creates nothing itself."""

    replicas: pulumi.Output[list[ReplicaEndpoint]]
    """Every replica of the pool: id, address, port, agent port, site and tier."""

    def __init__(
        self, name: str, args: WarmPoolArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("denv:index:WarmPool", name, None, opts)
        # from_input resolves the address Outputs nested in the list of mappings.
        endpoints: Any = [dict(replica) for replica in args["replicas"]]
        self.replicas = cast(
            pulumi.Output[list[ReplicaEndpoint]], pulumi.Output.from_input(endpoints)
        )
        self.register_outputs({"replicas": self.replicas})
