"""From placed replicas to what the balancer serves: pools, tiers and servers."""

from collections.abc import Callable

from denv_iac.core.balancer import BalancerPool, BalancerServer, BalancerTier
from denv_iac.core.balancer.canary import canary_weights
from denv_iac.core.balancer.model import connect_timeout_for
from denv_iac.core.placement import PlacedReplica, Placement
from denv_iac.core.stack.gateway_link import gateway_tls_name, gateway_tls_on, kubernetes_sites
from denv_iac.core.stack.model import RecipeSpec, StackSpec

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
    A recipe's canary serves in the recipe's tiers, weighted to take its share of new sessions.
    """
    behind_tls = set(kubernetes_sites(stack)) if gateway_tls_on(stack) else set()

    def server(replica: PlacedReplica, recipe: RecipeSpec, weight: int) -> BalancerServer:
        address, port, agent_port = locate(replica)
        return BalancerServer(
            replica.id,
            replica.site,
            replica.node,
            address,
            port,
            agent_port,
            recipe.health_path,
            gateway_tls_name(replica.site) if replica.site in behind_tls else None,
            weight,
            canary=bool(recipe.canary_of),
        )

    pools = []
    for recipe in stack.pools:
        canary = stack.canary_pool(recipe.name)
        share = recipe.canary.share if recipe.canary is not None else 0.0
        tiers = []
        for index, sites in enumerate(recipe.tiers):
            stable, new = _tier_versions(stack, placement, recipe.name, index)
            weights = canary_weights(len(stable), len(new), share)
            servers = [server(r, recipe, weights.stable) for r in stable]
            if canary is not None:
                servers += [server(r, canary, weights.canary) for r in new]
            if servers:
                connect = tier_connect_timeout_ms(stack, sites)
                tiers.append(BalancerTier(tier_priority(index), sites, tuple(servers), connect))
        pools.append(
            BalancerPool(
                recipe.name,
                tuple(tiers),
                recipe.session_affinity,
                recipe.first_token_timeout_ms,
                recipe.stall_timeout_ms,
                tuple(m for m in recipe.model_names if m != recipe.name),
                recipe.max_concurrency,
                recipe.queue_budget_ms,
            )
        )
    return tuple(pools)


def _tier_versions(
    stack: StackSpec, placement: Placement, pool: str, tier: int
) -> tuple[list[PlacedReplica], list[PlacedReplica]]:
    """A tier's replicas of the recipe's version and of its canary's."""
    canary = stack.canary_pool(pool)
    new = () if canary is None else placement.replicas_of(canary.name)
    return (
        [r for r in placement.replicas_of(pool) if r.tier == tier],
        [r for r in new if r.tier == tier],
    )


def tier_connect_timeout_ms(stack: StackSpec, sites: tuple[str, ...]) -> int | None:
    """A tier's connect timeout from the round trip to its farthest site; None (the stack's
    timers.connect_timeout_ms) when one of its sites has no round trip stated."""
    trips = [stack.site(name).round_trip_ms for name in sites]
    known = [trip for trip in trips if trip is not None]
    if len(known) < len(trips):
        return None
    return connect_timeout_for(max(known))


def canary_tier_shares(stack: StackSpec, placement: Placement, pool: str) -> tuple[float, ...]:
    """The share of new sessions a recipe's canary takes, by the weights the balancer gets, in
    each tier of the recipe that holds a replica of either version: what `denv plan` shows
    beside the stack's share (rounding, or a tier without the canary, set it apart)."""
    recipe = next(r for r in stack.pools if r.name == pool)
    share = recipe.canary.share if recipe.canary is not None else 0.0
    shares = []
    for index in range(len(recipe.tiers)):
        stable, new = _tier_versions(stack, placement, pool, index)
        if stable or new:
            shares.append(canary_weights(len(stable), len(new), share).share(len(stable), len(new)))
    return tuple(shares)
