"""Host firewall (nftables): replica and agent ports admit the balancers' addresses only."""

from __future__ import annotations

import ipaddress

from denv_iac.node.driver import service_steps
from denv_iac.node.facts import NodeFacts
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import UNIT_DIR, FileContent, Step, text_file, unit_path

RULES = "/etc/denv/firewall.nft"
UNIT = "denv-firewall.service"


def rules(spec: NodeDeploySpec) -> FileContent:
    """An nft script in its own table, so the node's other rules are left as they are.

    Declaring then deleting the table first makes `nft -f` replace it in one transaction, on
    the first load and on every later one alike.
    """
    networks = [ipaddress.ip_network(a, strict=False) for a in spec.balancer_addresses]
    v4 = sorted(str(n) for n in networks if n.version == 4)
    v6 = sorted(str(n) for n in networks if n.version == 6)
    ports = ", ".join(str(p) for p in sorted({spec.agent_port, *(r.port for r in spec.replicas)}))
    lines = [
        "#!/usr/sbin/nft -f",
        f"# denv node {spec.node_id}: replica and agent ports are for the balancers only.",
        "table inet denv",
        "delete table inet denv",
        "table inet denv {",
    ]
    for name, kind, members in (
        ("balancers_v4", "ipv4_addr", v4),
        ("balancers_v6", "ipv6_addr", v6),
    ):
        if members:
            lines += [
                f"\tset {name} {{",
                f"\t\ttype {kind}; flags interval;",
                f"\t\telements = {{ {', '.join(members)} }}",
                "\t}",
            ]
    lines += [
        "\tchain input {",
        "\t\ttype filter hook input priority filter - 10; policy accept;",
        '\t\tiifname "lo" accept',
    ]
    if v4:
        lines.append(f"\t\ttcp dport {{ {ports} }} ip saddr @balancers_v4 accept")
    if v6:
        lines.append(f"\t\ttcp dport {{ {ports} }} ip6 saddr @balancers_v6 accept")
    lines += [f"\t\ttcp dport {{ {ports} }} drop", "\t}", "}"]
    return text_file(RULES, "\n".join(lines) + "\n")


def unit() -> FileContent:
    return text_file(
        unit_path(UNIT),
        f"""[Unit]
Description=denv host firewall (replica and agent ports)
Wants=network-pre.target
Before=network-pre.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/sbin/nft -f {RULES}
ExecReload=/usr/sbin/nft -f {RULES}
ExecStop=/usr/sbin/nft delete table inet denv

[Install]
WantedBy=multi-user.target
""",
    )


def files(spec: NodeDeploySpec) -> list[FileContent]:
    return [rules(spec), unit()]


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    steps: list[Step] = []
    rules_file, unit_file = files(spec)
    rules_changed = facts.files.get(rules_file.path) != rules_file.sha256
    unit_changed = facts.files.get(unit_file.path) != unit_file.sha256
    if rules_changed:
        check = (f"nft -c -f {RULES}",) if facts.systemd else ()
        steps.append(Step("firewall", f"write {RULES}", check, file=rules_file))
    if unit_changed:
        reload = ("systemctl daemon-reload",) if facts.systemd else ()
        steps.append(Step("firewall", f"write {unit_file.path}", reload, file=unit_file))
    if facts.systemd and UNIT in facts.active_units and rules_changed and not unit_changed:
        # Reload swaps the table in one transaction: no moment with the ports open.
        return [*steps, Step("firewall", "load the new rules", (f"systemctl reload {UNIT}",))]
    return steps + service_steps(
        facts,
        "firewall",
        UNIT,
        "firewall",
        changed=rules_changed or unit_changed,
        unit_dir=UNIT_DIR,
    )
