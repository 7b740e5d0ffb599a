"""The port plan of a node: which ports replicas, the agent, the balancer and SSH take.

Checked on the stack alone (before placement) and on the placed replicas, so that `denv plan`
and `pulumi up` refuse the same collisions.
"""

from collections.abc import Iterable
from typing import Protocol

from denv_iac.core.stack.fields import Problems
from denv_iac.core.stack.model import RecipeSpec, SiteSpec, StackSpec

SSH_PORT = 22
AGENT_PORT = 9100  # the node deploy's agent-check port (NodeDeploySpec.agent_port)
AGENT_PORTS = (AGENT_PORT, AGENT_PORT + 1)  # agent-check, and the agent's local HTTP port
MAX_GPUS_PER_NODE = 16  # the most a node spec may declare
# A GPU holds at most 7 MIG instances, so 8 ports per GPU give every replica its own port.
PORTS_PER_GPU = 8
MAX_PORT = 65535
# Kinds whose balancer runs on one of the site's own machines, beside its replicas.
SHARED_HOST_KINDS = ("local", "joined")


class Slot(Protocol):
    """Where a replica sits on its node: GPU index and MIG slice (None for a whole GPU)."""

    @property
    def gpu(self) -> int: ...

    @property
    def slice(self) -> int | None: ...


class Placed(Slot, Protocol):
    """A placed replica, as the port plan of its node needs it."""

    @property
    def id(self) -> str: ...

    @property
    def pool(self) -> str: ...

    @property
    def site(self) -> str: ...

    @property
    def node(self) -> str: ...


def replica_port(recipe: RecipeSpec, replica: Slot) -> int:
    """A replica's port on its node: fixed by its GPU and slice, so it never moves."""
    return recipe.port + replica.gpu * PORTS_PER_GPU + (replica.slice or 0)


def placed_port_problems(stack: StackSpec, replicas: Iterable[Placed]) -> list[str]:
    """Two replicas on one node, or a replica and the agent, must never share a port."""
    taken: dict[tuple[str, str, int], str] = {}
    problems = []
    apart = PORTS_PER_GPU * MAX_GPUS_PER_NODE
    recipes = {recipe.name: recipe for recipe in stack.recipes}
    for replica in replicas:
        port = replica_port(recipes[replica.pool], replica)
        where = (replica.site, replica.node, port)
        if port in AGENT_PORTS or where in taken:
            other = taken.get(where, "the node agent")
            problems.append(
                f"recipes: {replica.pool}: replica {replica.id} would take port {port}, used by "
                f"{other}; give the recipes ports at least {apart} apart"
            )
        taken[where] = replica.id
    return problems


def recipe_port_range(recipe: RecipeSpec, gpus_per_node: int) -> tuple[int, int]:
    """Every port the recipe's replicas can take on a node with that many GPUs."""
    return recipe.port, recipe.port + max(gpus_per_node, 1) * PORTS_PER_GPU - 1


def site_gpus_per_node(site: SiteSpec) -> int:
    return max([site.gpus_per_node, *(node.gpu_count for node in site.nodes)])


def reserved_ports(stack: StackSpec, site: SiteSpec) -> dict[int, str]:
    """Ports a replica may never take on the site's nodes, each with what holds it."""
    reserved = {SSH_PORT: "SSH", AGENT_PORT: "the node agent", AGENT_PORT + 1: "the node agent"}
    if site.kind in SHARED_HOST_KINDS and site.name in stack.balancer.sites:
        reserved[stack.balancer.port] = "the balancer's endpoint"
        reserved[stack.balancer.prometheus_port] = "the balancer's metrics"
    return reserved


def stack_port_problems(problems: Problems, stack: StackSpec) -> None:
    """Collisions visible before placement: the balancer's own ports, each recipe's range."""
    balancer = stack.balancer
    for key, port in (("port", balancer.port), ("prometheus_port", balancer.prometheus_port)):
        if port == SSH_PORT:
            problems.add(
                f"balancer.{key}",
                "22 is SSH's port, and the balancer opens its ports to the internet; "
                "use another, e.g. 8080",
            )
        elif port in AGENT_PORTS:
            problems.add(
                f"balancer.{key}", f"{port} is the node agent's port; use another, e.g. 8080"
            )
    sites = {site.name: site for site in stack.sites}
    for index, recipe in enumerate(stack.recipes):
        where = [sites[s] for s in recipe.sites if s in sites]
        _recipe_port_problems(problems, stack, f"recipes[{index}].port", recipe, where)


def _recipe_port_problems(
    problems: Problems, stack: StackSpec, path: str, recipe: RecipeSpec, sites: Iterable[SiteSpec]
) -> None:
    for site in sites:
        gpus = site_gpus_per_node(site)
        low, high = recipe_port_range(recipe, gpus)
        if high > MAX_PORT:
            problems.add(
                path,
                f"{recipe.port} leaves no room for the replicas on site {site.name}: "
                f"{gpus} GPUs per node take ports up to {high}; use a port of at most "
                f"{MAX_PORT - (high - low)}",
            )
            continue
        for port, holder in sorted(reserved_ports(stack, site).items()):
            if low <= port <= high:
                problems.add(
                    path,
                    f"replicas on site {site.name} take ports {low}-{high}, which includes "
                    f"{port} ({holder}); move the recipe's port clear of it",
                )
