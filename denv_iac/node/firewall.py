"""Host firewall (nftables): SSH from the admins only, replica and agent ports from the balancers.

Each host gets tables of its own (`inet denv` on a GPU node, `inet denv-balancer` on a balancer
host; a joined machine that is both has both), so the machine's other rules are left as they
are. A table only drops what it guards: every other port is left to the machine's own rules,
and on a balancer host that is the endpoint, open to everyone.

On the overlay (a spec's `listen_address`), the balancers are their overlay addresses, admitted
on the overlay's interface only, and the WireGuard port is open to the peers' public addresses.
Replicas then run in Docker's bridge network, published on the overlay address: their
connections are forwarded to the container after Docker's DNAT, never seen by the input hook,
so the table guards them in its forward hook too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from denv_iac.core.overlay_plan import INTERFACE
from denv_iac.node.driver import service_steps
from denv_iac.node.facts import FactQuery, NodeFacts
from denv_iac.node.spec import NodeDeploySpec, NodeSpecError
from denv_iac.node.steps import (
    APT_UPDATE,
    UNIT_DIR,
    FileContent,
    Step,
    apt_install,
    text_file,
    unit_path,
    wants_link,
)

RULES = "/etc/denv/firewall.nft"
UNIT = "denv-firewall.service"
BALANCER_RULES = "/etc/denv/balancer-firewall.nft"
BALANCER_UNIT = "denv-balancer-firewall.service"
# The port the deploy reaches a balancer host's SSH on: a stack's addresses carry no port.
SSH_PORT = 22


@dataclass(frozen=True)
class Guard:
    """`ports` admit connections from `sources` (addresses or CIDRs, from the field `key`) only,
    and only through `interface` when one is named."""

    key: str
    sources: tuple[str, ...]
    ports: tuple[int, ...]
    protocol: str = "tcp"
    interface: str = ""

    @property
    def set_name(self) -> str:
        return self.key.removesuffix("_addresses").removesuffix("_cidrs")

    def admits(self, address: str) -> bool:
        client = ipaddress.ip_address(address)
        if isinstance(client, ipaddress.IPv6Address) and client.ipv4_mapped is not None:
            client = client.ipv4_mapped
        # Loopback is admitted before any guard (`iifname "lo" accept`).
        return client.is_loopback or any(
            client in ipaddress.ip_network(source, strict=False) for source in self.sources
        )


@dataclass(frozen=True)
class BalancerAccess:
    """Who administers a balancer host: SSH and HAProxy's stats port from `admin_cidrs` only;
    on the overlay (`overlay_port`, 0: not on it), who may send to its WireGuard port."""

    admin_cidrs: tuple[str, ...]
    stats_port: int
    overlay_port: int = 0
    overlay_senders: tuple[str, ...] = ()


def _balancers(spec: NodeDeploySpec, ports: tuple[int, ...]) -> Guard:
    # On the overlay a balancer's packets arrive through the tunnel, where WireGuard lets in
    # only what its peer's overlay address sent; the same address on another interface is forged.
    interface = INTERFACE if spec.listen_address else ""
    return Guard("balancer_addresses", spec.balancer_addresses, ports, interface=interface)


def node_guards(spec: NodeDeploySpec) -> list[Guard]:
    """Replica and agent ports for the balancers (none listed: nobody); on the overlay, its
    WireGuard port for the peers; SSH for the admins, when the stack lists any (none: SSH is
    left as the machine has it)."""
    ports = tuple(sorted({spec.agent_port, *(r.port for r in spec.replicas)}))
    guards = [_balancers(spec, ports)]
    if spec.listen_address:
        # The peers' public addresses, or anywhere when a peer is behind NAT (see
        # denv_iac.core.overlay_plan.wireguard_senders): WireGuard answers no packet without a
        # valid key.
        senders = (spec.overlay_port,)
        guards.append(Guard("overlay_senders", spec.overlay_senders, senders, protocol="udp"))
    if spec.admin_cidrs:
        guards.append(Guard("admin_cidrs", spec.admin_cidrs, (spec.ssh_port,)))
    return guards


def forwarded_guards(spec: NodeDeploySpec) -> list[Guard]:
    """On the overlay, the replica ports Docker forwards to containers: for the balancers only."""
    if not spec.listen_address or not spec.replicas:
        return []
    return [_balancers(spec, tuple(sorted({r.port for r in spec.replicas})))]


def balancer_guards(access: BalancerAccess) -> list[Guard]:
    guards = []
    if access.admin_cidrs:
        ports = tuple(sorted({SSH_PORT, access.stats_port}))
        guards.append(Guard("admin_cidrs", access.admin_cidrs, ports))
    if access.overlay_port:
        # As on a node (node_guards): the peers' public addresses, or anywhere behind NAT.
        port = (access.overlay_port,)
        guards.append(Guard("overlay_senders", access.overlay_senders, port, protocol="udp"))
    return guards


def ruleset(
    table: str, title: str, guards: Sequence[Guard], forwarded: Sequence[Guard] = ()
) -> str:
    """An nft script for one table: each guard's ports accept its sources and drop the rest.

    Declaring then deleting the table first makes `nft -f` replace it in one transaction, on
    the first load and on every later one alike. Replies and connections already open pass
    (`ct state established,related`): a guard changed under an open session does not cut it.
    `forwarded` guards connections a DNAT sends on to a container (`ct status dnat`), which the
    input hook never sees; every other forwarded packet is left alone.
    """
    sets: dict[str, list[str]] = {}
    input_rules: list[str] = []
    forward_rules: list[str] = []
    for guard in guards:
        input_rules += _guard_rules(guard, sets, "")
    for guard in forwarded:
        forward_rules += _guard_rules(guard, sets, "ct status dnat ")
    lines = [
        "#!/usr/sbin/nft -f",
        f"# {title}",
        f"table inet {table}",
        f"delete table inet {table}",
        f"table inet {table} {{",
        *(line for declaration in sets.values() for line in declaration),
        *_chain("input", input_rules, '\t\tiifname "lo" accept'),
    ]
    if forward_rules:
        lines += _chain("forward", forward_rules)
    return "\n".join([*lines, "}"]) + "\n"


def _chain(hook: str, rules: list[str], *first: str) -> list[str]:
    return [
        f"\tchain {hook} {{",
        f"\t\ttype filter hook {hook} priority filter - 10; policy accept;",
        *first,
        "\t\tct state established,related accept",
        *rules,
        "\t}",
    ]


def _guard_rules(guard: Guard, sets: dict[str, list[str]], prefix: str) -> list[str]:
    """The guard's accept rules then its drop; its address sets are added to `sets`."""
    networks = [ipaddress.ip_network(a, strict=False) for a in guard.sources]
    ports = ", ".join(str(p) for p in guard.ports)
    match = f"{prefix}{guard.protocol} dport {{ {ports} }}"
    where = f'iifname "{guard.interface}" ' if guard.interface else ""
    rules = []
    for family, kind, address in ((4, "ipv4_addr", "ip"), (6, "ipv6_addr", "ip6")):
        members = sorted(str(n) for n in networks if n.version == family)
        if not members:
            continue
        name = f"{guard.set_name}_v{family}"
        sets[name] = [
            f"\tset {name} {{",
            f"\t\ttype {kind}; flags interval;",
            f"\t\telements = {{ {', '.join(members)} }}",
            "\t}",
        ]
        rules.append(f"\t\t{match} {where}{address} saddr @{name} accept")
    return [*rules, f"\t\t{match} drop"]


def rules(spec: NodeDeploySpec) -> FileContent:
    title = f"denv node {spec.node_id}: replica and agent ports are for the balancers only" + (
        ", SSH for the admins only." if spec.admin_cidrs else "."
    )
    return text_file(RULES, ruleset("denv", title, node_guards(spec), forwarded_guards(spec)))


def _unit(unit: str, rules_path: str, table: str, what: str) -> FileContent:
    return text_file(
        unit_path(unit),
        f"""[Unit]
Description=denv host firewall ({what})
Wants=network-pre.target
Before=network-pre.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/sbin/nft -f {rules_path}
ExecReload=/usr/sbin/nft -f {rules_path}
ExecStop=/usr/sbin/nft delete table inet {table}

[Install]
WantedBy=multi-user.target
""",
    )


def unit() -> FileContent:
    return _unit(UNIT, RULES, "denv", "replica and agent ports, SSH")


def files(spec: NodeDeploySpec) -> list[FileContent]:
    return [rules(spec), unit()]


def lockout_problems(facts: NodeFacts, guards: Sequence[Guard]) -> list[str]:
    """The deploy's own SSH login, were the guards loaded: one line if they would shut it out.

    Refused rather than worked around (say by also admitting the deploy's address): rules that
    followed whoever deployed last would change with the machine the deploy ran from, and would
    open SSH to a CI runner's shared address. Only a live machine loads rules (`systemd`).
    """
    if not facts.systemd or not facts.ssh_client:
        return []
    for guard in guards:
        ssh = guard.protocol == "tcp" and facts.ssh_port in guard.ports
        if ssh and not guard.admits(facts.ssh_client):
            return [
                f"{guard.key}: this deploy reaches the machine from {facts.ssh_client}, which "
                f"{guard.key} does not hold, so the firewall would shut it out; add "
                f"{facts.ssh_client} (or a block holding it) to {guard.key}"
            ]
    return []


def _refuse_lockout(facts: NodeFacts, guards: Sequence[Guard]) -> None:
    problems = lockout_problems(facts, guards)
    if problems:
        raise NodeSpecError(problems)


def _converge(facts: NodeFacts, rules_file: FileContent, unit_file: FileContent) -> list[Step]:
    steps: list[Step] = []
    unit_name = unit_file.path.rsplit("/", 1)[-1]
    rules_changed = facts.files.get(rules_file.path) != rules_file.sha256
    unit_changed = facts.files.get(unit_file.path) != unit_file.sha256
    if rules_changed:
        check = (f"nft -c -f {rules_file.path}",) if facts.systemd else ()
        steps.append(Step("firewall", f"write {rules_file.path}", check, file=rules_file))
    if unit_changed:
        reload = ("systemctl daemon-reload",) if facts.systemd else ()
        steps.append(Step("firewall", f"write {unit_file.path}", reload, file=unit_file))
    if facts.systemd and unit_name in facts.active_units and rules_changed and not unit_changed:
        # Reload swaps the table in one transaction: no moment with the ports open.
        return [*steps, Step("firewall", "load the new rules", (f"systemctl reload {unit_name}",))]
    return steps + service_steps(
        facts,
        "firewall",
        unit_name,
        "firewall",
        changed=rules_changed or unit_changed,
        unit_dir=UNIT_DIR,
    )


def _removal(facts: NodeFacts, unit_name: str, rules_path: str, what: str) -> list[Step]:
    """Stop a table's unit (its ExecStop deletes the table) and remove its files; [] when
    they are gone already."""
    if rules_path not in facts.files and unit_path(unit_name) not in facts.files:
        return []
    stop = (f"systemctl disable --now {unit_name}",) if facts.systemd else ()
    remove = f"rm -f {rules_path} {unit_path(unit_name)} {wants_link(unit_name)}"
    return [Step("firewall", f"remove {what}", (*stop, remove))]


def removal_steps(facts: NodeFacts) -> list[Step]:
    """A node leaving the stack: its table goes, so SSH and ports are as the machine had them."""
    return _removal(facts, UNIT, RULES, "the node's firewall")


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    """The node's table; NodeSpecError if it would shut this deploy's own SSH login out."""
    _refuse_lockout(facts, node_guards(spec))
    rules_file, unit_file = files(spec)
    return _converge(facts, rules_file, unit_file)


def balancer_files(access: BalancerAccess) -> list[FileContent]:
    guarded = ["SSH and HAProxy's stats port for the admins only"] if access.admin_cidrs else []
    if access.overlay_port:
        guarded.append("WireGuard for the overlay's peers only")
    title = f"denv balancer host: {'; '.join(guarded)}."
    table = ruleset("denv-balancer", title, balancer_guards(access))
    unit_file = _unit(BALANCER_UNIT, BALANCER_RULES, "denv-balancer", "SSH, HAProxy stats")
    return [text_file(BALANCER_RULES, table), unit_file]


def balancer_fact_query() -> FactQuery:
    return FactQuery(
        files=(BALANCER_RULES, unit_path(BALANCER_UNIT)),
        links=(wants_link(BALANCER_UNIT),),
        units=(BALANCER_UNIT,),
    )


def plan_balancer_host(facts: NodeFacts, access: BalancerAccess) -> list[Step]:
    """A balancer host's table; none when the site lists no admin_cidrs and the host is not on
    the overlay (one left from an earlier deploy is removed, so SSH and stats are as the
    machine has them again).

    NodeSpecError if the table would shut this deploy's own SSH login out.
    """
    guards = balancer_guards(access)
    if not guards:
        return _removal(facts, BALANCER_UNIT, BALANCER_RULES, "the balancer host's firewall")
    _refuse_lockout(facts, guards)
    steps = []
    if "nftables" not in facts.packages:
        steps.append(Step("firewall", "install nftables", (APT_UPDATE, apt_install("nftables"))))
    rules_file, unit_file = balancer_files(access)
    return steps + _converge(facts, rules_file, unit_file)
