"""The host firewall's rules, table-tested: who may reach which port, and no deploy shut out."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from denv_iac.node import NodeDeploySpec, NodeSpecError, ReplicaSpec, plan_node
from denv_iac.node.facts import FactQuery, NodeFacts, parse_facts, probe_script
from denv_iac.node.firewall import (
    BALANCER_RULES,
    BALANCER_UNIT,
    RULES,
    BalancerAccess,
    balancer_fact_query,
    balancer_files,
    lockout_problems,
    node_guards,
    plan_balancer_host,
    rules,
)
from denv_iac.node.steps import unit_path, wants_link

from .fixtures import converged, node_facts
from .test_plan import FRESH

REPLICAS = (
    ReplicaSpec("voice.joined.n1.0", "ghcr.io/acme/voice:1.4", 8000, 0),
    ReplicaSpec("voice.joined.n1.1", "ghcr.io/acme/voice:1.4", 8001, 1),
)
ADMINS = ("198.51.100.0/24", "2001:db8:a::/48")


def spec(**fields: object) -> NodeDeploySpec:
    base = NodeDeploySpec(
        node_id="joined.n1",
        replicas=REPLICAS,
        balancer_addresses=("203.0.113.10", "2001:db8::10"),
        admin_cidrs=ADMINS,
    )
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def text(node: NodeDeploySpec) -> str:
    return rules(node).content.decode()


# On the overlay: the balancer hosts' overlay addresses, and their public ones for WireGuard.
HUBS = ("10.99.0.9", "10.99.200.3")
PEERS = ("203.0.113.10", "2001:db8::10")
ANYWHERE = ("0.0.0.0/0", "::/0")  # a peer behind NAT: its address is unknown


def overlay_spec(**fields: object) -> NodeDeploySpec:
    on = spec(listen_address="10.99.4.7", balancer_addresses=HUBS, overlay_senders=PEERS)
    return dataclasses.replace(on, **fields)  # type: ignore[arg-type]


def test_on_the_overlay_the_balancers_come_through_the_tunnel_and_wireguard_from_the_peers() -> (
    None
):
    assert text(overlay_spec()) == (
        "#!/usr/sbin/nft -f\n"
        "# denv node joined.n1: replica and agent ports are for the balancers only, SSH for the "
        "admins only.\n"
        "table inet denv\n"
        "delete table inet denv\n"
        "table inet denv {\n"
        "\tset balancer_v4 {\n"
        "\t\ttype ipv4_addr; flags interval;\n"
        "\t\telements = { 10.99.0.9/32, 10.99.200.3/32 }\n"
        "\t}\n"
        "\tset overlay_senders_v4 {\n"
        "\t\ttype ipv4_addr; flags interval;\n"
        "\t\telements = { 203.0.113.10/32 }\n"
        "\t}\n"
        "\tset overlay_senders_v6 {\n"
        "\t\ttype ipv6_addr; flags interval;\n"
        "\t\telements = { 2001:db8::10/128 }\n"
        "\t}\n"
        "\tset admin_v4 {\n"
        "\t\ttype ipv4_addr; flags interval;\n"
        "\t\telements = { 198.51.100.0/24 }\n"
        "\t}\n"
        "\tset admin_v6 {\n"
        "\t\ttype ipv6_addr; flags interval;\n"
        "\t\telements = { 2001:db8:a::/48 }\n"
        "\t}\n"
        "\tchain input {\n"
        "\t\ttype filter hook input priority filter - 10; policy accept;\n"
        '\t\tiifname "lo" accept\n'
        "\t\tct state established,related accept\n"
        '\t\ttcp dport { 8000, 8001, 9100 } iifname "denv0" ip saddr @balancer_v4 accept\n'
        "\t\ttcp dport { 8000, 8001, 9100 } drop\n"
        "\t\tudp dport { 51820 } ip saddr @overlay_senders_v4 accept\n"
        "\t\tudp dport { 51820 } ip6 saddr @overlay_senders_v6 accept\n"
        "\t\tudp dport { 51820 } drop\n"
        "\t\ttcp dport { 22 } ip saddr @admin_v4 accept\n"
        "\t\ttcp dport { 22 } ip6 saddr @admin_v6 accept\n"
        "\t\ttcp dport { 22 } drop\n"
        "\t}\n"
        "\tchain forward {\n"
        "\t\ttype filter hook forward priority filter - 10; policy accept;\n"
        "\t\tct state established,related accept\n"
        '\t\tct status dnat tcp dport { 8000, 8001 } iifname "denv0" ip saddr @balancer_v4 '
        "accept\n"
        "\t\tct status dnat tcp dport { 8000, 8001 } drop\n"
        "\t}\n"
        "}\n"
    )


@pytest.mark.parametrize(
    ("fields", "present", "absent"),
    [
        # A peer behind NAT: WireGuard from anywhere (it answers nothing without a valid key).
        (
            {"overlay_senders": ANYWHERE},
            ["elements = { 0.0.0.0/0 }", "elements = { ::/0 }", "udp dport { 51820 } ip saddr"],
            ["203.0.113.10"],
        ),
        # No peer known yet: the WireGuard port admits nobody.
        ({"overlay_senders": ()}, ["udp dport { 51820 } drop"], ["@overlay_senders"]),
        # Another port for the overlay.
        ({"overlay_port": 51999}, ["udp dport { 51999 } drop"], ["51820"]),
        # No replicas: nothing is forwarded to a container, so no forward chain.
        ({"replicas": ()}, ['tcp dport { 9100 } iifname "denv0"'], ["chain forward", "8000"]),
        # Off the overlay: no tunnel, no WireGuard port, no forward chain (today's table).
        (
            {"listen_address": "", "overlay_senders": ()},
            ["tcp dport { 8000, 8001, 9100 } ip saddr @balancer_v4 accept"],
            ["denv0", "udp", "chain forward"],
        ),
    ],
    ids=["peer-behind-nat", "no-peers-yet", "port", "no-replicas", "off"],
)
def test_overlay_rules_table(
    fields: dict[str, object], present: list[str], absent: list[str]
) -> None:
    rendered = text(overlay_spec(**fields))
    for line in present:
        assert line in rendered
    for line in absent:
        assert line not in rendered


def test_the_wireguard_guard_never_counts_as_ssh_for_the_lockout_check() -> None:
    # An SSH login from a WireGuard peer's address on port 22: only admin_cidrs decide.
    on_port = overlay_spec(overlay_port=22, admin_cidrs=())
    facts = NodeFacts(systemd=True, ssh_client="192.0.2.50", ssh_port=22)
    assert lockout_problems(facts, node_guards(on_port)) == []


def test_node_rules_admit_replicas_from_balancers_and_ssh_from_admins_only() -> None:
    assert text(spec()) == (
        "#!/usr/sbin/nft -f\n"
        "# denv node joined.n1: replica and agent ports are for the balancers only, SSH for the "
        "admins only.\n"
        "table inet denv\n"
        "delete table inet denv\n"
        "table inet denv {\n"
        "\tset balancer_v4 {\n"
        "\t\ttype ipv4_addr; flags interval;\n"
        "\t\telements = { 203.0.113.10/32 }\n"
        "\t}\n"
        "\tset balancer_v6 {\n"
        "\t\ttype ipv6_addr; flags interval;\n"
        "\t\telements = { 2001:db8::10/128 }\n"
        "\t}\n"
        "\tset admin_v4 {\n"
        "\t\ttype ipv4_addr; flags interval;\n"
        "\t\telements = { 198.51.100.0/24 }\n"
        "\t}\n"
        "\tset admin_v6 {\n"
        "\t\ttype ipv6_addr; flags interval;\n"
        "\t\telements = { 2001:db8:a::/48 }\n"
        "\t}\n"
        "\tchain input {\n"
        "\t\ttype filter hook input priority filter - 10; policy accept;\n"
        '\t\tiifname "lo" accept\n'
        "\t\tct state established,related accept\n"
        "\t\ttcp dport { 8000, 8001, 9100 } ip saddr @balancer_v4 accept\n"
        "\t\ttcp dport { 8000, 8001, 9100 } ip6 saddr @balancer_v6 accept\n"
        "\t\ttcp dport { 8000, 8001, 9100 } drop\n"
        "\t\ttcp dport { 22 } ip saddr @admin_v4 accept\n"
        "\t\ttcp dport { 22 } ip6 saddr @admin_v6 accept\n"
        "\t\ttcp dport { 22 } drop\n"
        "\t}\n"
        "}\n"
    )


@pytest.mark.parametrize(
    ("fields", "present", "absent"),
    [
        # No admin_cidrs: SSH is left as the machine has it (denv plan warns).
        ({"admin_cidrs": ()}, ["tcp dport { 8000, 8001, 9100 } drop"], ["dport { 22 }"]),
        # IPv4 admins only: IPv6 SSH is dropped, as no IPv6 address is listed.
        (
            {"admin_cidrs": ("198.51.100.7/32",)},
            ["tcp dport { 22 } ip saddr @admin_v4 accept", "tcp dport { 22 } drop"],
            ["@admin_v6"],
        ),
        # A host address given without a length is the /32 it names.
        ({"admin_cidrs": ("198.51.100.7",)}, ["elements = { 198.51.100.7/32 }"], []),
        # No balancers yet: replica and agent ports admit nobody; SSH is still the admins'.
        (
            {"balancer_addresses": ()},
            ["tcp dport { 8000, 8001, 9100 } drop", "tcp dport { 22 } ip saddr @admin_v4"],
            ["@balancer_v4", "@balancer_v6"],
        ),
        ({"replicas": (), "agent_port": 9200}, ["tcp dport { 9200 } drop"], ["8000"]),
        # sshd on another port: that port is the one guarded.
        ({"ssh_port": 2222}, ["tcp dport { 2222 } drop"], ["dport { 22 }"]),
    ],
    ids=["no-admins", "ipv4-admins", "host-address", "no-balancers", "agent-only", "ssh-port"],
)
def test_node_rules_table(fields: dict[str, object], present: list[str], absent: list[str]) -> None:
    rendered = text(spec(**fields))
    for line in present:
        assert line in rendered
    for line in absent:
        assert line not in rendered


def test_balancer_host_rules_guard_ssh_and_the_stats_port_and_leave_the_endpoint_open() -> None:
    table, unit = balancer_files(BalancerAccess(("198.51.100.0/24",), 8405))
    assert table.path == BALANCER_RULES and unit.path == unit_path(BALANCER_UNIT)
    rendered = table.content.decode()
    assert "table inet denv-balancer {" in rendered  # beside a joined node's own `inet denv`
    assert rendered.endswith(
        "\t\tct state established,related accept\n"
        "\t\ttcp dport { 22, 8405 } ip saddr @admin_v4 accept\n"
        "\t\ttcp dport { 22, 8405 } drop\n"
        "\t}\n"
        "}\n"
    )
    assert "policy accept" in rendered  # the endpoint port is dropped by nothing here
    assert "ExecStop=/usr/sbin/nft delete table inet denv-balancer" in unit.content.decode()


def _nft_check(path: Path) -> subprocess.CompletedProcess[str]:
    # A network namespace of its own: the rules are checked, never loaded into this machine.
    return subprocess.run(
        ["unshare", "--net", "nft", "-c", "-f", str(path)], capture_output=True, text=True
    )


@pytest.mark.parametrize(
    "content",
    [
        rules(spec()).content,
        rules(spec(admin_cidrs=(), balancer_addresses=())).content,
        balancer_files(BalancerAccess(ADMINS, 8405))[0].content,
        rules(overlay_spec()).content,
        rules(overlay_spec(overlay_senders=ANYWHERE, replicas=())).content,
        balancer_files(BalancerAccess(ADMINS, 8405, 51820, ANYWHERE))[0].content,
    ],
    ids=[
        "node",
        "node-open-ssh-no-balancers",
        "balancer-host",
        "overlay",
        "overlay-anywhere",
        "balancer-host-overlay",
    ],
)
@pytest.mark.needs_nft
def test_the_rules_are_valid_nftables(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "rules.nft"
    path.write_bytes(content)
    result = _nft_check(path)
    if "Operation not permitted" in result.stderr:
        pytest.skip("unshare --net needs root")
    assert result.returncode == 0, result.stderr


LOCKOUT = (
    "admin_cidrs: this deploy reaches the machine from 192.0.2.50, which admin_cidrs does not "
    "hold, so the firewall would shut it out; add 192.0.2.50 (or a block holding it) to "
    "admin_cidrs"
)


@pytest.mark.parametrize(
    ("client", "port", "systemd", "admins", "expected"),
    [
        ("198.51.100.7", 22, True, ADMINS, []),
        ("2001:db8:a::9", 22, True, ADMINS, []),
        ("::ffff:198.51.100.7", 22, True, ADMINS, []),  # a dual-stack sshd's IPv4 client
        ("192.0.2.50", 22, True, ADMINS, [LOCKOUT]),
        ("192.0.2.50", 22, True, (), []),  # no admins: SSH stays open
        ("192.0.2.50", 2222, True, ADMINS, []),  # an SSH port the firewall does not guard
        ("127.0.0.1", 22, True, ADMINS, []),  # a tunnel to loopback: lo is admitted first
        ("192.0.2.50", 22, False, ADMINS, []),  # a chroot: nothing is loaded
        ("", 0, True, ADMINS, []),  # not over SSH (@local from a console)
    ],
)
def test_lockout_table(
    client: str, port: int, systemd: bool, admins: tuple[str, ...], expected: list[str]
) -> None:
    facts = NodeFacts(systemd=systemd, ssh_client=client, ssh_port=port)
    assert lockout_problems(facts, node_guards(spec(admin_cidrs=admins))) == expected


def test_lockout_follows_the_nodes_ssh_port() -> None:
    on_2222 = spec(ssh_port=2222)
    outside = NodeFacts(systemd=True, ssh_client="192.0.2.50", ssh_port=2222)
    assert lockout_problems(outside, node_guards(on_2222)) == [LOCKOUT]
    on_22 = dataclasses.replace(outside, ssh_port=22)  # a port this node's table leaves alone
    assert lockout_problems(on_22, node_guards(on_2222)) == []


def test_a_deploy_from_outside_admin_cidrs_is_refused_before_any_step() -> None:
    facts = dataclasses.replace(node_facts(), ssh_client="192.0.2.50", ssh_port=22)
    with pytest.raises(NodeSpecError) as refused:
        plan_node(facts, spec())
    assert refused.value.problems == [LOCKOUT]
    # The same node, deployed from an admin address, plans as usual.
    admin = dataclasses.replace(facts, ssh_client="198.51.100.7")
    assert any(step.file and step.file.path == RULES for step in plan_node(admin, spec()))


def test_node_with_admin_cidrs_converges_and_a_second_run_is_empty() -> None:
    facts = dataclasses.replace(node_facts(), ssh_client="198.51.100.7", ssh_port=22)
    after = converged(facts, spec(), FRESH)
    assert plan_node(after, spec()) == []
    # Narrowing admin_cidrs swaps the table in one transaction.
    steps = plan_node(after, spec(admin_cidrs=("198.51.100.0/25",)))
    assert [(s.area, s.title) for s in steps] == [
        ("firewall", f"write {RULES}"),
        ("firewall", "load the new rules"),
    ]


@pytest.mark.parametrize(
    "line",
    ["ssh\t198.51.100.7 51234 10.0.0.5 22", "ssh\t2001:db8:a::9 51234 2001:db8::5 2222"],
)
def test_the_probe_reads_the_deploys_ssh_connection(line: str) -> None:
    address, _, _, port = line.split("\t")[1].split()
    facts = parse_facts(["systemd", line])
    assert (facts.ssh_client, facts.ssh_port) == (address, int(port))


@pytest.mark.parametrize("value", ["garbage", "1.2.3.4 5 6.7.8.9 x", "host 5 6.7.8.9 22"])
def test_the_probe_reads_no_ssh_connection_from_a_malformed_line(value: str) -> None:
    facts = parse_facts([f"ssh\t{value}"])
    assert (facts.ssh_client, facts.ssh_port) == ("", 0)


ACCESS = BalancerAccess(("198.51.100.0/24",), 8405)


def _balancer_facts(**fields: object) -> NodeFacts:
    base = NodeFacts(systemd=True, packages={"nftables": "1.0.9"}, ssh_client="198.51.100.7")
    return dataclasses.replace(base, ssh_port=22, **fields)  # type: ignore[arg-type]


def test_balancer_host_firewall_is_installed_then_left_alone() -> None:
    fresh = dataclasses.replace(_balancer_facts(), packages={})
    steps = plan_balancer_host(fresh, ACCESS)
    assert [s.title for s in steps] == [
        "install nftables",
        f"write {BALANCER_RULES}",
        f"write {unit_path(BALANCER_UNIT)}",
        "restart the firewall",
    ]
    table, unit = balancer_files(ACCESS)
    done = _balancer_facts(
        files={table.path: table.sha256, unit.path: unit.sha256},
        links={wants_link(BALANCER_UNIT): unit.path},
        active_units=frozenset({BALANCER_UNIT}),
    )
    assert plan_balancer_host(done, ACCESS) == []
    assert set(balancer_fact_query().files) == {table.path, unit.path}
    # admin_cidrs dropped from the stack: the table goes, SSH and stats are the machine's again.
    (removal,) = plan_balancer_host(done, BalancerAccess((), 8405))
    assert removal.commands == (
        f"systemctl disable --now {BALANCER_UNIT}",
        f"rm -f {BALANCER_RULES} {unit.path} {wants_link(BALANCER_UNIT)}",
    )
    assert plan_balancer_host(_balancer_facts(), BalancerAccess((), 8405)) == []


def test_balancer_host_deploy_from_outside_admin_cidrs_is_refused() -> None:
    with pytest.raises(NodeSpecError) as refused:
        plan_balancer_host(_balancer_facts(ssh_client="192.0.2.50"), ACCESS)
    assert refused.value.problems == [LOCKOUT]


def test_a_fresh_node_is_firewalled_before_anything_listens_or_reboots() -> None:
    fresh = node_facts()
    fresh = dataclasses.replace(
        fresh, packages={k: v for k, v in fresh.packages.items() if k != "nftables"}
    )
    steps = plan_node(fresh, spec())
    areas = [step.area for step in steps]
    assert areas.index("firewall") < min(areas.index(a) for a in ("driver", "agent", "replicas"))
    # nft comes with the base packages, installed first.
    assert areas[:2] == ["base", "base"] and "nftables" in steps[1].title


def test_the_probe_finds_the_login_above_a_sudo_that_cleared_the_environment() -> None:
    # sudo starts its command with a clean environment, as `env -i` does here; the login's
    # SSH_CONNECTION is still in the environment of the shell above it (`; true` keeps that
    # shell from replacing itself with its last command).
    login = {**os.environ, "SSH_CONNECTION": "198.51.100.7 51234 10.0.0.5 22"}
    out = subprocess.run(
        ["sh", "-c", 'env -i sh -c "$0"; true', probe_script(FactQuery())],
        env=login,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    facts = parse_facts(out.splitlines())
    assert (facts.ssh_client, facts.ssh_port) == ("198.51.100.7", 22)


@pytest.mark.parametrize(
    ("access", "present", "absent"),
    [
        # On the overlay without admins: a table for WireGuard alone, SSH left as it is.
        (
            BalancerAccess((), 8405, 51820, ("198.18.0.1",)),
            [
                "# denv balancer host: WireGuard for the overlay's peers only.",
                "udp dport { 51820 } ip saddr @overlay_senders_v4 accept",
                "udp dport { 51820 } drop",
            ],
            ["tcp dport"],
        ),
        # A node behind NAT: from anywhere.
        (
            BalancerAccess(("198.51.100.0/24",), 8405, 51820, ANYWHERE),
            [
                "SSH and HAProxy's stats port for the admins only; WireGuard for the overlay's",
                "elements = { 0.0.0.0/0 }",
                "tcp dport { 22, 8405 } drop",
            ],
            [],
        ),
    ],
    ids=["overlay-only", "overlay-and-admins"],
)
def test_balancer_host_rules_on_the_overlay(
    access: BalancerAccess, present: list[str], absent: list[str]
) -> None:
    rendered = balancer_files(access)[0].content.decode()
    for line in present:
        assert line in rendered
    for line in absent:
        assert line not in rendered


def test_a_balancer_host_on_the_overlay_keeps_a_table_without_admins() -> None:
    access = BalancerAccess((), 8405, 51820, ("198.18.0.1",))
    steps = plan_balancer_host(_balancer_facts(), access)
    assert f"write {BALANCER_RULES}" in [s.title for s in steps]
