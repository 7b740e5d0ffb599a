"""A node deploy through a firewall like Hetzner Robot's: stateless, on the VM's switch port,
with input and output rules, the very rules the product sends to Robot (`robot_rules` and
`OUTPUT_RULES`). With the input rules alone, as before output rules were sent, the box's own
packets are discarded, SSH replies included, and the deploy cannot even connect; with the
output rule too, it joins the node, the node dials out, and the input rules still keep
everyone else from SSH.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from denv_iac.core.ingress import IngressRule, ssh_rules
from denv_iac.core.robot_firewall import OUTPUT_RULES, robot_rules
from denv_iac.core.stack.ports import AGENT_PORT
from tests.vm.bed import HOST, OUTSIDE, Bed, Vm
from tests.vm.conftest import TIMINGS
from tests.vm.robot_filter import set_robot_filter
from tests.vm.standin_vm import make_gpu_machine
from tests.vm.test_join import in_netns, props, provider, reach, units
from tests.vm.test_nat import connect

pytestmark = pytest.mark.vm

# The site's rows as `site_ingress_rules` makes them with the overlay off: SSH from the admin
# (the deployer), the agent and replica ports from the balancer host (the same address here).
ROWS = (
    *ssh_rules((f"{HOST}/32",)),
    IngressRule("agent-from-edge", "agent", AGENT_PORT, AGENT_PORT, "edge", from_machine=True),
    IngressRule("voice-from-edge", "voice", 8000, 8001, "edge", from_machine=True),
)
INPUT_RULES = robot_rules(ROWS, {"edge": HOST})
DIAL_PORT = 7100  # a listener on the bed's side: a mirror or registry the node pulls from


@pytest.fixture(scope="module")
def node(bed: Bed) -> Vm:
    vm = bed.start("gex1")
    TIMINGS["boot to SSH"] = vm.wait_ssh()
    make_gpu_machine(vm, bed.workdir)
    # The bed's SSH connection would outlive a filter change: each check below dials anew.
    vm.close_shared_connection()
    return vm


def test_1_without_output_rules_the_deploy_cannot_reach_the_box(bed: Bed, node: Vm) -> None:
    set_robot_filter(bed, node, INPUT_RULES, ())
    start = time.monotonic()
    code, _, err = in_netns(
        bed, "tests.vm.provider_call", {"method": "create", "args": [props(bed, node)]}, 180
    )
    TIMINGS["deploy refused by input rules alone"] = time.monotonic() - start
    assert code != 0
    assert f"cannot connect to {node.address}" in err, err[-2000:]
    assert reach(bed, node, [(HOST, 22)]) == {(HOST, 22): "timeout"}


def test_2_with_the_output_rule_the_deploy_joins_and_the_input_rules_still_hold(
    bed: Bed, node: Vm
) -> None:
    set_robot_filter(bed, node, INPUT_RULES, OUTPUT_RULES)
    # Before the deploy, sshd answers anyone the switch port lets through: the admin only.
    assert reach(bed, node, [(OUTSIDE, 22), (HOST, 22)]) == {
        (OUTSIDE, 22): "timeout",
        (HOST, 22): "open",
    }
    start = time.monotonic()
    created = provider(bed, "create", props(bed, node))
    TIMINGS["join through Robot's rules"] = time.monotonic() - start
    assert created["outs"]["applied"], "a fresh machine needs steps"
    assert len([u for u in units(node) if u.startswith("denv-replica-")]) == 2, units(node)

    # The box's own connections out (apt, image pulls) and their replies back in.
    listener = subprocess.Popen(
        [
            "ip", "netns", "exec", bed.netns, sys.executable, "-c",
            "import socket, time; s = socket.create_server("
            f"({HOST!r}, {DIAL_PORT})); time.sleep(60)",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(1)
        assert connect(node, HOST, DIAL_PORT) == "open"
    finally:
        listener.kill()
        listener.wait()
    # After it too (the node's own nftables now filter as well): SSH and the agent answer the
    # admin and balancer address only.
    seen = reach(bed, node, [(OUTSIDE, 22), (OUTSIDE, AGENT_PORT), (HOST, 22), (HOST, AGENT_PORT)])
    assert seen == {
        (OUTSIDE, 22): "timeout",
        (OUTSIDE, AGENT_PORT): "timeout",
        (HOST, 22): "open",
        (HOST, AGENT_PORT): "open",
    }
