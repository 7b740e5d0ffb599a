"""The rules of a Hetzner box's Robot firewall, and whether they fit Robot's limits.

Pure, without Pulumi: `denv plan` and the Pulumi program count the rules with the same code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from denv_iac.core.ingress import (
    IngressRule,
    Protocol,
    ipv4_source,
    node_overlay_access,
    site_ingress_rules,
)
from denv_iac.core.stack.model import SiteSpec, StackSpec

# Robot's webservice refuses a firewall with more rules than this in one direction.
MAX_RULES = 10
EPHEMERAL_PORTS = "32768-65535"
ANY = "0.0.0.0/0"
# Replies to what the node itself opened, and ICMP (unreachable, fragmentation needed).
REPLY_RULES: tuple[dict[str, str], ...] = (
    {"name": "icmp", "ip_version": "ipv4", "protocol": "icmp", "action": "accept"},
    {
        "name": "tcp replies",
        "ip_version": "ipv4",
        "protocol": "tcp",
        "dst_port": EPHEMERAL_PORTS,
        "tcp_flags": "ack",
        "action": "accept",
    },
    {
        "name": "udp replies",
        "ip_version": "ipv4",
        "protocol": "udp",
        "dst_port": EPHEMERAL_PORTS,
        "action": "accept",
    },
)
# Since Hetzner's 2023 change the firewall filters outgoing packets too, and a firewall without
# output rules discards everything the box sends: replies to SSH and WireGuard, apt, image
# pulls, DNS, NTP; the node deploy fails and the box goes dark (community.hrobot issue #75).
# What the box sends is narrowed on the node by its nftables where it matters; on the switch
# port, one rule accepting every outgoing packet: the form of the community.hrobot firewall
# module's own example.
OUTPUT_RULES: tuple[dict[str, str], ...] = ({"name": "node traffic out", "action": "accept"},)
# The characters Robot takes in a rule name: letters, space and . - + _ @; no digits (as the
# community.hrobot firewall module documents it; its example rules were renamed to fit).
RULE_NAME = re.compile(r"[A-Za-z .+_@-]*")
# A run of other characters, with the symbols beside it (`-1-` in `fsn-1-dc`).
_NAME_UNSAFE = re.compile(r"[.+_@-]*[^A-Za-z .+_@-]+[.+_@-]*")
_NAME_LENGTH = 40
_NAME_TRIM = " .+_@-"


def rule_name(text: str) -> str:
    """A rule name Robot takes, made from `text`: each run of other characters (digits too),
    with the symbols beside it, becomes one space; then it is cut to 40 characters at a word's
    end and its ends are trimmed."""
    name = " ".join(_NAME_UNSAFE.sub(" ", text).split())
    if len(name) > _NAME_LENGTH:  # cut at a word's end
        cut = name[: _NAME_LENGTH + 1]
        name = cut.rsplit(" ", 1)[0] if " " in cut else name[:_NAME_LENGTH]
    return name.strip(_NAME_TRIM)


def rule_problems(direction: str, rules: Sequence[Mapping[str, str]]) -> list[str]:
    """One line per rule Robot would refuse for its name or count, naming the field and fix."""
    problems = [
        f"rules[{direction}][{n}][name]: {rule['name']!r} holds characters Robot refuses in a "
        "rule name; use letters, spaces and . - + _ @ only (no digits)"
        for n, rule in enumerate(rules)
        if not RULE_NAME.fullmatch(rule.get("name", ""))
    ]
    if len(rules) > MAX_RULES:
        problems.append(f"rules[{direction}]: {len(rules)} rules; Robot takes at most {MAX_RULES}")
    return problems


def robot_rules(rules: Sequence[IngressRule], addresses: Mapping[str, str]) -> list[dict[str, str]]:
    """The firewall's input rules: per source and protocol, its ports merged into ranges; then
    the replies."""
    ports: dict[tuple[str, Protocol], list[tuple[int, int]]] = {}
    names: dict[str, str] = {}
    for rule in rules:
        cidr = ipv4_source(rule, addresses)
        if cidr is None:
            continue
        ports.setdefault((cidr, rule.protocol), []).append((rule.from_port, rule.to_port))
        who = f"balancer {rule.source}" if rule.from_machine else rule.description
        names.setdefault(cidr, rule_name(who))
    out = []
    for (cidr, protocol), ranges in ports.items():
        for low, high in _merged(ranges):
            out.append(
                {
                    "name": names[cidr],
                    "ip_version": "ipv4",
                    "protocol": protocol,
                    "src_ip": cidr,
                    "dst_port": _ports(low, high),
                    "action": "accept",
                }
            )
    return [*out, *_shut_udp(ports), *REPLY_RULES]


def _shut_udp(
    ports: Mapping[tuple[str, Protocol], Sequence[tuple[int, int]]],
) -> list[dict[str, str]]:
    """Discard rules for UDP ports opened to some sources only that the reply rule would open
    to everyone (those in the ephemeral range): the first rule that matches decides."""
    first, last = (int(p) for p in EPHEMERAL_PORTS.split("-"))
    limited = [
        r for (cidr, proto), rs in ports.items() if proto == "udp" and cidr != ANY for r in rs
    ]
    return [
        {
            "name": "udp others",
            "ip_version": "ipv4",
            "protocol": "udp",
            "dst_port": _ports(low, high),
            "action": "discard",
        }
        for low, high in _merged(limited)
        if low <= last and high >= first
    ]


def _ports(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}-{high}"


def robot_problems(site_name: str, rules: Sequence[Mapping[str, str]], overlay: bool) -> list[str]:
    if len(rules) <= MAX_RULES:
        return []
    per_host = "WireGuard rule" if overlay else "port range"
    fix = "list fewer admin_cidrs or balancer sites"
    if not overlay:
        fix += " (or turn balancer.overlay back on: one rule per balancer host)"
    replies = len(REPLY_RULES) + sum(rule["action"] == "discard" for rule in rules)
    return [
        f"sites: {site_name}: the Robot firewall takes at most {MAX_RULES} input rules and "
        f"this site needs {len(rules)} ({replies} for replies, the rest one per admin CIDR and "
        f"per balancer host and {per_host}); {fix}"
    ]


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def site_robot_problems(stack: StackSpec, site: SiteSpec) -> list[str]:
    """Why a Hetzner site's Robot firewall could not be set (too many rules); [] when it can.
    Only a site with Robot credentials has one."""
    if site.kind != "hetzner" or site.robot_user is None or site.robot_password is None:
        return []
    hosts = sorted(stack.balancer.sites)
    overlay = node_overlay_access(stack, site.name)
    rows = site_ingress_rules(site, stack.recipes, tuple(hosts), overlay)
    # The count does not depend on the addresses, only on how many there are (IPv4 ones):
    # one stand-in each, distinct, as rules from one source would merge into one.
    stand_ins = {host: f"0.0.0.{n}" for n, host in enumerate(hosts, start=1)}
    return robot_problems(site.name, robot_rules(rows, stand_ins), overlay is not None)
