"""The rollout rule: which replicas a stack change restarts, in what order, and when it may not.

Pure: it compares the stack and its placed replicas before and after a change and decides.
A replica is restarted when what it runs changed (its recipe's image, command, env, simulated
server or model names). Each pool changes one replica at a time, never two of a pool at once,
so that the rest of the pool carries the load meanwhile; a pool whose other replicas cannot
hold `min_warm` while one is restarted refuses the plan, naming the pool and the replica.
The local runner executes the plan (denv_iac.local.rollout); see docs/components.md.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from denv_iac.core.placement import PlacedReplica, Placement
from denv_iac.core.sites import node_id
from denv_iac.core.stack.gateway_link import KUBERNETES
from denv_iac.core.stack.model import SSH_SITE_KINDS, RecipeSpec, StackSpec

# What a replica runs: a change in any of these restarts each of the pool's replicas in turn.
REPLICA_FIELDS = (
    "image",
    "command",
    "env",
    "secret_env",
    "simulate",
    "models",
    "port",
    "health_path",
    "cache_dirs",
)
# Read by the rollout itself: changing them restarts nothing.
ROLLOUT_FIELDS = ("drain_timeout_s", "cold_start_budget_s")


class RolloutRefused(ValueError):
    """The change cannot roll without breaking the rule; the message is one line."""


@dataclass(frozen=True)
class RolloutStep:
    pool: str
    replica: str
    changed: tuple[str, ...]  # the recipe fields whose change restarts it


@dataclass(frozen=True)
class RolloutPlan:
    # Each wave restarts at most one replica of each pool; waves go one after another.
    waves: tuple[tuple[RolloutStep, ...], ...] = ()
    unchanged: tuple[str, ...] = ()  # replicas left alone
    added: tuple[str, ...] = ()  # placed after the change only
    removed: tuple[str, ...] = ()  # placed before the change only

    @property
    def steps(self) -> tuple[RolloutStep, ...]:
        return tuple(step for wave in self.waves for step in wave)

    @property
    def empty(self) -> bool:
        return not (self.waves or self.added or self.removed)


def changed_fields(before: RecipeSpec, after: RecipeSpec) -> tuple[str, ...]:
    """The recipe fields whose values differ, in the order RecipeSpec declares them."""
    return tuple(
        f.name for f in fields(RecipeSpec) if getattr(before, f.name) != getattr(after, f.name)
    )


def restarting_fields(before: RecipeSpec, after: RecipeSpec) -> tuple[str, ...]:
    """The changed fields that restart the pool's replicas."""
    return tuple(name for name in changed_fields(before, after) if name in REPLICA_FIELDS)


def plan_rollout(
    before: StackSpec,
    placed_before: Sequence[PlacedReplica],
    after: StackSpec,
    placed_after: Sequence[PlacedReplica],
) -> RolloutPlan:
    """The replicas to restart, pool by pool, one of each pool per wave.

    Raises RolloutRefused when restarting a replica would leave its pool with fewer than
    `min_warm` (the larger of the old and the new value) of its other replicas serving.
    """
    old_recipes = {r.name: r for r in before.recipes}
    new_recipes = {r.name: r for r in after.recipes}
    old_ids = {r.id for r in placed_before}
    new_ids = {r.id for r in placed_after}
    kept = [r for r in placed_after if r.id in old_ids]
    queues: dict[str, list[RolloutStep]] = {}
    unchanged: list[str] = []
    for replica in kept:
        old, new = old_recipes.get(replica.pool), new_recipes[replica.pool]
        changed = restarting_fields(old, new) if old is not None else ("recipe",)
        if changed:
            queues.setdefault(replica.pool, []).append(
                RolloutStep(replica.pool, replica.id, changed)
            )
        else:
            unchanged.append(replica.id)
    for pool, queue in queues.items():
        _check_min_warm(pool, queue[0].replica, kept, old_recipes, new_recipes[pool])
    depth = max((len(queue) for queue in queues.values()), default=0)
    waves = tuple(
        tuple(queues[pool][index] for pool in new_recipes if index < len(queues.get(pool, [])))
        for index in range(depth)
    )
    return RolloutPlan(
        waves=waves,
        unchanged=tuple(unchanged),
        added=tuple(r.id for r in placed_after if r.id not in old_ids),
        removed=tuple(r.id for r in placed_before if r.id not in new_ids),
    )


def _check_min_warm(
    pool: str,
    replica: str,
    kept: Sequence[PlacedReplica],
    old_recipes: Mapping[str, RecipeSpec],
    recipe: RecipeSpec,
) -> None:
    old = old_recipes.get(pool)
    min_warm = max(recipe.min_warm, old.min_warm if old is not None else 0)
    others = [r.id for r in kept if r.pool == pool and r.id != replica]
    problem = min_warm_problem(pool, replica, others, min_warm)
    if problem:
        raise RolloutRefused(problem)


def min_warm_problem(pool: str, replica: str, ready_others: Sequence[str], min_warm: int) -> str:
    """One line when taking `replica` out of rotation leaves fewer than `min_warm` of the pool's
    other replicas ready; "" when it may go. The plan asks it of the placement, the executor
    of the balancer's view just before each drain."""
    if len(ready_others) >= min_warm:
        return ""
    return (
        f"recipes[{pool}]: restarting replica {replica} would leave {len(ready_others)} ready "
        f"replica(s), under min_warm {min_warm}; raise spare (at least 1) so that another "
        "replica carries the pool meanwhile, then roll again"
    )


@dataclass(frozen=True)
class RolloutUnit:
    """One resource whose update restarts replicas, as `pulumi up` sees it: a node's deploy
    (every pool the node hosts) or a Kubernetes site's StatefulSet of one pool."""

    name: str  # node_id(site, node), or workload_id(site, pool)
    pools: tuple[str, ...]


def workload_id(site: str, pool: str) -> str:
    """The name of a Kubernetes site's workload (StatefulSet) of one pool, as a rollout unit."""
    return f"{site}/{pool}"


def rollout_units(stack: StackSpec, placement: Placement) -> list[RolloutUnit]:
    """Every rollout unit of the stack, in the order a pool rolls through them: the stack's
    sites as listed; on a site reached over SSH, each placed node (placement order); on a
    Kubernetes site, each pool it hosts (recipe order). Other sites (local) have none."""
    units = []
    for site in stack.sites:
        here = [r for r in placement.replicas if r.site == site.name]
        if site.kind in SSH_SITE_KINDS:
            for node in placement.nodes:
                if node.site == site.name:
                    pools = {r.pool for r in here if r.node == node.name}
                    units.append(RolloutUnit(node_id(site.name, node.name), tuple(sorted(pools))))
        elif site.kind == KUBERNETES:
            units += [
                RolloutUnit(workload_id(site.name, recipe.name), (recipe.name,))
                for recipe in stack.recipes
                if any(r.pool == recipe.name for r in here)
            ]
    return units


def rollout_after(units: Sequence[RolloutUnit]) -> dict[str, tuple[str, ...]]:
    """For each unit (in `units`' order), the units whose update must end before its own
    starts: for each pool it holds, the previous unit in that order holding the pool.

    What orders `pulumi up`: the engine runs independent resources at once, so each pool's
    units form a chain, across nodes, sites and kinds, and the engine never restarts replicas
    of one pool in two places at once. A node deploy ends once its changed replicas rolled and
    rejoined; a StatefulSet's update ends once its rollout did (the Kubernetes provider awaits
    it: see denv_iac.components.kubernetes). Every link points to an earlier unit, so the
    chains never form a cycle, and units that share no pool still update side by side.
    """
    last: dict[str, str] = {}  # pool -> the last unit seen holding it
    after: dict[str, tuple[str, ...]] = {}
    order = [unit.name for unit in units]
    for unit in units:
        after[unit.name] = tuple(
            sorted({last[p] for p in unit.pools if p in last}, key=order.index)
        )
        last |= dict.fromkeys(unit.pools, unit.name)
    return after
