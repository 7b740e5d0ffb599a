"""Dynamic resources leave `pickle` as they found it, however many a program registers."""

import pickle
from typing import Any

import pulumi

from denv_iac.components.dynamic_resource import whole_numbers
from denv_iac.components.lambda_cloud import LambdaSshKey
from denv_iac.components.node_setup import NodeDeployment
from denv_iac.components.preview import run_program

# pulumi.dynamic adds a frame per serialization without the guard: ~970 calls overflow the stack.
MORE_THAN_THE_STACK_HOLDS = 1100


def _patched_methods() -> tuple[Any, Any]:
    pickler: Any = pickle._Pickler
    return pickler.__dict__["_batch_setitems"], pickler.__dict__["save_dict"]


def test_registering_a_dynamic_resource_leaves_the_pickler_unpatched() -> None:
    before = _patched_methods()

    def program() -> dict[str, pulumi.Output[Any]]:
        key = LambdaSshKey("key", {"api_key": "k", "name": "n", "public_key": "ssh-ed25519 A"})
        NodeDeployment("deploy", {"host": "198.18.0.1"}, pulumi.ResourceOptions())
        return {"name": key.name}

    run = run_program(program, preview=True)
    assert [r.name for r in run.registrations] == ["key", "deploy"]
    assert _patched_methods() == before


def test_a_program_registers_more_dynamic_resources_than_the_stack_is_deep() -> None:
    def program() -> dict[str, pulumi.Output[Any]]:
        keys = [
            LambdaSshKey(f"key-{i}", {"api_key": "k", "name": f"n{i}", "public_key": "A"})
            for i in range(MORE_THAN_THE_STACK_HOLDS)
        ]
        return {"last": keys[-1].name}

    run = run_program(program, preview=True)
    assert len(run.registrations) == MORE_THAN_THE_STACK_HOLDS
    assert run.outputs["last"] == f"n{MORE_THAN_THE_STACK_HOLDS - 1}"


def test_whole_numbers_are_ints_again_at_any_depth() -> None:
    # The engine hands a dynamic provider every number as a float (node state, Lambda's rules).
    state = {"port": 9300.0, "rules": [{"port_range": [22.0, 22.0], "weight": 0.5}], "on": True}
    assert whole_numbers(state) == {
        "port": 9300,
        "rules": [{"port_range": [22, 22], "weight": 0.5}],
        "on": True,
    }
    assert type(whole_numbers(state)["port"]) is int
    assert whole_numbers((1.0, "2.0", None)) == [1, "2.0", None]
