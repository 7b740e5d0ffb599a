"""Reading and checking `balancer.overlay` and the nodes flagged `behind_nat`."""

import ipaddress

from denv_iac.core.stack.fields import Fields, Problems
from denv_iac.core.stack.model import (
    MADE_BALANCER_HOST_KINDS,
    OVERLAY_CIDR,
    SSH_SITE_KINDS,
    OverlaySpec,
    StackSpec,
)

# RFC 1918: an overlay range elsewhere could shadow a real address some machine must reach.
PRIVATE_RANGES = tuple(
    ipaddress.IPv4Network(c) for c in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
)
# At least a /24, and four addresses per machine that may join: hashed addresses then rarely
# collide, so adding a machine rarely moves another (see denv_iac.core.overlay_plan).
MAX_PREFIX = 24
ADDRESSES_PER_MACHINE = 4
# Every kind whose balancer host joins the overlay: a machine made for it, and a joined
# site's first node.
BALANCER_OVERLAY_KINDS = (*MADE_BALANCER_HOST_KINDS, "joined")
HOST_ADVICE = "host the balancer on an aws, hetzner or joined site"


def read_overlay(f: Fields) -> OverlaySpec:
    enabled = f.flag("enabled", True)
    cidr = f.text("cidr", OVERLAY_CIDR)
    port = f.integer("port", OverlaySpec.port, 1, 65535)
    f.finish()
    if not cidr or _network(f, cidr) is None:
        cidr = OVERLAY_CIDR  # reported; the default keeps the later checks quiet
    return OverlaySpec(enabled, cidr, port)


def _network(f: Fields, cidr: str) -> ipaddress.IPv4Network | None:
    fix = f"write a private IPv4 range like {OVERLAY_CIDR}"
    try:
        network = ipaddress.ip_network(cidr)
    except ValueError:
        f.problem("cidr", f'"{cidr}" is not a network address with a prefix; {fix}')
        return None
    if not isinstance(network, ipaddress.IPv4Network) or not any(
        network.subnet_of(r) for r in PRIVATE_RANGES
    ):
        f.problem("cidr", f'"{cidr}" is not inside 10/8, 172.16/12 or 192.168/16; {fix}')
        return None
    if network.prefixlen > MAX_PREFIX:
        f.problem("cidr", f'"{cidr}" is too small for an overlay; use a /{MAX_PREFIX} or larger')
        return None
    return network


def overlay_problems(problems: Problems, stack: StackSpec) -> None:
    """What the overlay cannot carry: NAT without it, a range too small or overlapping."""
    overlay = stack.balancer.overlay
    kinds = {s.name: s.kind for s in stack.sites}
    hubs = any(kinds.get(s) in BALANCER_OVERLAY_KINDS for s in stack.balancer.sites)
    for i, site in enumerate(stack.sites):
        for j, node in enumerate(site.nodes):
            path = f"sites[{i}].nodes[{j}].behind_nat"
            if not node.behind_nat:
                continue
            if not overlay.enabled:
                problems.add(
                    path,
                    "a node behind NAT is reached only over the overlay; remove "
                    "balancer.overlay.enabled: false",
                )
            elif not hubs:
                problems.add(
                    path,
                    "a node behind NAT is reached only over the overlay, which a balancer on "
                    f"this machine does not join; {HOST_ADVICE}",
                )
            if site.name in stack.balancer.sites and j == 0:
                problems.add(
                    path,
                    f"this node hosts the balancer of site {site.name}, which clients and nodes "
                    "must reach; list a node with a public address first",
                )
    if not overlay.enabled:
        return
    network = ipaddress.IPv4Network(overlay.cidr)  # read_overlay kept a valid one
    machines = _machines(stack)
    if hubs and machines:
        # The overlay is on, so every balancer reaches the nodes at their overlay addresses;
        # a balancer on this machine joins no overlay and would reach none of them.
        for i, site_name in enumerate(stack.balancer.sites):
            kind = kinds.get(site_name)
            if kind is not None and kind not in BALANCER_OVERLAY_KINDS:
                problems.add(
                    f"balancer.sites[{i}]",
                    f"{site_name} is a {kind} site, whose balancer does not join the overlay "
                    f"the other balancers reach the nodes through; {HOST_ADVICE}, or set "
                    "balancer.overlay.enabled: false",
                )
    room = (network.num_addresses - 2) // ADDRESSES_PER_MACHINE
    if machines > room:
        problems.add(
            "balancer.overlay.cidr",
            f"{overlay.cidr} gives {machines} machines under {ADDRESSES_PER_MACHINE} addresses "
            f"each; use a larger range such as {OVERLAY_CIDR}",
        )
    for i, site in enumerate(stack.sites):
        for cidr in site.admin_cidrs:
            if _overlaps(cidr, network):
                problems.add(
                    f"sites[{i}].admin_cidrs",
                    f"{cidr} lies inside the overlay {overlay.cidr}, so replies to it would go "
                    "into the tunnel; move balancer.overlay.cidr elsewhere",
                )
        for j, node in enumerate(site.nodes):
            if _inside(node.address, network):
                problems.add(
                    f"sites[{i}].nodes[{j}].address",
                    f"{node.address} lies inside the overlay {overlay.cidr}; move "
                    "balancer.overlay.cidr elsewhere",
                )


def _machines(stack: StackSpec) -> int:
    """The most machines that may join: every SSH site's nodes and the hosts made for it."""
    nodes = sum(len(s.nodes) + s.max_nodes for s in stack.sites if s.kind in SSH_SITE_KINDS)
    if not nodes:
        return 0
    kinds = {s.name: s.kind for s in stack.sites}
    return nodes + sum(1 for s in stack.balancer.sites if kinds.get(s) in MADE_BALANCER_HOST_KINDS)


def _overlaps(cidr: str, network: ipaddress.IPv4Network) -> bool:
    """An admin block inside the overlay: every reply to it would be routed into the tunnel.

    A wider block holding the overlay (0.0.0.0/0, 10.0.0.0/8) only loses the overlay's slice.
    """
    try:
        block = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return False  # not a CIDR block: reported as such where admin_cidrs is read
    return isinstance(block, ipaddress.IPv4Network) and block.subnet_of(network)


def _inside(address: str, network: ipaddress.IPv4Network) -> bool:
    try:
        return ipaddress.ip_address(address) in network
    except ValueError:
        return False  # a host name: where it points is not ours to know here


def overlay_warnings(stack: StackSpec) -> list[str]:
    """Traffic the stack sends between sites in plain HTTP because the overlay is turned off.

    A balancer on a local site joins no overlay either; that is a trial set-up, and `denv plan`
    says the overlay is off there without a warning.
    """
    if stack.balancer.overlay.enabled:
        return []
    kinds = {s.name: s.kind for s in stack.sites}
    remote = sorted(
        {
            site
            for recipe in stack.recipes
            for site in recipe.sites
            if site not in stack.balancer.sites and kinds.get(site) in SSH_SITE_KINDS
        }
    )
    if not remote:
        return []
    return [
        f"balancer.overlay.enabled: false sends prompts, streams and health checks to "
        f"{', '.join(remote)} unencrypted across the internet; turn the overlay back on unless "
        "these sites share one private network with the balancer"
    ]
