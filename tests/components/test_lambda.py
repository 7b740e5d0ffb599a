"""LambdaSite in a Cluster under Pulumi's mocks: its dynamic resources, at `up` and at preview."""

import base64
import copy
from collections.abc import Callable
from typing import Any

import pytest

from denv_iac.components.cluster import validate_cluster
from denv_iac.components.lambda_cloud import ssh_key_name, wire_rules
from denv_iac.components.preview import SECRET_MARK, SECRET_SIG
from denv_iac.components.secrets import public_key_of
from denv_iac.core.overlay_plan import plan_overlay
from denv_iac.core.stack.reader import StackError
from tests.components import stacks
from tests.components.harness import Run, cluster_outputs, plain_strings, run_program
from tests.components.snapshots import assert_golden, site_snapshot
from tests.lambda_spec import check_request

PREVIEW = pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
INSTANCE = "pulumi-python:dynamic/lambda:Instance"
API_KEY = "test-lambda-api-key-not-a-real-one-0123456789"
SSH_KEY = stacks._private_key(7)
LAMBDA_SITE = {
    "name": "lambda-use1",
    "kind": "lambda",
    "region": "us-east-1",
    "instance_type": "gpu_1x_h100_pcie",
    "max_nodes": 4,
    "admin_cidrs": [stacks.ADMIN],
    "api_key": {"secure": API_KEY},
    "ssh_private_key": {"secure": SSH_KEY},
}


def lambda_stack() -> dict[str, Any]:
    """Voice on Lambda H100s, behind a balancer on the Hetzner site of the multicloud stack."""
    args: dict[str, Any] = dict(stacks.multicloud())
    hetzner = next(s for s in args["sites"] if s["name"] == "hetzner-fsn")
    assist = next(r for r in args["recipes"] if r["name"] == "assist")
    voice = next(r for r in args["recipes"] if r["name"] == "voice")
    voice["sites"] = ["lambda-use1"]
    args["sites"] = [copy.deepcopy(LAMBDA_SITE), hetzner]
    args["recipes"] = [voice, assist | {"image": "vllm/vllm-openai:v0.11.0"}]
    args["balancer"]["sites"] = ["hetzner-fsn"]
    return args


def _run(preview: bool, args: Any = None) -> Run:
    return run_program(lambda: cluster_outputs(args or lambda_stack()), preview=preview)


@PREVIEW
def test_one_instance_per_node_launched_with_the_sites_key_and_filesystem(preview: bool) -> None:
    run = _run(preview)
    site = run.named("prod-lambda-use1")
    assert site.type == "denv:index:LambdaSite" and not site.custom
    assert [r.name for r in run.of_type(INSTANCE)] == [
        f"prod-lambda-use1-node-{i}" for i in range(3)
    ]
    firewall = run.named("prod-lambda-use1-fw")
    assert firewall.type == "pulumi-python:dynamic/lambda:FirewallRuleset"
    for instance in run.of_type(INSTANCE):
        assert instance.parent == site.urn
        if not preview:  # launched with the site's ruleset (its id is unknown in a preview)
            assert instance.inputs["firewall_rulesets"] == [f"{firewall.name}-id"]
            # The key's name carries a digest of the key (known once the secret is read).
            key_name = ssh_key_name(public_key_of(SSH_KEY), "prod", "lambda-use1")
            assert instance.inputs["ssh_key_names"] == [key_name]
            assert key_name.startswith("prod-lambda-use1-")
        skip = ("__provider", "api_key", "firewall_rulesets", "ssh_key_names")
        assert {k: v for k, v in instance.inputs.items() if k not in skip} == {
            "name": instance.name,
            "region": "us-east-1",
            "instance_type": "gpu_1x_h100_pcie",
            "file_system_names": ["prod-lambda-use1-cache"],
        }
    cache = run.named("prod-lambda-use1-cache")
    assert cache.type == "pulumi-python:dynamic/lambda:FileSystem"
    assert (cache.inputs["name"], cache.inputs["region"]) == ("prod-lambda-use1-cache", "us-east-1")
    key = run.named("prod-lambda-use1-key")
    assert key.type == "pulumi-python:dynamic/lambda:SshKey"
    if not preview:
        assert key.inputs["public_key"] == public_key_of(SSH_KEY)


def _overlay_off() -> dict[str, Any]:
    args = lambda_stack()
    args["balancer"]["overlay"] = {"enabled": False}
    return args


@pytest.mark.parametrize(
    ("args", "balancer_rules"),
    [
        # The overlay on (the default): WireGuard only; replicas and agent ride the tunnel.
        (lambda_stack, [("udp", "WireGuard from overlay peer hetzner-fsn", (51820, 51820))]),
        (
            _overlay_off,
            [
                ("tcp", "agent-check from balancer hetzner-fsn", (9100, 9100)),
                ("tcp", "voice replicas from balancer hetzner-fsn", (8000, 8007)),
            ],
        ),
    ],
    ids=["overlay", "overlay-off"],
)
def test_the_ruleset_opens_the_balancer_its_ports_and_ssh_to_admins(
    args: Callable[[], dict[str, Any]], balancer_rules: list[tuple[str, str, tuple[int, int]]]
) -> None:
    run = _run(preview=False, args=args())
    firewall = run.named("prod-lambda-use1-fw").inputs
    balancer = run.outputs["balancer_addresses"][0]
    rules = sorted(
        (r["protocol"], r["description"], tuple(r["port_range"]), r["source_network"])
        for r in firewall["rules"]
    )
    assert (firewall["name"], firewall["region"]) == ("prod-lambda-use1", "us-east-1")
    ssh = ("tcp", f"SSH from admin {stacks.ADMIN}", (22, 22), stacks.ADMIN)
    assert rules == sorted([ssh, *((*r, f"{balancer}/32") for r in balancer_rules)])
    body = {"name": "n", "region": "us-east-1", "rules": wire_rules(firewall["rules"])}
    check_request("POST", "/api/v1/firewall-rulesets", body)  # the shape Lambda takes


@pytest.mark.parametrize("overlay", [True, False], ids=["overlay", "overlay-off"])
def test_the_balancer_routes_voice_to_the_lambda_instances_addresses(overlay: bool) -> None:
    args = lambda_stack() if overlay else _overlay_off()
    run = _run(preview=False, args=args)
    config = run.outputs["haproxy_config"]
    servers = [line.split()[1:3] for line in config.splitlines() if "server voice." in line]
    # Each replica is one server of its tier and one of each twin (realtime, speech).
    names = [f"voice.lambda-use1.node-{i}.0" for i in range(3)]
    assert [s[0] for s in servers] == names * 3
    # Through the tunnel at the nodes' overlay addresses; with it off, at their public ones.
    if overlay:
        stack, placement, _ = validate_cluster("prod", args)
        plan = plan_overlay(stack, placement)
        expected = {f"{plan.address_of('lambda-use1', f'node-{i}')}:8000" for i in range(3)}
    else:
        expected = {a for _, a in servers if a.startswith("198.18.") and a.endswith(":8000")}
    assert {address for _, address in servers} == expected and len(expected) == 3


def test_registered_inputs_match_the_golden_snapshot() -> None:
    assert_golden(site_snapshot(_run(preview=False), "prod-lambda-use1"), "lambda.json")


@PREVIEW
def test_two_runs_register_identical_inputs(preview: bool) -> None:
    first, second = _run(preview), _run(preview)
    assert first.of_type(INSTANCE) != []
    assert first.by_urn() == second.by_urn()


def _site_resources(run: Run) -> dict[str, dict[str, Any]]:
    return {urn: inputs for urn, inputs in run.by_urn().items() if "::prod-lambda-use1" in urn}


def test_raising_min_warm_by_one_adds_exactly_one_instance() -> None:
    before = _site_resources(_run(preview=False))
    raised = lambda_stack()
    raised["recipes"][0]["min_warm"] = 3
    after = _site_resources(_run(False, raised))
    assert {urn: after[urn] for urn in before} == before
    added = sorted(urn.rsplit("::", 1)[-1] for urn in set(after) - set(before))
    # the instance, and the node deploy that sets it up once it has an address
    assert added == [
        "prod-lambda-use1-node-3",
        "prod-lambda-use1-node-3-setup",
        "prod-lambda-use1-node-3-setup-deploy",
    ]


def _unwrapped_secrets(value: Any) -> list[str]:
    """The plaintext inside every secret of serialized inputs."""
    if isinstance(value, dict):
        if value.get(SECRET_SIG) == SECRET_MARK:
            return [str(value.get("value", ""))]
        return [s for v in value.values() for s in _unwrapped_secrets(v)]
    if isinstance(value, list):
        return [s for v in value for s in _unwrapped_secrets(v)]
    return []


@PREVIEW
def test_the_api_key_and_ssh_key_are_secrets_in_every_input(preview: bool) -> None:
    run = _run(preview)
    key_lines = SSH_KEY.splitlines()[1:-1]
    for registration in run.registrations:
        strings = plain_strings(registration.inputs)
        assert not any(API_KEY in s for s in strings), registration.name
        assert not any(line in s for s in strings for line in key_lines), registration.name
    dynamic = [r for r in run.registrations if r.type.startswith("pulumi-python:dynamic/lambda:")]
    assert len(dynamic) == 6  # SSH key, cache filesystem, firewall ruleset, three instances
    for registration in dynamic:
        assert registration.inputs["api_key"][SECRET_SIG] == SECRET_MARK
        # the serialized provider holds code and settings, never the key it is given
        (provider,) = _unwrapped_secrets(registration.inputs["__provider"])
        assert API_KEY.encode() not in base64.b64decode(provider)


def _refused(args: Any) -> tuple[list[str], Run]:
    run = Run()
    with pytest.raises(StackError) as error:
        run_program(lambda: cluster_outputs(args), preview=False, run=run)
    return error.value.problems, run


def test_an_unknown_instance_type_is_one_line_and_nothing_is_registered() -> None:
    args = lambda_stack()
    args["sites"][0]["instance_type"] = "gpu_1x_h100"
    del args["recipes"][0]["gpu_models"]  # else the recipe's H100s are missing too
    problems, run = _refused(args)
    assert len(problems) == 1
    assert problems[0].startswith(
        'sites[0].instance_type: "gpu_1x_h100" is not a GPU offering we know on lambda; use one of '
    )
    assert "gpu_1x_h100_pcie" in problems[0]
    assert run.registrations == []


def test_a_missing_or_plaintext_api_key_is_refused_without_echoing_it() -> None:
    args = lambda_stack()
    args["sites"][0]["api_key"] = API_KEY
    problems, run = _refused(args)
    assert [p.split(":")[0] for p in problems] == ["sites[0].api_key"]
    assert API_KEY not in problems[0] and run.registrations == []
    del args["sites"][0]["api_key"]
    problems, _ = _refused(args)
    assert problems[0].startswith("sites[0].api_key: missing")
