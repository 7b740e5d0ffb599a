"""From placed replicas to what the balancer serves: pools, tiers and servers."""

from collections.abc import Callable

from denv_iac.core.balancer import BalancerPool, BalancerServer, BalancerTier
from denv_iac.core.placement import PlacedReplica, Placement
from denv_iac.core.stack.gateway_link import gateway_tls_name, gateway_tls_on, kubernetes_sites
from denv_iac.core.stack.model import StackSpec

# Where a replica answers once it runs: (address, replica port, agent port).
Locator = Callable[[PlacedReplica], tuple[str, int, int]]


def tier_priority(index: int) -> int:
    """The balancer priority of a recipe's tier by its preference index: 10, 20, ..."""
    return (index + 1) * 10


def balancer_pools(
    stack: StackSpec, placement: Placement, locate: Locator
) -> tuple[BalancerPool, ...]:
    """One pool per recipe, one tier per preference level of its sites (priority 10, 20, ...).

    A tier with no placed replica is left out: HAProxy then falls through straight to the next.
    """
    behind_tls = set(kubernetes_sites(stack)) if gateway_tls_on(stack) else set()
    pools = []
    for recipe in stack.recipes:
        replicas = placement.replicas_of(recipe.name)
        tiers = []
        for index, sites in enumerate(recipe.tiers):
            servers = []
            for replica in replicas:
                if replica.tier != index:
                    continue
                address, port, agent_port = locate(replica)
                servers.append(
                    BalancerServer(
                        replica.id,
                        replica.site,
                        replica.node,
                        address,
                        port,
                        agent_port,
                        recipe.health_path,
                        gateway_tls_name(replica.site) if replica.site in behind_tls else None,
                    )
                )
            if servers:
                tiers.append(BalancerTier(tier_priority(index), sites, tuple(servers)))
        pools.append(
            BalancerPool(
                recipe.name,
                tuple(tiers),
                recipe.session_affinity,
                recipe.first_token_timeout_ms,
                recipe.stall_timeout_ms,
                tuple(m for m in recipe.model_names if m != recipe.name),
                recipe.max_concurrency,
            )
        )
    return tuple(pools)
