"""The WireGuard overlay's pure core: members, stable addresses, peers, configs, the off switch."""

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from denv_iac.cli import main
from denv_iac.core.overlay_plan import (
    ANYWHERE,
    CONFIG_PATH,
    NAT_KEEPALIVE_S,
    PRIVATE_KEY_PLACEHOLDER,
    OverlayPlan,
    allocate,
    node_peer_sites,
    render_config,
    wireguard_senders,
    wireguard_sources,
    with_private_key,
)
from denv_iac.core.plan import make_plan
from denv_iac.core.stack.exposure import stack_warnings
from denv_iac.core.stack.reader import StackError, read_stack
from tests.stacks import SECRET

IMAGE = "vllm/vllm-openai:v0.11.0"
HUB = "hetzner-fsn:balancer"


def config(**balancer: Any) -> dict[str, Any]:
    """A Hetzner balancer host in front of a Hetzner box, an office (one machine behind NAT)
    and AWS nodes: every way a machine joins the overlay."""
    return copy.deepcopy(
        {
            "denv:sites": [
                {
                    "name": "hetzner-fsn",
                    "kind": "hetzner",
                    "admin_cidrs": ["198.51.100.0/24"],
                    "ssh_private_key": SECRET,
                    "nodes": [
                        {"name": "gex-1", "address": "203.0.113.21", "server_model": "GEX44"}
                    ],
                },
                {
                    "name": "office",
                    "kind": "joined",
                    "admin_cidrs": ["198.51.100.0/24"],
                    "ssh_private_key": SECRET,
                    "nodes": [
                        {"name": "rack-1", "address": "192.0.2.10", "gpu": "L40S", "gpus": 1},
                        {
                            "name": "rack-2",
                            "address": "192.0.2.11",
                            "gpu": "L40S",
                            "gpus": 1,
                            "behind_nat": True,
                        },
                    ],
                },
                {
                    "name": "aws-use1",
                    "kind": "aws",
                    "region": "us-east-1",
                    "instance_type": "p5.4xlarge",
                    "max_nodes": 4,
                    "admin_cidrs": ["198.51.100.0/24"],
                    "ssh_private_key": SECRET,
                },
            ],
            "denv:recipes": [
                {
                    "name": "voice",
                    "min_warm": 2,
                    "spare": 1,
                    "image": IMAGE,
                    "sites": ["office", "hetzner-fsn", "aws-use1"],
                },
                {"name": "big", "min_warm": 1, "spare": 1, "image": IMAGE, "sites": ["aws-use1"]},
            ],
            "denv:balancer": {"sites": ["hetzner-fsn"], "port": 443, **balancer},
        }
    )


def overlay_of(cfg: dict[str, Any]) -> OverlayPlan:
    return make_plan(read_stack("s", cfg)).overlay


def keys(plan: OverlayPlan, **rotated: str) -> dict[str, str]:
    found = {m.name: f"pub-{m.name}=" for m in plan.members}
    return {**found, **rotated}


def public(plan: OverlayPlan) -> dict[str, str]:
    return {m.name: m.public_address or f"{m.name}.example" for m in plan.members}


def configs(plan: OverlayPlan, public_keys: dict[str, str]) -> dict[str, str]:
    return {m.name: render_config(plan, m.name, public_keys, public(plan)) for m in plan.members}


def test_members_and_their_roles() -> None:
    plan = overlay_of(config())
    roles = {m.name: (m.hub, m.node, m.behind_nat, m.public_address) for m in plan.members}
    assert roles == {
        HUB: (True, False, False, ""),
        "hetzner-fsn.gex-1": (False, True, False, "203.0.113.21"),
        "office.rack-1": (False, True, False, "192.0.2.10"),
        "office.rack-2": (False, True, True, "192.0.2.11"),
        "aws-use1.node-0": (False, True, False, ""),
        "aws-use1.node-1": (False, True, False, ""),
    }
    assert plan.on and all(m.address.startswith("10.99.") for m in plan.members)
    assert len({m.address for m in plan.members}) == len(plan.members)


def test_each_balancer_host_peers_with_every_node_and_nodes_never_with_each_other() -> None:
    cfg = config()
    # A second balancer, on the office's first machine: that machine is a host and a node.
    cfg["denv:balancer"]["sites"] = ["hetzner-fsn", "office"]
    plan = overlay_of(cfg)
    peers = {m.name: sorted(p.name for p in plan.peers(m.name)) for m in plan.members}
    nodes = ["aws-use1.node-0", "aws-use1.node-1", "hetzner-fsn.gex-1"]
    assert peers == {
        HUB: sorted([*nodes, "office.rack-1", "office.rack-2"]),
        "office.rack-1": sorted([*nodes, HUB, "office.rack-2"]),
        "office.rack-2": sorted([HUB, "office.rack-1"]),
        **{n: sorted([HUB, "office.rack-1"]) for n in nodes},
    }
    # Peering is symmetric: whoever lists a peer is listed by it.
    assert all(m.name in peers[p] for m in plan.members for p in peers[m.name])


def test_a_node_behind_nat_dials_out_with_a_keepalive_and_is_never_dialled() -> None:
    plan = overlay_of(config())
    texts = configs(plan, keys(plan))
    nat = texts["office.rack-2"]
    assert f"Endpoint = {HUB}.example:51820" in nat
    assert f"PersistentKeepalive = {NAT_KEEPALIVE_S}" in nat
    hub = texts[HUB].split("[Peer]")
    (nat_entry,) = [entry for entry in hub if "# office.rack-2" in entry]
    assert "Endpoint" not in nat_entry and "PersistentKeepalive" not in nat_entry
    (public_entry,) = [entry for entry in hub if "# office.rack-1" in entry]
    assert "Endpoint = 192.0.2.10:51820" in public_entry
    # Machines with a public address keep no keepalive: their peers can always dial them.
    assert "PersistentKeepalive" not in texts["office.rack-1"] + texts[HUB]


def test_a_rendered_config_holds_addresses_and_public_keys_only() -> None:
    plan = overlay_of(config())
    text = render_config(plan, "office.rack-1", keys(plan), public(plan))
    own = plan.member("office.rack-1").address
    hub = plan.member(HUB).address
    assert text.splitlines()[1:] == [
        "[Interface]",
        f"Address = {own}/16",
        "ListenPort = 51820",
        "MTU = 1420",
        f"PrivateKey = {PRIVATE_KEY_PLACEHOLDER}",
        "",
        "[Peer]",
        f"# {HUB}",
        f"PublicKey = pub-{HUB}=",
        f"AllowedIPs = {hub}/32",
        f"Endpoint = {HUB}.example:51820",
    ]
    assert CONFIG_PATH.endswith("denv0.conf")
    key = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk="
    written = with_private_key(text, key)
    assert written == text.replace(PRIVATE_KEY_PLACEHOLDER, key)


def test_every_member_has_the_same_mtu_that_fits_a_1500_path_over_ipv6() -> None:
    # wg-quick would take the route's MTU less 80: 8921 on AWS (9001 jumbo frames), too big for
    # the internet path to a peer elsewhere; both ends of a tunnel need the same.
    texts = configs(overlay_of(config()), keys(overlay_of(config())))
    mtus = {re.findall(r"^MTU = (\d+)$", text, re.MULTILINE)[0] for text in texts.values()}
    assert mtus == {"1420"} and 1420 + 80 <= 1500


@pytest.mark.parametrize(
    ("key", "given", "error"),
    [
        ("not-base64!", None, "not a base64 Curve25519 key"),
        ("c2hvcnQ=", None, "not a base64 Curve25519 key"),
        ("yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=", "[Interface]\n", "no private key"),
    ],
)
def test_only_a_real_key_fills_the_placeholder(key: str, given: str | None, error: str) -> None:
    plan = overlay_of(config())
    text = given if given is not None else render_config(plan, HUB, keys(plan), public(plan))
    with pytest.raises(ValueError, match=error):
        with_private_key(text, key)


@pytest.mark.parametrize(
    "rotated", ["office.rack-2", "aws-use1.node-0", HUB], ids=["nat-node", "aws-node", "hub"]
)
def test_rotating_one_key_changes_only_its_peers_configs(rotated: str) -> None:
    plan = overlay_of(config())
    before = configs(plan, keys(plan))
    after = configs(plan, keys(plan, **{rotated: "rotated="}))
    changed = sorted(name for name in before if before[name] != after[name])
    assert changed == sorted(p.name for p in plan.peers(rotated))
    assert rotated not in changed  # its own config names no key of its own


CHANGES = [
    (
        "add an office machine",
        lambda c: c["denv:sites"][1]["nodes"].append(
            {"name": "rack-3", "address": "192.0.2.12", "gpu": "L40S", "gpus": 1}
        ),
    ),
    (
        "add an AWS node",
        lambda c: c["denv:sites"][2].update(max_nodes=3) or c["denv:recipes"][1].update(min_warm=2),
    ),
    ("remove an office machine", lambda c: c["denv:sites"][1]["nodes"].pop(0)),
    ("rotate nothing, reorder sites", lambda c: c["denv:sites"].reverse()),
]


@pytest.mark.parametrize("change", [c[1] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_adding_or_removing_a_machine_renumbers_no_other(change: Any) -> None:
    before = {m.name: m.address for m in overlay_of(config()).members}
    cfg = config()
    change(cfg)
    after = {m.name: m.address for m in overlay_of(cfg).members}
    assert before != after or CHANGES[3][1] is change
    kept = set(before) & set(after)
    assert kept and {n: after[n] for n in kept} == {n: before[n] for n in kept}


def deploy_inputs(plan: OverlayPlan, **rotated: str) -> dict[str, tuple[Any, ...]]:
    """Per member, all that its deploy takes from the overlay: its address, its config, whom
    its firewall admits WireGuard and balancer traffic from."""
    addresses = public(plan)
    texts = configs(plan, keys(plan, **rotated))
    return {
        m.name: (
            m.address,
            texts[m.name],
            wireguard_sources(plan, m.name, addresses),
            plan.hub_addresses,
        )
        for m in plan.members
    }


def _replace_office_machine(c: dict[str, Any]) -> None:
    c["denv:sites"][1]["nodes"][0] = {
        "name": "rack-3",
        "address": "192.0.2.12",
        "gpu": "L40S",
        "gpus": 1,
    }


def _swap_office_machine(c: dict[str, Any]) -> None:
    c["denv:sites"][1]["nodes"][0]["address"] = "192.0.2.99"  # the same node on a new box


MINIMAL = [
    # (change, the members whose deploy inputs change or appear; every other one's stay)
    (CHANGES[0][1], {HUB, "office.rack-3"}),
    (CHANGES[1][1], {HUB, "aws-use1.node-2"}),
    (_replace_office_machine, {HUB, "office.rack-3"}),
    (_swap_office_machine, {HUB}),  # the hub dials its new address; its own inputs stay
]


@pytest.mark.parametrize(
    ("change", "affected"),
    MINIMAL,
    ids=["add-office-machine", "add-aws-node", "replace-office-machine", "swap-office-box"],
)
def test_adding_or_replacing_a_node_changes_only_the_hubs_and_its_own_deploy(
    change: Any, affected: set[str]
) -> None:
    before = deploy_inputs(overlay_of(config()))
    cfg = config()
    change(cfg)
    after = deploy_inputs(overlay_of(cfg))
    changed = {name for name in after if before.get(name) != after[name]}
    assert changed == affected


@pytest.mark.parametrize("rotated", ["office.rack-2", "aws-use1.node-0", HUB])
def test_rotating_a_key_changes_only_its_peers_deploys_besides_its_own_key(rotated: str) -> None:
    plan = overlay_of(config())
    before, after = deploy_inputs(plan), deploy_inputs(plan, **{rotated: "rotated="})
    changed = {name for name in after if before[name] != after[name]}
    # Its own deploy changes by its private key alone, which no config holds.
    assert changed == {p.name for p in plan.peers(rotated)}


def test_allocation_is_stable_as_machines_are_added_one_by_one() -> None:
    names = [f"office.node-{i}" for i in range(300)]
    previous = allocate("10.99.0.0/16", names[:1])
    for count in range(2, len(names) + 1):
        current = allocate("10.99.0.0/16", names[:count])
        assert {n: current[n] for n in previous} == previous, count
        previous = current


# lab.gpu-17 and lab.gpu-24 hash to one address of a /24; lab.gpu-0 to another.
COLLISIONS = [
    (["lab.gpu-17", "lab.gpu-24"], {"lab.gpu-17": "10.99.0.116", "lab.gpu-24": "10.99.0.117"}),
    (["lab.gpu-24", "lab.gpu-17"], {"lab.gpu-17": "10.99.0.116", "lab.gpu-24": "10.99.0.117"}),
    (["lab.gpu-24"], {"lab.gpu-24": "10.99.0.116"}),
    (["lab.gpu-17"], {"lab.gpu-17": "10.99.0.116"}),
    (["lab.gpu-0"], {"lab.gpu-0": "10.99.0.67"}),
]


@pytest.mark.parametrize(("names", "expected"), COLLISIONS)
def test_collisions_resolve_by_name_whatever_the_order(
    names: list[str], expected: dict[str, str]
) -> None:
    assert allocate("10.99.0.0/24", names) == expected


def test_a_full_range_gives_every_address_once_and_no_more() -> None:
    names = [f"m{i}" for i in range(6)]
    got = allocate("10.99.0.0/29", names)
    assert sorted(got.values()) == [f"10.99.0.{i}" for i in range(1, 7)]
    with pytest.raises(ValueError, match="holds 6 machines, not 7"):
        allocate("10.99.0.0/29", [*names, "m6"])


def test_the_off_switch_leaves_no_overlay_and_warns() -> None:
    cfg = config(overlay={"enabled": False})
    cfg["denv:sites"][1]["nodes"][1].pop("behind_nat")
    stack = read_stack("s", cfg)
    assert not make_plan(stack).overlay.on and make_plan(stack).overlay.members == ()
    assert stack_warnings(stack)[-1] == (
        "balancer.overlay.enabled: false sends prompts, streams and health checks to aws-use1, "
        "office unencrypted across the internet; turn the overlay back on unless these sites "
        "share one private network with the balancer"
    )
    assert not any("overlay" in line for line in stack_warnings(read_stack("s", config())))


def test_a_chosen_range_and_port_are_used() -> None:
    plan = overlay_of(config(overlay={"cidr": "172.20.0.0/20", "port": 443}))
    assert all(m.address.startswith("172.20.") for m in plan.members)
    assert "ListenPort = 443" in render_config(plan, HUB, keys(plan), public(plan))


def test_a_local_balancer_links_nothing_and_says_so(tmp_path: Path) -> None:
    cfg = config()
    cfg["denv:sites"].append(
        {"name": "here", "kind": "local", "nodes": [{"name": "n", "gpu": "H100", "gpus": 1}]}
    )
    cfg["denv:balancer"]["sites"] = ["here"]
    # Its NAT'd node could never be reached; without one the stack is legal.
    assert _problems(cfg) == [
        "sites[1].nodes[1].behind_nat: a node behind NAT is reached only over the overlay, which "
        "a balancer on this machine does not join; host the balancer on an aws, hetzner or "
        "joined site"
    ]
    cfg["denv:sites"][1]["nodes"][1].pop("behind_nat")
    assert make_plan(read_stack("s", cfg)).overlay.members == ()
    result = _plan_cli(tmp_path, cfg)
    assert result.exit_code == 0, result.output
    assert "Overlay: off (no balancer host and node reached over SSH to link;" in result.output


def _second_balancer_on_the_office(c: dict[str, Any]) -> None:
    c["denv:balancer"]["sites"] = ["hetzner-fsn", "office"]


def _no_nat(c: dict[str, Any]) -> None:
    c["denv:sites"][1]["nodes"][1].pop("behind_nat")


def _overlay_off(c: dict[str, Any]) -> None:
    _no_nat(c)
    c["denv:balancer"]["overlay"] = {"enabled": False}


def _local_balancer(c: dict[str, Any]) -> None:
    _no_nat(c)
    c["denv:sites"].append(
        {"name": "here", "kind": "local", "nodes": [{"name": "n", "gpu": "H100", "gpus": 1}]}
    )
    c["denv:balancer"]["sites"] = ["here"]


NODES = ("aws-use1.node-0", "aws-use1.node-1", "hetzner-fsn.gex-1", "office.rack-1")
SENDERS = [
    # (change, member, who may send it WireGuard packets: None for anyone)
    (lambda c: None, HUB, None),  # office.rack-2 is behind NAT: its address is unknown
    (_no_nat, HUB, (*NODES, "office.rack-2")),
    (lambda c: None, "aws-use1.node-0", (HUB,)),
    (lambda c: None, "office.rack-2", (HUB,)),
    (_second_balancer_on_the_office, "aws-use1.node-0", (HUB, "office.rack-1")),
    (_second_balancer_on_the_office, "office.rack-1", None),  # a host too, of rack-2
    (_second_balancer_on_the_office, "office.rack-2", (HUB, "office.rack-1")),
]


@pytest.mark.parametrize(("change", "member", "senders"), SENDERS)
def test_wireguard_is_taken_from_the_peers_public_addresses_or_anyone_behind_nat(
    change: Any, member: str, senders: tuple[str, ...] | None
) -> None:
    cfg = config()
    change(cfg)
    assert wireguard_senders(overlay_of(cfg), member) == senders


SOURCES = [
    # (change, member, public address overrides, the sources its firewall admits WireGuard from)
    (lambda c: None, HUB, {}, ANYWHERE),  # office.rack-2 is behind NAT
    (lambda c: None, "aws-use1.node-0", {HUB: "198.18.0.7"}, ("198.18.0.7",)),
    (lambda c: None, "office.rack-2", {HUB: "2001:db8::7"}, ("2001:db8::7",)),
    # A host name cannot be held by a firewall rule: open, as for a peer behind NAT.
    (lambda c: None, "aws-use1.node-0", {HUB: "fsn.example"}, ANYWHERE),
    (
        _second_balancer_on_the_office,
        "aws-use1.node-0",
        {HUB: "198.18.0.7"},
        ("192.0.2.10", "198.18.0.7"),  # both hosts, the office's by its listed address
    ),
    # No NAT: every node's address (rack-2's as the stack lists it), each once.
    (
        _no_nat,
        HUB,
        {m: f"198.18.0.{i % 2}" for i, m in enumerate(NODES)},
        ("192.0.2.11", "198.18.0.0", "198.18.0.1"),
    ),
]


@pytest.mark.parametrize(("change", "member", "given", "sources"), SOURCES)
def test_a_members_firewall_admits_wireguard_from_its_peers_addresses(
    change: Any, member: str, given: dict[str, str], sources: tuple[str, ...]
) -> None:
    cfg = config()
    change(cfg)
    plan = overlay_of(cfg)
    addresses = {**{m.name: m.public_address for m in plan.members}, **given}
    assert wireguard_sources(plan, member, addresses) == sources


def test_the_hub_addresses_are_the_balancer_hosts_overlay_addresses() -> None:
    cfg = config()
    _second_balancer_on_the_office(cfg)
    plan = overlay_of(cfg)
    assert plan.hub_addresses == tuple(
        sorted(plan.member(m).address for m in (HUB, "office.rack-1"))
    )
    assert len(plan.hub_addresses) == 2


PEER_SITES = [
    # (change, site, the balancer sites whose hosts reach its nodes through the overlay)
    (lambda c: None, "aws-use1", ("hetzner-fsn",)),
    (lambda c: None, "office", ("hetzner-fsn",)),
    (_second_balancer_on_the_office, "hetzner-fsn", ("hetzner-fsn", "office")),
    (_overlay_off, "aws-use1", ()),
    (_local_balancer, "aws-use1", ()),  # a balancer on this machine joins no overlay
    (_local_balancer, "here", ()),
]


@pytest.mark.parametrize(("change", "site", "expected"), PEER_SITES)
def test_a_sites_nodes_peer_with_the_hosts_the_plan_gives_them(
    change: Any, site: str, expected: tuple[str, ...]
) -> None:
    cfg = config()
    change(cfg)
    stack = read_stack("s", cfg)
    assert node_peer_sites(stack, site) == expected
    # The very hosts the plan peers each of the site's nodes with, read from the stack alone.
    plan = make_plan(stack).overlay
    for member in (m for m in plan.members if m.site == site and m.node):
        peers = [plan.member(p.name) for p in plan.peers(member.name)]
        assert {peer.site for peer in peers if peer.hub} == set(expected), member.name


def _problems(cfg: dict[str, Any]) -> list[str]:
    with pytest.raises(StackError) as error:
        read_stack("s", cfg)
    return error.value.problems


def _nat_on_hetzner(c: dict[str, Any]) -> None:
    c["denv:sites"][0]["nodes"][0]["behind_nat"] = True


def _nat_balancer_node(c: dict[str, Any]) -> None:
    c["denv:balancer"]["sites"] = ["office"]
    c["denv:sites"][1]["nodes"].reverse()


REFUSED = [
    (
        "public range",
        lambda c: c["denv:balancer"].update(overlay={"cidr": "100.64.0.0/16"}),
        'balancer.overlay.cidr: "100.64.0.0/16" is not inside 10/8, 172.16/12 or 192.168/16; '
        "write a private IPv4 range like 10.99.0.0/16",
    ),
    (
        "host bits",
        lambda c: c["denv:balancer"].update(overlay={"cidr": "10.99.0.1/16"}),
        'balancer.overlay.cidr: "10.99.0.1/16" is not a network address with a prefix; '
        "write a private IPv4 range like 10.99.0.0/16",
    ),
    (
        "ipv6",
        lambda c: c["denv:balancer"].update(overlay={"cidr": "fd00::/64"}),
        'balancer.overlay.cidr: "fd00::/64" is not inside 10/8, 172.16/12 or 192.168/16; '
        "write a private IPv4 range like 10.99.0.0/16",
    ),
    (
        "tiny range",
        lambda c: c["denv:balancer"].update(overlay={"cidr": "10.99.0.0/28"}),
        'balancer.overlay.cidr: "10.99.0.0/28" is too small for an overlay; use a /24 or larger',
    ),
    (
        "range too small for the machines",
        lambda c: (
            c["denv:balancer"].update(overlay={"cidr": "10.99.0.0/24"})
            or c["denv:sites"][2].update(max_nodes=60)
        ),
        "balancer.overlay.cidr: 10.99.0.0/24 gives 64 machines under 4 addresses each; use a "
        "larger range such as 10.99.0.0/16",
    ),
    (
        "admin range overlaps",
        lambda c: c["denv:sites"][1].update(admin_cidrs=["10.0.0.0/8", "10.99.4.0/24"]),
        "sites[1].admin_cidrs: 10.99.4.0/24 lies inside the overlay 10.99.0.0/16, so replies to "
        "it would go into the tunnel; move balancer.overlay.cidr elsewhere",
    ),
    (
        "node inside the range",
        lambda c: c["denv:sites"][1]["nodes"][0].update(address="10.99.3.4"),
        "sites[1].nodes[0].address: 10.99.3.4 lies inside the overlay 10.99.0.0/16; move "
        "balancer.overlay.cidr elsewhere",
    ),
    (
        "nat without the overlay",
        lambda c: c["denv:balancer"].update(overlay={"enabled": False}),
        "sites[1].nodes[1].behind_nat: a node behind NAT is reached only over the overlay; "
        "remove balancer.overlay.enabled: false",
    ),
    (
        "nat on the balancer's machine",
        _nat_balancer_node,
        "sites[1].nodes[0].behind_nat: this node hosts the balancer of site office, which "
        "clients and nodes must reach; list a node with a public address first",
    ),
    (
        "nat on a hetzner box",
        _nat_on_hetzner,
        "sites[0].nodes[0].behind_nat: a Hetzner box has a public address; remove behind_nat",
    ),
    (
        "a local balancer beside a balancer host",
        lambda c: (
            _no_nat(c)
            or c["denv:sites"].append(
                {
                    "name": "here",
                    "kind": "local",
                    "nodes": [{"name": "n", "gpu": "H100", "gpus": 1}],
                }
            )
            or c["denv:balancer"].update(sites=["hetzner-fsn", "here"])
        ),
        "balancer.sites[1]: here is a local site, whose balancer does not join the overlay the "
        "other balancers reach the nodes through; host the balancer on an aws, hetzner or joined "
        "site, or set balancer.overlay.enabled: false",
    ),
    (
        "enabled not a flag",
        lambda c: c["denv:balancer"].update(overlay={"enabled": "no"}),
        "balancer.overlay.enabled: expected true or false, got a string",
    ),
    (
        "port out of range",
        lambda c: c["denv:balancer"].update(overlay={"port": 0}),
        "balancer.overlay.port: 0 is out of range; use a number from 1 to 65535",
    ),
    (
        "typo",
        lambda c: c["denv:balancer"].update(overlay={"cdir": "10.98.0.0/16"}),
        'balancer.overlay.cdir: unknown key; did you mean "cidr"?',
    ),
]


@pytest.mark.parametrize(("change", "line"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_bad_overlay_is_one_line_naming_the_field_and_fix(change: Any, line: str) -> None:
    cfg = config()
    change(cfg)
    assert _problems(cfg) == [line]


def test_plan_json_carries_the_overlay() -> None:
    document = make_plan(read_stack("s", config())).to_json()["overlay"]
    assert document["on"] is True and document["cidr"] == "10.99.0.0/16"
    assert len(document["members"]) == 6
    assert [HUB, "office.rack-2"] in document["links"]
    assert not any(re.search("(?i)private", str(m)) for m in document["members"])


def _plan_cli(tmp_path: Path, cfg: dict[str, Any]) -> Result:
    (tmp_path / "Pulumi.s.yaml").write_text(yaml.safe_dump({"config": cfg}))
    return CliRunner().invoke(main, ["plan", "--stack", "s", "--stacks-dir", str(tmp_path)])


def test_denv_plan_lists_the_overlay_the_deploy_brings_up(tmp_path: Path) -> None:
    result = _plan_cli(tmp_path, config())
    assert result.exit_code == 0, result.output
    assert (
        "Overlay: on, WireGuard 10.99.0.0/16 on udp/51820, 6 machines, 5 links; the balancer "
        "reaches these nodes through it" in " ".join(result.output.split())
    )
    assert "plain HTTP" not in result.output and "overlay up yet" not in result.output
    assert "dials out (behind NAT)" in result.output
    assert "overlay" not in result.stderr


def test_denv_plan_warns_when_the_overlay_is_off_across_sites(tmp_path: Path) -> None:
    cfg = config(overlay={"enabled": False})
    cfg["denv:sites"][1]["nodes"][1].pop("behind_nat")
    result = _plan_cli(tmp_path, cfg)
    assert result.exit_code == 0, result.output
    assert "Overlay: off (balancer.overlay.enabled: false; traffic to nodes is plain HTTP)" in (
        result.output
    )
    assert "warning: balancer.overlay.enabled: false sends prompts" in result.stderr
