"""The plan as tables a person reads at a glance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from denv_iac.core.dataplane import canary_tier_shares, tier_connect_timeout_ms, tier_priority
from denv_iac.core.plan import HOURS_PER_MONTH, Plan
from denv_iac.core.stack.gateway_link import gateway_tls_on, kubernetes_sites

if TYPE_CHECKING:
    # Only for annotations: the preview module imports Pulumi, which a plain `denv plan` skips.
    from denv_iac.components.preview import PreviewResource

# Inputs that tell resources apart at a glance; the rest is in `--json`.
KEY_INPUTS = (
    "instanceType",
    "serverType",
    "region",
    "location",
    "availabilityZone",
    "size",
    "deviceName",
    "ipProtocol",
    "fromPort",
    "toPort",
    "cidrIpv4",
    "cidrIpv6",
    "protocol",
    "rules",
)


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
        min_warm = str(recipe.min_warm)
        parent = next((r for r in stack.pools if r.name == recipe.canary_of), None)
        if parent is not None and parent.canary is not None:
            min_warm = "-"
            shares = canary_tier_shares(stack, plan.placement, parent.name)
            weighed = " / ".join(f"{100 * share:.1f} %" for share in shares)
            survives = (
                f"canary of {parent.name}: {100 * parent.canary.share:g} % of new sessions"
                f" (by weight, per tier: {weighed})"
            )
        pools.add_row(recipe.name, str(len(placed)), min_warm, survives, tiers)
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
    render_overlay(plan, console)
    render_gateway_link(plan, console)
    render_timers(plan, console)
    hourly = plan.usd_per_hour
    read = sorted({c.price_read for c in plan.costs if c.price_read})
    basis = f" (list prices read {', '.join(read)})" if read else ""
    console.print(
        f"Warm capacity: ${hourly:,.2f}/hour, ${hourly * HOURS_PER_MONTH:,.0f}/month{basis}"
    )
    for price in plan.price_basis():
        console.print(
            f"  {price.offering}: ${price.usd_per_gpu_hour:,.2f}/GPU-hour, read {price.read}, "
            f"source: {escape(price.source)}",
            soft_wrap=True,
        )


def render_timers(plan: Plan, console: Console) -> None:
    """How fast the balancer gives up on a replica, and what that costs when one dies: the
    stack's timers, and each tier's own connect timeout where its sites' round trip is known."""
    timers = plan.stack.balancer.timers
    console.print(
        f"Balancer timers: connect {timers.connect_timeout_ms} ms, health check"
        f" {timers.check_timeout_ms} ms every {timers.check_inter_ms} ms, agent every"
        f" {timers.agent_inter_ms} ms; a replica that has just died costs the next request up"
        f" to its tier's connect timeout"
    )
    for recipe in plan.stack.pools:
        for index, sites in enumerate(recipe.tiers):
            connect = tier_connect_timeout_ms(plan.stack, sites)
            if connect is None:
                how = f"{timers.connect_timeout_ms} ms (round trip unknown: set round_trip_ms)"
            else:
                farthest = max(plan.stack.site(s).round_trip_ms or 0.0 for s in sites)
                how = f"{connect} ms (round trip {farthest:g} ms)"
            console.print(
                f"  {recipe.name} tier {tier_priority(index)} ({', '.join(sites)}): connect {how}"
            )


def render_gateway_link(plan: Plan, console: Console) -> None:
    """How the balancer reaches each Kubernetes site's gateway; nothing when there is none."""
    sites = ", ".join(kubernetes_sites(plan.stack))
    if not sites:
        return
    if gateway_tls_on(plan.stack):
        console.print(
            f"Kubernetes link: mutual TLS to the gateway of {sites} (TLS 1.3, the stack's own "
            "CA, a client certificate required; agent checks relayed over the same TLS)"
        )
        return
    console.print(
        f"[yellow]warning:[/yellow] Kubernetes link: plain TCP to the gateway of {sites} "
        "(balancer.overlay.enabled: false); prompts, streams and agent checks cross unencrypted"
    )


def render_overlay(plan: Plan, console: Console) -> None:
    """Whether traffic between the balancer and the nodes is encrypted, and how."""
    overlay = plan.overlay
    if not overlay.on:
        why = (
            "balancer.overlay.enabled: false; traffic to nodes is plain HTTP"
            if not overlay.spec.enabled
            else "no balancer host and node reached over SSH to link; a balancer on a local site "
            "joins none"
        )
        console.print(f"Overlay: off ({why})")
        return
    spec = overlay.spec
    # On: `pulumi up` brings each machine's interface up in its deploy, and the balancer reaches
    # every node at its overlay address.
    console.print(
        f"Overlay: on, WireGuard {spec.cidr} on udp/{spec.port}, "
        f"{len(overlay.members)} machines, {len(overlay.links())} links; the balancer reaches "
        "these nodes through it"
    )
    table = Table(title="Overlay", title_justify="left")
    for column in ("machine", "address", "role", "reached"):
        table.add_column(column)
    for member in overlay.members:
        role = "+".join(r for r, on in (("balancer", member.hub), ("node", member.node)) if on)
        reached = (
            "dials out (behind NAT)"
            if member.behind_nat
            else member.public_address or "once created"
        )
        table.add_row(member.name, member.address, role, reached)
    console.print(table)


def _brief(value: Any) -> str:
    # Integers reach the engine as floats (22.0); show them as the stack wrote them.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "[" + ", ".join(_rule(v) for v in value) + "]"
    return str(value)


def _rule(rule: dict[str, Any]) -> str:
    """A firewall rule at a glance, whichever provider's shape (Lambda, Robot, hcloud):
    protocol/ports from its sources; a Robot discard rule reads "deny"."""
    low_high = rule.get("port_range")
    ports = rule.get("port") or rule.get("dst_port") or ""
    if isinstance(low_high, list) and len(low_high) == 2:
        low, high = (_brief(p) for p in low_high)
        ports = low if low == high else f"{low}-{high}"
    sources = rule.get("sourceIps") or [rule.get("source_network") or rule.get("src_ip") or "any"]
    deny = "deny " if rule.get("action") == "discard" else ""
    where = f"/{ports}" if ports else ""
    return f"{deny}{rule.get('protocol', '?')}{where} from {' '.join(map(str, sources))}"


def key_inputs(resource: PreviewResource) -> str:
    """The few inputs worth a glance, and every masked secret (so its presence shows)."""
    inputs = resource.inputs
    keys = [k for k in KEY_INPUTS if k in inputs]
    keys += [k for k, v in inputs.items() if v == "[secret]" and k not in keys]
    return " ".join(f"{k}={_brief(inputs[k])}" for k in keys)


def render_resources(resources: list[PreviewResource], console: Console) -> None:
    """The resource tree under the stack, each resource under its parent."""
    root = Tree(f"Resources ({len(resources)}, preview under mocks)")
    branches: dict[str, Tree] = {"": root}
    # Parents register before their children, so one pass in registration order builds it.
    for r in resources:
        label = f"[bold]{escape(r.name)}[/] {escape(r.type)}"
        brief = key_inputs(r)
        if brief:
            label += f"  [dim]{escape(brief)}[/]"
        branches[r.name] = branches.get(r.parent, root).add(label)
    console.print(root)
