"""The overlay area of the node deploy: install, write 0600, bring up, then nothing to do."""

from __future__ import annotations

import dataclasses

import pytest

from denv_iac.core.overlay_plan import CONFIG_PATH
from denv_iac.node import NodeDeploySpec, NodeSpecError, ReplicaSpec, agent, plan_node, replicas
from denv_iac.node.facts import NodeFacts
from denv_iac.node.plan import fact_query, removal_steps
from denv_iac.node.steps import Step, wants_link
from denv_iac.node.wireguard import PACKAGE, UNIT, config_file, plan

from .fixtures import converged, node_facts
from .test_plan import FRESH as FRESH_PACKAGES

CONFIG = (
    "[Interface]\nAddress = 10.99.4.7/16\nListenPort = 51820\n"
    "PrivateKey = yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=\n\n"
    "[Peer]\nPublicKey = xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=\n"
    "AllowedIPs = 10.99.9.1/32\nEndpoint = 203.0.113.5:51820\n"
)
PEER_ADDED = CONFIG + "\n[Peer]\nPublicKey = TrMvSoP4jYQlY6RIzBgbssQqY3vxI2Pi+y71lOWWXX0=\n"
MOVED = CONFIG.replace("10.99.4.7/16", "10.99.4.8/16")


def applied(facts: NodeFacts, steps: list[Step]) -> NodeFacts:
    """The node after the steps, as the next probe would read it."""
    packages, files = dict(facts.packages), dict(facts.files)
    links, units = dict(facts.links), set(facts.active_units)
    for step in steps:
        if step.file is not None:
            files[step.file.path] = step.file.sha256
        for command in step.commands:
            if PACKAGE in command and "install" in command:
                packages[PACKAGE] = "1.0.20210914-1"
            if "enable" in command or "ln -sfn" in command:
                links[wants_link(UNIT)] = "/lib/systemd/system/wg-quick@.service"
            if "--now" in command:
                units.add(UNIT)
    return dataclasses.replace(
        facts, packages=packages, files=files, links=links, active_units=frozenset(units)
    )


FRESH = NodeFacts(os_id="debian", os_version="12", systemd=True)
UP = applied(FRESH, plan(FRESH, CONFIG))


def titles(steps: list[Step]) -> list[str]:
    return [step.title for step in steps]


CASES = [
    (
        "fresh machine",
        FRESH,
        CONFIG,
        ["install wireguard-tools", "write the denv0 config", "bring denv0 up"],
    ),
    ("already up", UP, CONFIG, []),
    ("not on the overlay", FRESH, None, []),
    (
        "a peer added elsewhere",
        UP,
        PEER_ADDED,
        ["write the denv0 config", "apply the changed peers to denv0"],
    ),
    (
        "the interface went down",
        dataclasses.replace(UP, active_units=frozenset()),
        CONFIG,
        ["bring denv0 up"],
    ),
    (
        "no systemd (a chroot)",
        dataclasses.replace(FRESH, systemd=False),
        CONFIG,
        [
            "install wireguard-tools",
            "write the denv0 config",
            "enable wg-quick@denv0.service (not started: no systemd)",
        ],
    ),
    (
        "up but not enabled at boot",
        dataclasses.replace(UP, links={}),
        CONFIG,
        ["enable wg-quick@denv0.service at boot"],
    ),
]


@pytest.mark.parametrize(
    ("facts", "config", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_overlay_steps(facts: NodeFacts, config: str | None, expected: list[str]) -> None:
    steps = plan(facts, config)
    assert titles(steps) == expected
    assert plan(applied(facts, steps), config) == []  # a second run changes nothing


def test_the_config_is_written_readable_by_root_only() -> None:
    (write,) = [step for step in plan(FRESH, CONFIG) if step.file is not None]
    assert write.file == config_file(CONFIG)
    assert (write.file.path, write.file.mode, write.file.private) == (CONFIG_PATH, "0600", True)
    # Its content holds the private key: a step's description never shows it.
    assert "PrivateKey" not in "\n".join(write.describe()) and "PrivateKey" not in repr(write)


def test_a_changed_config_reloads_and_restarts_only_for_a_moved_address() -> None:
    (apply,) = [s for s in plan(UP, PEER_ADDED) if s.title.startswith("apply")]
    assert apply.commands == (
        f"systemctl enable {UNIT}",
        f"systemctl reload {UNIT}",
        "ip -4 -o address show dev denv0 | grep -qF 'inet 10.99.4.7/16 ' "
        f"|| systemctl restart {UNIT}",
    )
    (moved,) = [s for s in plan(UP, MOVED) if s.title.startswith("apply")]
    assert "'inet 10.99.4.8/16 '" in moved.commands[-1]
    assert all(PACKAGE not in command for command in apply.commands + moved.commands)


def test_a_config_with_an_mtu_sets_it_in_place_on_a_running_interface() -> None:
    # wg-quick sets MTU only at `up`, and syncconf ignores it: an interface up from before the
    # config had one would keep the route's MTU (8921 on an AWS jumbo-frame link).
    with_mtu = PEER_ADDED.replace("ListenPort = 51820\n", "ListenPort = 51820\nMTU = 1420\n")
    (apply,) = [s for s in plan(UP, with_mtu) if s.title.startswith("apply")]
    assert apply.commands[-1] == "ip link set dev denv0 mtu 1420"
    assert apply.commands[:2] == (f"systemctl enable {UNIT}", f"systemctl reload {UNIT}")


def test_a_config_without_an_address_is_refused() -> None:
    with pytest.raises(ValueError, match="no Address line"):
        plan(UP, "[Interface]\nListenPort = 51820\n")


# The whole node deploy, on the overlay: the firewall first, then the interface, then what
# binds its address.
NODE = NodeDeploySpec(
    node_id="aws-use1.node-0",
    replicas=(ReplicaSpec("voice.aws-use1.node-0.0", "ghcr.io/acme/voice:1.4", 8000, 0),),
    balancer_addresses=("10.99.0.9",),
    listen_address="10.99.4.7",
    overlay_senders=("203.0.113.10",),
)


def test_the_node_deploy_brings_the_overlay_up_after_the_firewall_and_before_its_users() -> None:
    steps = plan_node(node_facts(), NODE, CONFIG)
    areas = [step.area for step in steps]
    first_overlay = areas.index("overlay")
    assert max(i for i, a in enumerate(areas) if a == "firewall") < first_overlay
    assert first_overlay < min(areas.index(a) for a in ("agent", "replicas"))
    # Installing wireguard-tools needs the package index: refreshed once, first.
    assert steps[0].title == "refresh the package index"
    after = applied(converged(node_facts(), NODE, FRESH_PACKAGES), steps)
    assert plan_node(after, NODE, CONFIG) == []
    assert CONFIG_PATH in fact_query(NODE).files and UNIT in fact_query(NODE).units


def test_leaving_the_stack_takes_the_interface_down_and_its_key_off_the_machine() -> None:
    up = applied(
        converged(node_facts(), NODE, FRESH_PACKAGES), plan_node(node_facts(), NODE, CONFIG)
    )
    steps = removal_steps(up, NODE)
    areas = [step.area for step in steps]
    # After the replicas (they Require the interface), before the firewall that guards it.
    assert areas.index("overlay") < areas.index("firewall")
    (down,) = [step for step in steps if step.area == "overlay"]
    assert down.commands == (
        f"systemctl disable --now {UNIT}",
        f"rm -f {CONFIG_PATH} {wants_link(UNIT)}",
    )
    files = {k: v for k, v in up.files.items() if k != CONFIG_PATH}
    links = {k: v for k, v in up.links.items() if k != wants_link(UNIT)}
    gone = dataclasses.replace(up, files=files, links=links, active_units=up.active_units - {UNIT})
    assert [step for step in removal_steps(gone, NODE) if step.area == "overlay"] == []


def test_off_the_overlay_the_node_deploy_has_no_overlay_step() -> None:
    off = dataclasses.replace(NODE, listen_address="", overlay_senders=())
    assert "overlay" not in {step.area for step in plan_node(node_facts(), off)}


def test_the_agent_and_replicas_listen_on_the_overlay_address_only() -> None:
    agent_config = agent.config(NODE).content.decode()
    assert 'agent_check = "10.99.4.7:9100"' in agent_config
    assert 'http = "127.0.0.1:9101"' in agent_config  # the control endpoint stays local
    start = _exec_start(replicas.unit(NODE, NODE.replicas[0]).content.decode())
    assert "-p 10.99.4.7:8000:8000 -p 127.0.0.1:8000:8000" in start
    assert "--network=host" not in start
    # Off the overlay: every address, as before (the firewall guards them).
    off = dataclasses.replace(NODE, listen_address="", overlay_senders=())
    assert 'agent_check = "0.0.0.0:9100"' in agent.config(off).content.decode()
    start = _exec_start(replicas.unit(off, off.replicas[0]).content.decode())
    assert "--network=host" in start and " -p " not in start


def _exec_start(unit: str) -> str:
    return next(line for line in unit.splitlines() if line.startswith("ExecStart="))


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {"listen_address": "fd00::7"},
            "listen_address 'fd00::7': give the node's IPv4 overlay address, "
            'or "" when it is not on the overlay',
        ),
        ({"overlay_port": 0}, "overlay_port 0: give a UDP port, 1-65535"),
        ({"overlay_senders": ("peer.example",)}, "overlay_senders 'peer.example': give an IP"),
    ],
)
def test_a_bad_overlay_field_is_refused_naming_it(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(NodeSpecError) as refused:
        dataclasses.replace(NODE, **fields)  # type: ignore[arg-type]
    (line,) = refused.value.problems
    assert line.startswith(problem)
