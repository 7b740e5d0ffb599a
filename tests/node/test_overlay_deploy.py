"""The overlay area of the node deploy: install, write 0600, bring up, then nothing to do."""

from __future__ import annotations

import dataclasses

import pytest

from denv_iac.node.facts import NodeFacts
from denv_iac.node.overlay import PACKAGE, UNIT, config_file, plan
from denv_iac.node.steps import Step, wants_link
from denv_iac.overlay import CONFIG_PATH

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


def test_a_config_without_an_address_is_refused() -> None:
    with pytest.raises(ValueError, match="no Address line"):
        plan(UP, "[Interface]\nListenPort = 51820\n")
