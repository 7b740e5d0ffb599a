"""stacks/__main__.py under mocks, with config as a real `pulumi up` hands it over."""

import json
import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulumi
import pytest

from denv_iac.stacks_dir import load_stack_config
from tests.components import stacks
from tests.components.harness import plain_strings, run_program

PROGRAM = Path(__file__).parents[2] / "stacks" / "__main__.py"


def _decrypted(value: Any) -> Any:
    """Config as the engine gives it to a program: `{secure: ...}` values decrypted."""
    if isinstance(value, dict):
        if set(value) == {"secure"}:
            return value["secure"]
        return {k: _decrypted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decrypted(v) for v in value]
    return value


def _has_secure(value: Any) -> bool:
    if isinstance(value, dict):
        return set(value) == {"secure"} or any(_has_secure(v) for v in value.values())
    return isinstance(value, list) and any(_has_secure(v) for v in value)


@pytest.fixture
def stack_config() -> Iterator[Any]:
    def use(config: dict[str, Any]) -> None:
        pulumi.runtime.set_all_config(
            {key: json.dumps(_decrypted(value)) for key, value in config.items()},
            secret_keys=[k for k in config if k != "denv:recipes" or _has_secure(config[k])],
        )

    yield use
    pulumi.runtime.set_all_config({})


def _program() -> dict[str, pulumi.Output[Any]]:
    namespace = runpy.run_path(str(PROGRAM))
    cluster = namespace["cluster"]
    return {"endpoint": cluster.endpoint, "replicas": cluster.replica_ids}


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_program_builds_the_cluster_and_keeps_config_secrets_secret(
    stack_config: Any, preview: bool
) -> None:
    args = stacks.multicloud()
    stack_config(
        {
            "denv:sites": args["sites"],
            "denv:recipes": args["recipes"],
            "denv:balancer": args["balancer"],
        }
    )
    run = run_program(_program, preview=preview)
    assert len(run.of_type("aws:ec2/instance:Instance")) == 4
    for registration in run.registrations:
        strings = plain_strings(registration.inputs)
        for secret in stacks.SECRETS:
            for line in secret.splitlines()[1:-1]:
                assert not any(line in s for s in strings), registration.name
    if not preview:
        assert len(run.outputs["replicas"]) == 7
        assert run.outputs["endpoint"].startswith("https://")


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_a_secure_env_value_handed_over_decrypted_stays_a_secret(
    stack_config: Any, preview: bool
) -> None:
    args = stacks.multicloud()
    args["recipes"][2]["env"] = {"HF_TOKEN": {"secure": "hf_DECRYPTED-BY-THE-ENGINE"}}
    stack_config({f"denv:{key}": args[key] for key in ("sites", "recipes", "balancer")})
    run = run_program(_program, preview=preview)
    deploys = run.of_type("pulumi-python:dynamic/denv:NodeDeployment")
    assert sum("secret_env" in r.inputs for r in deploys) == 2  # the two Hetzner nodes
    for registration in run.registrations:
        strings = plain_strings(registration.inputs)
        assert not any("DECRYPTED" in s for s in strings), registration.name


def test_program_runs_the_shipped_local_stack(stack_config: Any) -> None:
    stack_config(load_stack_config(PROGRAM.parent, "local"))
    run = run_program(_program, preview=False)
    assert run.outputs["endpoint"] == "http://127.0.0.1:8080"
    assert run.outputs["replicas"] == [
        "voice.local.node-a.0",
        "voice.local.node-b.0",
        "side.local.node-a.1.0",
        "side.local.node-b.1.0",
        "tts.local.node-a.1.1",
        "tts.local.node-b.1.1",
        "stt.local.node-a.1.2",
        "stt.local.node-b.1.2",
    ]
