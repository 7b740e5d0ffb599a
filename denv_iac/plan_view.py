"""The plan as tables a person reads at a glance."""

from rich.console import Console
from rich.table import Table

from denv_iac.plan import HOURS_PER_MONTH, Plan


def render_plan(plan: Plan, console: Console) -> None:
    stack = plan.stack
    replicas = Table(title=f"Replicas of stack {stack.name}", title_justify="left")
    for column in ("pool", "replica", "site", "tier", "node", "gpu", "share"):
        replicas.add_column(column)
    for r in plan.placement.replicas:
        gpu = str(r.gpu) if r.slice is None else f"{r.gpu} slice {r.slice}"
        replicas.add_row(r.pool, r.id, r.site, str(r.tier + 1), r.node, gpu, r.share)
    console.print(replicas)

    pools = Table(title="Pools", title_justify="left")
    for column in ("pool", "replicas", "min_warm", "survives", "sites by tier"):
        pools.add_column(column)
    for recipe in stack.recipes:
        placed = plan.placement.replicas_of(recipe.name)
        tiers = " > ".join("+".join(tier) for tier in recipe.tiers)
        survives = f"any one {recipe.survive}" if recipe.spare else "nothing (spare: 0)"
        pools.add_row(recipe.name, str(len(placed)), str(recipe.min_warm), survives, tiers)
    console.print(pools)

    nodes = Table(title="Nodes", title_justify="left")
    for column in ("site", "node", "machine", "gpus", "replicas", "action", "$/hour"):
        nodes.add_column(column, justify="right" if column == "$/hour" else "left")
    for cost in plan.costs:
        n = cost.node
        machine = n.offering or "declared"
        action = "create" if n.create else "set up"
        nodes.add_row(
            n.site,
            n.name,
            machine,
            f"{n.gpu_count}x {n.gpu}",
            str(n.replicas),
            action,
            f"{cost.usd_per_hour:,.2f}",
        )
    console.print(nodes)
    if plan.placement.mig_layouts:
        layouts = ", ".join(
            f"{m.site}/{m.node} gpu {m.gpu}: {m.instances}x {m.profile}"
            for m in plan.placement.mig_layouts
        )
        console.print(f"MIG layout: {layouts}")
    hourly = plan.usd_per_hour
    read = sorted({c.price_read for c in plan.costs if c.price_read})
    basis = f" (list prices read {', '.join(read)})" if read else ""
    console.print(
        f"Warm capacity: ${hourly:,.2f}/hour, ${hourly * HOURS_PER_MONTH:,.0f}/month{basis}"
    )
