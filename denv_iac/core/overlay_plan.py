"""The WireGuard overlay between balancer hosts and nodes: members, addresses, peers, configs.

Every machine the deploy reaches over SSH joins it: the nodes of SSH sites and the balancer hosts
(a machine made for the balancer on `aws`/`hetzner`, or a `joined` site's first node). Each
balancer host peers with every node; nodes never peer with each other, since replica traffic only
ever flows between a balancer and a node. A node behind NAT has no Endpoint on the balancer's side
and dials out itself, with a keepalive that holds its NAT mapping open, so it needs no inbound
port at all.

Addresses come from a hash of the member's name, so adding or removing a machine never renumbers
another unless the newcomer's hash lands on (or probes into) an address already taken; with the
range at least four times the machines (the reader's rule), that is under one chance in four per
machine added to a full range, and far less in the default /16. Collisions are resolved by
linear probing in name order: deterministic, the same on every run.

Pure: no Pulumi, no I/O. Rendered configs name the peers' public keys and hold a placeholder for
the machine's own private key, filled in only where the file is written (see `render_config`).
"""

import base64
import binascii
import hashlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from denv_iac.core.placement import Placement
from denv_iac.core.stack.model import (
    MADE_BALANCER_HOST_KINDS,
    SSH_SITE_KINDS,
    OverlaySpec,
    StackSpec,
)

INTERFACE = "denv0"
CONFIG_PATH = f"/etc/wireguard/{INTERFACE}.conf"
# Where a rendered config holds the machine's private key until the deploy writes the file.
PRIVATE_KEY_PLACEHOLDER = "(this machine's key, filled in where the file is written)"
KEY_BYTES = 32  # a Curve25519 key
# What a node behind NAT sends to keep its mapping open: under the 30 s that the most eager NATs
# give a UDP flow, as WireGuard's own documentation advises.
NAT_KEEPALIVE_S = 25
# Every source, for a firewall rule: what a port open to peers whose address is unknown admits.
ANYWHERE = ("0.0.0.0/0", "::/0")
# The tunnel's MTU, the same on every member: 1500 less WireGuard's 80 bytes over IPv6 (60
# over IPv4). Left out, wg-quick takes the route's MTU less 80: 8921 on an AWS instance (a
# 9001 jumbo-frame link), whose packets to a peer across the internet (a 1500 path) are then
# fragmented or, where ICMP is filtered, dropped. The same on both ends of a tunnel.
MTU = 1420
HOST_SUFFIX = ":balancer"  # ':' is in no site name, so a host's name is never a node's


@dataclass(frozen=True)
class OverlayMember:
    name: str  # "site.node" for a node, "site:balancer" for a host made for the balancer
    site: str
    address: str  # on the overlay
    public_address: str  # where peers send to; "" while the machine is still to be created
    hub: bool  # a balancer host: peers with every node
    node: bool  # runs replicas (or may): peers with every balancer host
    behind_nat: bool = False
    node_name: str = ""  # the node's name in its site; "" for a host made for the balancer


@dataclass(frozen=True)
class Peer:
    name: str
    allowed_ip: str  # the peer's overlay address: the only source accepted from it
    dial: bool  # False: the peer sits behind NAT, so it dials in and has no Endpoint here
    keepalive_s: int | None  # set when this side is behind NAT and must hold its mapping


@dataclass(frozen=True)
class OverlayPlan:
    spec: OverlaySpec
    members: tuple[OverlayMember, ...]  # sorted by name; empty when off or nothing is remote

    @property
    def on(self) -> bool:
        return self.spec.enabled and bool(self.members)

    @property
    def prefix_length(self) -> int:
        return ipaddress.ip_network(self.spec.cidr).prefixlen

    def member(self, name: str) -> OverlayMember:
        return next(m for m in self.members if m.name == name)

    def peers(self, name: str) -> tuple[Peer, ...]:
        """Who `name` talks to: every node if it is a host, every host if it is a node."""
        own = self.member(name)
        found = []
        for other in self.members:
            linked = (own.hub and other.node) or (own.node and other.hub)
            if other.name == name or not linked:
                continue
            keepalive = NAT_KEEPALIVE_S if own.behind_nat else None
            found.append(Peer(other.name, other.address, not other.behind_nat, keepalive))
        return tuple(found)

    def links(self) -> tuple[tuple[str, str], ...]:
        """Each peering once, its two ends in name order."""
        pairs = {tuple(sorted((m.name, p.name))) for m in self.members for p in self.peers(m.name)}
        return tuple(sorted((a, b) for a, b in pairs))

    def address_of(self, site: str, node: str) -> str:
        """A node's overlay address, where the balancer reaches its replicas and agent."""
        return self.member(node_member(site, node)).address

    @property
    def hub_addresses(self) -> tuple[str, ...]:
        """The balancer hosts' overlay addresses: where every node's balancer traffic comes from."""
        return tuple(sorted(m.address for m in self.members if m.hub))


def node_member(site: str, node: str) -> str:
    return f"{site}.{node}"


def host_member(stack: StackSpec, site_name: str) -> str | None:
    """The overlay member that runs the balancer on a site; None when none joins the overlay."""
    site = stack.site(site_name)
    if site.kind in MADE_BALANCER_HOST_KINDS:
        return f"{site.name}{HOST_SUFFIX}"
    if site.kind == "joined" and site.nodes:
        return node_member(site.name, site.nodes[0].name)
    return None  # a local balancer is this machine, reached without SSH


def overlay_hosts(stack: StackSpec) -> dict[str, str]:
    """Balancer site -> the member that runs its balancer, for each one that joins the overlay.

    Empty when the overlay is off. Every node reached over SSH peers with each of these hosts.
    """
    if not stack.balancer.overlay.enabled:
        return {}
    hosts = {site: host_member(stack, site) for site in stack.balancer.sites}
    return {site: host for site, host in hosts.items() if host is not None}


def node_peer_sites(stack: StackSpec, site_name: str) -> tuple[str, ...]:
    """The balancer sites whose hosts reach `site_name`'s nodes through the overlay, sorted.

    Empty when those nodes join no overlay: it is off, no balancer host joins it, or the site's
    nodes are not reached over SSH. The same hosts `plan_overlay` peers every such node with,
    read from the stack alone, for the site components that build a site's firewall.
    """
    if stack.site(site_name).kind not in SSH_SITE_KINDS:
        return ()
    return tuple(sorted(overlay_hosts(stack)))


def wireguard_senders(plan: OverlayPlan, name: str) -> tuple[str, ...] | None:
    """The peers whose public addresses may send WireGuard packets to `name`, in name order.

    None when a peer sits behind NAT: its packets come from whatever address its NAT picks, so
    only a port open to any source lets them in. That reveals nothing: WireGuard answers no
    packet that lacks a valid key, so to a scan the port looks closed.
    """
    peers = plan.peers(name)
    if any(not peer.dial for peer in peers):
        return None
    return tuple(peer.name for peer in peers)


def wireguard_sources(
    plan: OverlayPlan, name: str, public_addresses: Mapping[str, str]
) -> tuple[str, ...]:
    """The source addresses a host firewall admits WireGuard packets to `name` from.

    The `wireguard_senders` peers' public addresses (`public_addresses` by member name, as for
    `render_config`); ANYWHERE when a peer is behind NAT, or known by a host name only, which
    a firewall rule cannot hold (see `wireguard_senders` on why that opens nothing).
    """
    senders = wireguard_senders(plan, name)
    if senders is None:
        return ANYWHERE
    sources = set()
    for sender in senders:
        try:
            sources.add(str(ipaddress.ip_address(public_addresses[sender])))
        except ValueError:
            return ANYWHERE
    return tuple(sorted(sources))


def allocate(cidr: str, names: list[str]) -> dict[str, str]:
    """Each name's address in `cidr`, from a hash of the name; collisions probe upwards."""
    network = ipaddress.ip_network(cidr)
    usable = network.num_addresses - 2  # neither the network's nor its broadcast address
    if len(names) > usable:
        raise ValueError(f"{cidr} holds {usable} machines, not {len(names)}")
    homes = {
        n: int.from_bytes(hashlib.sha256(n.encode()).digest()[:8], "big") % usable for n in names
    }
    taken: dict[int, str] = {}
    # Name order among equal homes, home order otherwise: the result depends on the set of
    # names only, never on the order the stack lists them in.
    for name in sorted(names, key=lambda n: (homes[n], n)):
        slot = homes[name]
        while slot in taken:
            slot = (slot + 1) % usable
        taken[slot] = name
    return {name: str(network.network_address + 1 + slot) for slot, name in taken.items()}


def plan_overlay(stack: StackSpec, placement: Placement) -> OverlayPlan:
    """The overlay of a placed stack: its members and their addresses (none when it is off)."""
    spec = stack.balancer.overlay
    if not spec.enabled:
        return OverlayPlan(spec, ())
    nat = {node_member(s.name, n.name): n.behind_nat for s in stack.sites for n in s.nodes}
    members: dict[str, tuple[str, str, bool, bool]] = {}  # name -> site, public, hub, node
    node_names: dict[str, str] = {}
    for placed in placement.nodes:
        if stack.site(placed.site).kind in SSH_SITE_KINDS:
            name = node_member(placed.site, placed.name)
            members[name] = (placed.site, placed.address, False, True)
            node_names[name] = placed.name
    for site_name, host in overlay_hosts(stack).items():
        site, public, _, node = members.get(host, (site_name, "", False, False))
        members[host] = (site, public, True, node)
    roles = [(hub, node) for _, _, hub, node in members.values()]
    if not any(hub for hub, _ in roles) or not any(node for _, node in roles):
        # No balancer host or no node reached over SSH: nothing to link (a local balancer, or
        # replicas on local and Kubernetes sites only); the stack's warnings say so.
        return OverlayPlan(spec, ())
    addresses = allocate(spec.cidr, list(members))
    return OverlayPlan(
        spec,
        tuple(
            OverlayMember(
                name,
                site,
                addresses[name],
                public,
                hub,
                node,
                nat.get(name, False),
                node_names.get(name, ""),
            )
            for name, (site, public, hub, node) in sorted(members.items())
        ),
    )


def render_config(
    plan: OverlayPlan,
    name: str,
    public_keys: Mapping[str, str],
    public_addresses: Mapping[str, str],
) -> str:
    """`name`'s /etc/wireguard/denv0.conf for wg-quick, its private key a placeholder.

    wg-quick because Debian and Ubuntu ship it with wireguard-tools and its systemd unit makes the
    deploy idempotent: `systemctl enable --now wg-quick@denv0` brings the interface up once, and
    `systemctl reload` runs `wg syncconf`, which changes only the peers that differ, so a node
    added elsewhere or a key rotated elsewhere never drops a session in flight here. syncconf
    sets the device to the file as a whole (a file without PrivateKey clears the key), so the
    key belongs in the file; `with_private_key` fills it in only where the 0600 file is written,
    and this text, an input of the deploy that previews and logs show, never holds it.
    `public_keys` and `public_addresses` map member names to values known once machines exist.
    """
    own = plan.member(name)
    lines = [
        f"# {INTERFACE} of {name}, written by the denv deploy; applied with wg syncconf",
        "[Interface]",
        f"Address = {own.address}/{plan.prefix_length}",
        f"ListenPort = {plan.spec.port}",
        f"MTU = {MTU}",
        f"PrivateKey = {PRIVATE_KEY_PLACEHOLDER}",
    ]
    for peer in plan.peers(name):
        lines += ["", "[Peer]", f"# {peer.name}", f"PublicKey = {public_keys[peer.name]}"]
        lines.append(f"AllowedIPs = {peer.allowed_ip}/32")
        if peer.dial:
            lines.append(f"Endpoint = {_endpoint(public_addresses[peer.name], plan.spec.port)}")
        if peer.keepalive_s is not None:
            lines.append(f"PersistentKeepalive = {peer.keepalive_s}")
    return "\n".join(lines) + "\n"


def with_private_key(config: str, private_key: str) -> str:
    """The config as written to the machine: the placeholder replaced by its base64 key."""
    try:
        size = len(base64.b64decode(private_key, validate=True))
    except (binascii.Error, ValueError):
        size = 0
    if size != KEY_BYTES:
        raise ValueError("the overlay's private key is not a base64 Curve25519 key")
    line = f"PrivateKey = {PRIVATE_KEY_PLACEHOLDER}"
    if config.count(line) != 1:
        raise ValueError("the overlay config has no private key placeholder")
    return config.replace(line, f"PrivateKey = {private_key}")


def _endpoint(address: str, port: int) -> str:
    try:
        literal = ipaddress.ip_address(address)
    except ValueError:
        return f"{address}:{port}"  # a host name, resolved by wg when the config is applied
    return f"[{literal}]:{port}" if literal.version == 6 else f"{literal}:{port}"
