"""The offline plan: a stack's placement, the nodes it needs and what its warm capacity costs."""

from dataclasses import asdict, dataclass
from typing import Any

from denv_iac.core.balancer.api_surface import models_list_problem
from denv_iac.core.kube_manifests.site import resource_name_problems, site_problems
from denv_iac.core.overlay_plan import OverlayPlan, plan_overlay
from denv_iac.core.placement import PlacedNode, Placement, place_replicas
from denv_iac.core.robot_firewall import site_robot_problems
from denv_iac.core.stack.catalog import Catalog, load_catalog
from denv_iac.core.stack.model import SSH_SITE_KINDS, SiteSpec, StackSpec
from denv_iac.core.stack.ports import placed_port_problems
from denv_iac.core.stack.reader import StackError

HOURS_PER_MONTH = 730


@dataclass(frozen=True)
class NodeCost:
    node: PlacedNode
    usd_per_gpu_hour: float
    price_read: str  # "" when the price is the site's own override or unknown
    price_source: str  # where the catalog's list price was read; "" as price_read

    @property
    def usd_per_hour(self) -> float:
        return self.usd_per_gpu_hour * self.node.gpu_count


@dataclass(frozen=True)
class PriceBasis:
    """One catalog list price a plan's cost rests on: what it prices, when and where it was read."""

    offering: str
    usd_per_gpu_hour: float
    read: str
    source: str


@dataclass(frozen=True)
class Plan:
    stack: StackSpec
    placement: Placement
    costs: tuple[NodeCost, ...]
    overlay: OverlayPlan

    @property
    def usd_per_hour(self) -> float:
        return sum(c.usd_per_hour for c in self.costs)

    def price_basis(self) -> list[PriceBasis]:
        """Each distinct catalog list price the cost uses, so a reader can judge how fresh it is."""
        found = {
            PriceBasis(c.node.offering, c.usd_per_gpu_hour, c.price_read, c.price_source)
            for c in self.costs
            if c.price_read
        }
        return sorted(found, key=lambda b: (b.offering, b.read))

    def to_json(self) -> dict[str, Any]:
        by_site: dict[str, float] = {}
        for cost in self.costs:
            by_site[cost.node.site] = round(by_site.get(cost.node.site, 0.0) + cost.usd_per_hour, 2)
        return {
            "stack": self.stack.name,
            "replicas": [
                {
                    "id": r.id,
                    "pool": r.pool,
                    "site": r.site,
                    "node": r.node,
                    "gpu": r.gpu,
                    "slice": r.slice,
                    "share": r.share,
                    "tier": r.tier,
                }
                for r in self.placement.replicas
            ],
            "nodes": [
                {**asdict(c.node), "usd_per_hour": round(c.usd_per_hour, 2)} for c in self.costs
            ],
            "mig_layouts": [asdict(m) for m in self.placement.mig_layouts],
            "overlay": {
                "on": self.overlay.on,
                "cidr": self.overlay.spec.cidr,
                "port": self.overlay.spec.port,
                "members": [asdict(m) for m in self.overlay.members],
                "links": [list(link) for link in self.overlay.links()],
            },
            "cost": {
                "usd_per_hour": round(self.usd_per_hour, 2),
                "usd_per_month": round(self.usd_per_hour * HOURS_PER_MONTH, 2),
                "by_site_usd_per_hour": by_site,
                "prices_read": sorted({c.price_read for c in self.costs if c.price_read}),
                "list_prices": [asdict(b) for b in self.price_basis()],
            },
        }


def node_price(site: SiteSpec, node: PlacedNode, catalog: Catalog) -> tuple[float, str, str]:
    """The node's price per GPU-hour, the date its list price was read and where ("" for both
    when the price is the site's own)."""
    if site.price_per_gpu_hour is not None:
        return site.price_per_gpu_hour, "", ""
    offering = catalog.offering(site.kind, node.offering) if node.offering else None
    if offering is None:
        return 0.0, "", ""  # local, joined and Kubernetes capacity has no list price of ours
    return offering.usd_per_gpu_hour, offering.price_read, offering.source


def deploy_problems(stack: StackSpec, placement: Placement) -> list[str]:
    """What the sites cannot run as placed. `denv plan` and Cluster both refuse a stack on these,
    so a plan that succeeds is one `pulumi up` accepts."""
    problems = placed_port_problems(stack, placement.replicas)
    problems += imageless_problems(stack, placement)
    models = models_list_problem(n for r in stack.pools for n in (r.name, *r.model_names))
    problems += [models] if models is not None else []
    for site in stack.sites:
        if site.kind == "kubernetes":
            problems += site_problems(site, stack.recipes)
        problems += site_robot_problems(stack, site)
    if not problems:  # names are those of objects the sites can make
        problems += resource_name_problems(stack, placement.replicas)
    return problems


def imageless_problems(stack: StackSpec, placement: Placement) -> list[str]:
    """Replicas on machines reached over SSH run in containers: their recipe needs an image."""
    found: dict[str, set[str]] = {}
    for recipe in stack.recipes:
        for replica in placement.replicas_of(recipe.name):
            if not recipe.image and stack.site(replica.site).kind in SSH_SITE_KINDS:
                found.setdefault(recipe.name, set()).add(replica.site)
    return [
        f"recipes: {name}: give an image; its replicas run in containers on "
        f"{', '.join(sorted(sites))}, reached over SSH"
        for name, sites in found.items()
    ]


def make_plan(stack: StackSpec, previous: list[str] | None = None) -> Plan:
    """The stack placed and priced; StackError with every problem the sites would have."""
    catalog = load_catalog()
    placement = place_replicas(stack, previous or (), catalog)
    problems = deploy_problems(stack, placement)
    if problems:
        raise StackError(problems)
    costs = []
    for node in placement.nodes:
        if node.replicas == 0 and not node.create:
            continue  # an idle joined machine is not warm capacity of this stack
        costs.append(NodeCost(node, *node_price(stack.site(node.site), node, catalog)))
    return Plan(stack, placement, tuple(costs), plan_overlay(stack, placement))
