"""Which replica goes on which node, GPU and MIG slice: pure, deterministic, stable.

Pools are placed in declaration order. Each pool wants `min_warm + spare` replicas, at most `spare`
of them in any one failure domain (a node, or a site with `survive: site`), so losing any one
domain still leaves `min_warm`. A replica takes the first slot, in the recipe's site order, that
keeps that true: home tiers fill first, existing nodes before created ones, GPUs already
partitioned for a MIG profile before a fresh GPU is split. Appending a site, a pool, or a node
that the pool had not spilled past, and raising `min_warm`, never moves a replica; `previous`
(the last placement's replica ids) pins replicas so that no change can move one that still fits.
One MIG profile per GPU: a GPU split for `1g.10gb` holds only `1g.10gb` slices.
"""

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from denv_iac.core.stack.catalog import Catalog, load_catalog
from denv_iac.core.stack.model import RecipeSpec, SiteSpec, StackSpec
from denv_iac.core.stack.reader import StackError


@dataclass(frozen=True)
class PlacedReplica:
    id: str  # pool.site.node.gpu[.slice]
    pool: str
    site: str
    node: str
    gpu: int
    slice: int | None
    share: str
    tier: int  # 0 = the recipe's most preferred sites


@dataclass(frozen=True)
class PlacedNode:
    site: str
    name: str
    gpu: str
    gpu_count: int
    create: bool  # the site creates this machine (cloud VM, Kubernetes node)
    offering: str
    address: str
    replicas: int


@dataclass(frozen=True)
class MigLayout:
    site: str
    node: str
    gpu: int
    profile: str
    instances: int


@dataclass(frozen=True)
class Placement:
    replicas: tuple[PlacedReplica, ...]
    nodes: tuple[PlacedNode, ...]
    mig_layouts: tuple[MigLayout, ...]

    def replicas_of(self, pool: str) -> tuple[PlacedReplica, ...]:
        return tuple(r for r in self.replicas if r.pool == pool)


class PlacementError(StackError):
    """The stack is valid but its sites cannot hold its pools."""


@dataclass
class _Gpu:
    index: int
    model: str
    whole_pool: str | None = None
    mig_profile: str | None = None
    slices: list[str | None] = field(default_factory=list)  # pool per slice

    @property
    def free(self) -> bool:
        return self.whole_pool is None and self.mig_profile is None


@dataclass
class _Node:
    site: SiteSpec
    name: str
    model: str
    create: bool
    address: str
    gpus: list[_Gpu]
    used: bool = False

    def slot(self, recipe: RecipeSpec, mig_instances: int) -> tuple[_Gpu, int | None] | None:
        if recipe.gpu_models and self.model not in recipe.gpu_models:
            return None
        if not recipe.is_mig:
            gpu = next((g for g in self.gpus if g.free), None)
            return (gpu, None) if gpu else None
        for gpu in self.gpus:
            if gpu.mig_profile == recipe.share and None in gpu.slices:
                return gpu, gpu.slices.index(None)
        gpu = next((g for g in self.gpus if g.free), None)
        if gpu is None:
            return None
        gpu.mig_profile, gpu.slices = recipe.share, [None] * mig_instances
        return gpu, 0


class _Site:
    def __init__(self, spec: SiteSpec) -> None:
        self.spec = spec
        self.nodes = [
            _Node(
                spec, n.name, n.gpu, False, n.address, [_Gpu(i, n.gpu) for i in range(n.gpu_count)]
            )
            for n in spec.nodes
        ]
        self.capacity = len(self.nodes) + (spec.max_nodes if spec.creates_nodes else 0)

    def node(self, position: int) -> _Node:
        """The node at `position`, creating (on paper) the site's next machine when needed."""
        while position >= len(self.nodes):
            index = len(self.nodes) - len(self.spec.nodes)
            gpus = [_Gpu(i, self.spec.gpu) for i in range(self.spec.gpus_per_node)]
            self.nodes.append(_Node(self.spec, f"node-{index}", self.spec.gpu, True, "", gpus))
        return self.nodes[position]

    def find(self, name: str) -> _Node | None:
        for position in range(self.capacity):
            if position < len(self.nodes) and self.nodes[position].name == name:
                return self.nodes[position]
            if (
                position >= len(self.spec.nodes)
                and name == f"node-{position - len(self.spec.nodes)}"
            ):
                return self.node(position)
        return None


class _Pool:
    def __init__(self, recipe: RecipeSpec, catalog: Catalog) -> None:
        self.recipe = recipe
        self.cap = recipe.spare if recipe.spare > 0 else recipe.replicas_wanted
        self.placed: list[PlacedReplica] = []
        self.per_domain: dict[str, int] = {}
        self.tier_of = {s: t for t, tier in enumerate(recipe.tiers) for s in tier}
        self.catalog = catalog

    def domain(self, node: _Node) -> str:
        return node.site.name if self.recipe.survive == "site" else f"{node.site.name}/{node.name}"

    def instances_on(self, node: _Node) -> int:
        return self.catalog.gpus[node.model].mig_profiles.get(self.recipe.share, 0)

    def fits(self, node: _Node) -> bool:
        return self.per_domain.get(self.domain(node), 0) < self.cap

    def take(self, node: _Node, gpu: _Gpu, slice_index: int | None) -> None:
        recipe = self.recipe
        if slice_index is None:
            gpu.whole_pool = recipe.name
        else:
            gpu.slices[slice_index] = recipe.name
        node.used = True
        suffix = "" if slice_index is None else f".{slice_index}"
        self.placed.append(
            PlacedReplica(
                id=f"{recipe.name}.{node.site.name}.{node.name}.{gpu.index}{suffix}",
                pool=recipe.name,
                site=node.site.name,
                node=node.name,
                gpu=gpu.index,
                slice=slice_index,
                share=recipe.share,
                tier=self.tier_of[node.site.name],
            )
        )
        key = self.domain(node)
        self.per_domain[key] = self.per_domain.get(key, 0) + 1


def place_replicas(
    stack: StackSpec, previous: Iterable[str] = (), catalog: Catalog | None = None
) -> Placement:
    """Place every pool of a validated stack. Raises PlacementError naming each shortfall."""
    catalog = catalog or load_catalog()
    sites = {s.name: _Site(s) for s in stack.sites}
    pools = [_Pool(r, catalog) for r in stack.recipes]
    _apply_pins(pools, sites, previous)
    problems = []
    for index, pool in enumerate(pools):
        for node in _candidates(pool, sites):
            while len(pool.placed) < pool.recipe.replicas_wanted and pool.fits(node):
                slot = node.slot(pool.recipe, pool.instances_on(node))
                if slot is None:
                    break
                pool.take(node, *slot)
            if len(pool.placed) >= pool.recipe.replicas_wanted:
                break
        if len(pool.placed) < pool.recipe.replicas_wanted:
            problems.append(f"{_wanted_path(stack, index)}: {_shortfall(pool, sites)}")
    if problems:
        raise PlacementError(problems)
    return _result(pools, sites)


def _wanted_path(stack: StackSpec, index: int) -> str:
    """The field that asks for a pool's replicas: its recipe's min_warm, or for a canary's
    pool, the canary's replicas."""
    recipe = stack.recipes[index]
    if not recipe.canary_of:
        return f"recipes[{index}].min_warm"
    parent = next(i for i, r in enumerate(stack.recipes) if r.name == recipe.canary_of)
    return f"recipes[{parent}].canary.replicas"


def _candidates(pool: _Pool, sites: dict[str, _Site]) -> Iterator[_Node]:
    for site_name in pool.recipe.sites:
        site = sites[site_name]
        for position in range(site.capacity):
            node = (
                site.node(position)
                if position < len(site.nodes) or site.spec.creates_nodes
                else None
            )
            if node is None:
                break
            if pool.recipe.survive == "site" and not pool.fits(node):
                break
            yield node
            if position >= len(site.nodes) - 1 and not node.used:
                break  # an unused created node means every later one is unused too


def _apply_pins(pools: list[_Pool], sites: dict[str, _Site], previous: Iterable[str]) -> None:
    by_pool: dict[str, list[list[str]]] = {}
    for replica_id in sorted(set(previous)):
        parts = replica_id.split(".")
        if len(parts) in (4, 5):
            by_pool.setdefault(parts[0], []).append(parts)
    for pool in pools:
        recipe = pool.recipe
        for parts in by_pool.get(recipe.name, []):
            site = sites.get(parts[1])
            mig = len(parts) == 5
            if site is None or site.spec.name not in pool.tier_of or mig != recipe.is_mig:
                continue
            node = site.find(parts[2])
            if node is None or len(pool.placed) >= recipe.replicas_wanted or not pool.fits(node):
                continue
            if recipe.gpu_models and node.model not in recipe.gpu_models:
                continue
            gpu = _pinned_gpu(node, parts[3:], pool)
            if gpu is not None:
                pool.take(node, gpu, int(parts[4]) if mig else None)


def _pinned_gpu(node: _Node, indexes: list[str], pool: _Pool) -> _Gpu | None:
    if not all(i.isdigit() for i in indexes) or int(indexes[0]) >= len(node.gpus):
        return None
    gpu = node.gpus[int(indexes[0])]
    if len(indexes) == 1:
        return gpu if gpu.free else None
    instances, slice_index = pool.instances_on(node), int(indexes[1])
    if slice_index >= instances:
        return None
    if gpu.free:
        gpu.mig_profile, gpu.slices = pool.recipe.share, [None] * instances
    if gpu.mig_profile != pool.recipe.share or gpu.slices[slice_index] is not None:
        return None
    return gpu


def _shortfall(pool: _Pool, sites: dict[str, _Site]) -> str:
    recipe = pool.recipe
    want, cap, domain = recipe.replicas_wanted, pool.cap, recipe.survive
    unit = "GPUs" if not recipe.is_mig else f"{recipe.share} MIG slices"
    free: dict[str, int] = {}
    for site_name in recipe.sites:
        site = sites[site_name]
        for node in site.nodes[: site.capacity]:
            if recipe.gpu_models and node.model not in recipe.gpu_models:
                continue
            count = sum(1 for g in node.gpus if g.free) * (pool.instances_on(node) or 1)
            if recipe.is_mig:
                count += sum(
                    g.slices.count(None) for g in node.gpus if g.mig_profile == recipe.share
                )
            if count:
                key = pool.domain(node)
                free[key] = free.get(key, 0) + count
        if site.spec.creates_nodes and len(site.nodes) < site.capacity:
            free[f"{site_name} (new nodes)"] = -1  # marks room left to create machines
    total = sum(max(v, 0) for v in free.values()) + len(pool.placed)
    where = ""
    if len(free) == 1:
        where = f", all on {next(iter(free))}"
    elif free:
        where = f", on {len(free)} {domain}s"
    need = (
        f"{recipe.name} needs {want} {unit} on >= {math.ceil(want / cap)} {domain}s "
        f"(at most {cap} per {domain}) to survive a {domain} loss"
        if recipe.spare > 0
        else f"{recipe.name} needs {want} {unit}"
    )
    fix = "add capacity to its sites, list more sites, or lower min_warm"
    if recipe.canary_of:
        need = f"the canary of {recipe.canary_of} needs {want} {unit} beside its replicas"
        fix = "add capacity to its sites, list more sites, or lower canary.replicas"
    return f"{need}; its sites have {total} usable {unit}{where}; {fix}"


def _result(pools: list[_Pool], sites: dict[str, _Site]) -> Placement:
    replicas = tuple(r for pool in pools for r in pool.placed)
    counts: dict[tuple[str, str], int] = {}
    for r in replicas:
        counts[(r.site, r.node)] = counts.get((r.site, r.node), 0) + 1
    nodes: list[PlacedNode] = []
    layouts: list[MigLayout] = []
    for site in sites.values():
        for node in site.nodes:
            if node.create and not node.used:
                continue
            offering = site.spec.offering or next(
                (n.server_model for n in site.spec.nodes if n.name == node.name), ""
            )
            nodes.append(
                PlacedNode(
                    site.spec.name,
                    node.name,
                    node.model,
                    len(node.gpus),
                    node.create,
                    offering,
                    node.address,
                    counts.get((site.spec.name, node.name), 0),
                )
            )
            for gpu in node.gpus:
                if gpu.mig_profile is not None and any(gpu.slices):
                    layouts.append(
                        MigLayout(
                            site.spec.name, node.name, gpu.index, gpu.mig_profile, len(gpu.slices)
                        )
                    )
    return Placement(replicas, tuple(nodes), tuple(layouts))
