"""A Hetzner site with Robot webservice credentials gets each GEX box's Robot firewall."""

from typing import Any

import pytest

from denv_iac.components.preview import shown
from denv_iac.core.robot_firewall import OUTPUT_RULES
from denv_iac.core.stack.reader import StackError
from tests.components import stacks
from tests.components.harness import Run, cluster_outputs, plain_strings, run_program
from tests.test_robot_api import check_rule

FIREWALL = "pulumi-python:dynamic/hetzner:RobotFirewall"
USER, PASSWORD = "#ws+ROBOT-USER-MATERIAL", "ROBOT-PASSWORD-MATERIAL"


def _args(**hetzner: Any) -> Any:
    args = stacks.multicloud()
    site = next(s for s in args["sites"] if s["kind"] == "hetzner")
    site.update(robot_user={"secure": USER}, robot_password={"secure": PASSWORD}, **hetzner)
    return args


def _run(args: Any, preview: bool = False) -> Run:
    return run_program(lambda: cluster_outputs(args), preview=preview)


@pytest.mark.parametrize(
    ("overlay", "balancer_ports"),
    [
        # The overlay on (the default): WireGuard only; replicas and agent ride the tunnel.
        ({}, {("udp", "51820")}),
        ({"enabled": False}, {("tcp", "8000-8007"), ("tcp", "9100")}),
    ],
    ids=["overlay", "overlay-off"],
)
def test_each_box_gets_its_firewall_from_the_balancer_hosts_addresses(
    overlay: dict[str, Any], balancer_ports: set[tuple[str, str]]
) -> None:
    args = _args()
    args["balancer"]["overlay"] = overlay
    run = _run(args)
    firewalls = sorted(run.of_type(FIREWALL), key=lambda r: r.name)
    assert [r.name for r in firewalls] == [
        "prod-hetzner-fsn-robot-firewall-gex-1",
        "prod-hetzner-fsn-robot-firewall-gex-2",
    ]
    (site,) = run.of_type("denv:index:HetznerSite")
    assert {r.parent for r in firewalls} == {site.urn}
    assert [shown(r.inputs)["address"] for r in firewalls] == ["203.0.113.21", "203.0.113.22"]
    rules = shown(firewalls[0].inputs)["rules"]
    assert len(rules) <= 10
    for n, rule in enumerate(rules):
        check_rule(n, rule)
    sources = {rule.get("src_ip") for rule in rules}
    hosts = {f"{address}/32" for address in run.outputs["balancer_addresses"]}
    assert len(hosts) == 2 and hosts <= sources
    assert sources - hosts == {stacks.ADMIN, None}  # SSH from admins; replies from anywhere
    for host in hosts:
        opened = {(r["protocol"], r["dst_port"]) for r in rules if r.get("src_ip") == host}
        assert opened == balancer_ports, host


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_the_webservice_credentials_are_secrets_everywhere(preview: bool) -> None:
    run = _run(_args(), preview)
    assert run.of_type(FIREWALL)
    for registration in run.registrations:
        strings = plain_strings(registration.inputs)
        assert not any(USER in s or PASSWORD in s for s in strings), registration.name
    for firewall in run.of_type(FIREWALL):
        shown_inputs = shown(firewall.inputs)
        assert (shown_inputs["robot_user"], shown_inputs["robot_password"]) == ("[secret]",) * 2


def test_without_credentials_no_robot_firewall_is_set() -> None:
    assert _run(stacks.multicloud()).of_type(FIREWALL) == []


@pytest.mark.parametrize(
    ("overlay", "admins"),
    [({}, 5), ({"enabled": False}, 4)],
    ids=["overlay", "overlay-off"],
)
def test_each_balancer_host_counts_towards_robots_ten_rules(
    overlay: dict[str, Any], admins: int
) -> None:
    """Eleven rules with two balancer hosts, ten if both were counted as one source."""
    args = _args(admin_cidrs=[f"192.0.2.{i * 8}/29" for i in range(admins)])
    args["balancer"]["overlay"] = overlay
    run = Run()
    with pytest.raises(StackError) as raised:
        run_program(lambda: cluster_outputs(args), preview=False, run=run)
    (problem,) = raised.value.problems
    assert problem.startswith("sites: hetzner-fsn: the Robot firewall takes at most 10 input rules")
    assert "needs 11 " in problem and run.of_type(FIREWALL) == []


def test_more_rules_than_robot_takes_is_one_line_and_no_firewall() -> None:
    admins = [f"192.0.2.{i * 8}/29" for i in range(7)]
    run = Run()
    with pytest.raises(StackError) as raised:
        run_program(lambda: cluster_outputs(_args(admin_cidrs=admins)), preview=False, run=run)
    (problem,) = raised.value.problems
    assert problem.startswith("sites: hetzner-fsn: the Robot firewall takes at most 10 input rules")
    assert run.of_type(FIREWALL) == []


def test_each_box_allows_its_own_traffic_out_and_its_deploy_waits_for_its_firewall() -> None:
    run = _run(_args())
    firewalls = {shown(r.inputs)["address"]: r for r in run.of_type(FIREWALL)}
    for firewall in firewalls.values():
        assert shown(firewall.inputs)["output_rules"] == list(OUTPUT_RULES)
    deploys = {
        r.name: r
        for r in run.of_type("pulumi-python:dynamic/denv:NodeDeployment")
        if r.name.startswith("prod-hetzner-fsn-")
    }
    assert sorted(deploys) == [
        "prod-hetzner-fsn-gex-1-setup-deploy",
        "prod-hetzner-fsn-gex-2-setup-deploy",
    ]
    for node, address in (("gex-1", "203.0.113.21"), ("gex-2", "203.0.113.22")):
        waits = deploys[f"prod-hetzner-fsn-{node}-setup-deploy"].dependencies
        assert firewalls[address].urn in waits, node
        others = {r.urn for a, r in firewalls.items() if a != address}
        assert not others & set(waits), f"{node} waits for another box's firewall"
