"""Hetzner Robot's firewall on a VM's switch port, as stateless nftables rules in the bed.

Robot filters each dedicated server's switch port, packet by packet, without connection
tracking: input rules for what reaches the server, output rules for what it sends, each list
applied in order, the first rule that matches deciding and anything unmatched discarded. Here
the VM's tap device is its switch port: a bridge table in the bed's namespace sends every IPv4
frame leaving the tap (the VM's output) through the output rules and every one entering it
(the VM's input) through the input rules. Other frames (ARP, IPv6) pass, as on a firewall with
`filter_ipv6` off. The rules are Robot's own JSON fields, as the product sends them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from tests.vm.bed import Bed, Vm

TABLE = "denv_robot"
_ACTIONS = {"accept": "accept", "discard": "drop"}
_FLAGS = re.compile(r"[a-z]+")


def nft_rule(rule: Mapping[str, str]) -> str:
    """One Robot rule as an nftables rule (stateless: no `ct` anywhere)."""
    protocol = rule.get("protocol")
    parts = [f"ip protocol {protocol}"] if protocol else []
    for field, word in (("src_ip", "saddr"), ("dst_ip", "daddr")):
        if field in rule:
            parts.append(f"ip {word} {rule[field]}")
    for field, word in (("src_port", "sport"), ("dst_port", "dport")):
        if field in rule:
            assert protocol in ("tcp", "udp"), rule
            parts.append(f"{protocol} {word} {rule[field]}")
    flags = rule.get("tcp_flags")
    if flags:
        assert protocol == "tcp" and _FLAGS.fullmatch(flags), rule
        parts.append(f"tcp flags & {flags} == {flags}")
    parts.append(_ACTIONS[rule["action"]])
    return " ".join(parts)


def ruleset(
    tap: str, inputs: Sequence[Mapping[str, str]], outputs: Sequence[Mapping[str, str]]
) -> str:
    """The bridge table filtering `tap` as Robot would, replacing any earlier one."""
    chains = {"robot_input": inputs, "robot_output": outputs}
    body = "".join(
        f"  chain {name} {{\n"
        + "".join(f"    {nft_rule(rule)}\n" for rule in rules)
        + "    drop\n  }\n"
        for name, rules in chains.items()
    )
    return (
        f"table bridge {TABLE}\ndelete table bridge {TABLE}\ntable bridge {TABLE} {{\n{body}"
        "  chain to_server {\n    type filter hook postrouting priority 0; policy accept;\n"
        f'    oifname "{tap}" ether type ip jump robot_input\n  }}\n'
        "  chain from_server {\n    type filter hook prerouting priority 0; policy accept;\n"
        f'    iifname "{tap}" ether type ip jump robot_output\n  }}\n}}\n'
    )


def set_robot_filter(
    bed: Bed, vm: Vm, inputs: Sequence[Mapping[str, str]], outputs: Sequence[Mapping[str, str]]
) -> None:
    """Put Robot's rules on the VM's switch port (its tap in the bed's namespace)."""
    done = bed.netns_run_input(
        ["nft", "-f", "-"], ruleset(vm.tap, inputs, outputs), bed.workdir, 30
    )
    assert done.returncode == 0, done.stderr
