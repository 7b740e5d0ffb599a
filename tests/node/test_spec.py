"""Node spec validation: one line per problem, naming the field and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from denv_iac.core.agent_config import AgentProbe, recipe_probe
from denv_iac.core.placement import place_replicas
from denv_iac.core.stack.model import QUIET_CONNECTION_S
from denv_iac.core.stack.reader import read_stack
from denv_iac.node import NodeDeploySpec, NodeSpecError, ReplicaSpec, load_spec, spec_from_json
from denv_iac.node.from_stack import node_deploy_specs
from denv_iac.node.spec import spec_to_json
from tests.components import stacks


def problems(**fields: object) -> list[str]:
    with pytest.raises(NodeSpecError) as error:
        NodeDeploySpec(**{"node_id": "n1", **fields})  # type: ignore[arg-type]
    return error.value.problems


def test_bad_fields_are_named_with_their_fix() -> None:
    assert problems(driver_branch="r580") == [
        "driver_branch 'r580': give the branch number, e.g. '580'"
    ]
    assert problems(balancer_addresses=("lb.example.com",)) == [
        "balancer_addresses 'lb.example.com': give an IP address or CIDR"
    ]
    clash = (ReplicaSpec("a", "img", 9100, 0),)
    assert problems(replicas=clash) == ["replica 'a' port 9100: already used by the agent"]
    on_mig = (ReplicaSpec("a", "img", 8000, 0, mig_profile="1g.10gb", mig_instance=1),)
    assert problems(replicas=on_mig) == [
        "replica 'a' mig 1g.10gb#1: GPU 0 has 0 such instance(s) in the mig layout; "
        "add them or pick another"
    ]
    bounds = "drain_timeout_s / ready_timeout_s / rejoin_s: give seconds, drain and rejoin 0 or "
    for bad in ({"drain_timeout_s": -1}, {"ready_timeout_s": 0}, {"rejoin_s": -1}):
        assert problems(**bad) == [bounds + "more, ready 1+"], bad
    assert problems(quiet_s=0) == ["quiet_s 0: give seconds, 1 or more"]
    own_env = (ReplicaSpec("a", "img", 8000, 0, env={"HF_HOME": "/x"}),)
    assert problems(replicas=own_env) == ["replica 'a' env HF_HOME: set by the deploy; remove it"]


def test_spec_file_round_trip_and_unknown_field(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    path.write_text(
        json.dumps(
            {
                "node_id": "n1",
                "mig": [{"gpu": 0, "profile": "1g.10gb", "instances": 7}],
                "replicas": [
                    {"id": "r", "image": "i:1", "port": 8000, "gpu": 0, "mig_profile": "1g.10gb"}
                ],
            }
        )
    )
    spec = load_spec(path)
    assert spec.mig_layout() == {0: ["1g.10gb"] * 7} and spec.replicas[0].command == ()
    with pytest.raises(NodeSpecError, match="unexpected keyword argument 'gpus'"):
        spec_from_json({"node_id": "n1", "gpus": 2})
    path.write_text("{")
    with pytest.raises(NodeSpecError, match=r"not JSON \(line 1"):
        load_spec(path)


@pytest.mark.parametrize(
    ("stall_timeout_ms", "quiet_s"),
    [(None, QUIET_CONNECTION_S), (QUIET_CONNECTION_S * 1000 - 1, QUIET_CONNECTION_S), (90_500, 91)],
)
def test_a_drain_counts_as_idle_what_is_quieter_than_any_live_stream_of_its_pools(
    stall_timeout_ms: int | None, quiet_s: int
) -> None:
    args = stacks.multicloud()
    if stall_timeout_ms is not None:
        args["recipes"][2]["stall_timeout_ms"] = stall_timeout_ms  # on the Hetzner boxes
    stack = read_stack("prod", {f"denv:{k}": args[k] for k in ("sites", "recipes", "balancer")})
    spec = node_deploy_specs(stack, place_replicas(stack))["hetzner-fsn.gex-1"]
    assert spec.quiet_s == quiet_s
    # Left out of the node's inputs at its default: a stack's state from before stays as it was.
    assert ("quiet_s" in spec_to_json(spec)) == (quiet_s != QUIET_CONNECTION_S)
    assert spec_from_json(spec_to_json(spec)).quiet_s == quiet_s


def test_a_recipes_probe_is_one_type_from_the_stack_to_the_agent() -> None:
    # recipe -> AgentProbe (recipe_probe) -> the node's spec -> its JSON -> the same AgentProbe
    # -> the agent's TOML: no copy of another type on the way, the JSON keys as they were.
    args = stacks.multicloud()
    args["recipes"][2]["ttft_budget_ms"] = 800  # on the Hetzner boxes
    stack = read_stack("prod", {f"denv:{k}": args[k] for k in ("sites", "recipes", "balancer")})
    specs = node_deploy_specs(stack, place_replicas(stack))
    recipes = {r.name: r for r in stack.recipes}
    probed = [r for spec in specs.values() for r in spec.replicas if r.probe is not None]
    assert probed
    for replica in probed:
        recipe = recipes[replica.id.split(".")[0]]
        assert type(replica.probe) is AgentProbe
        assert replica.probe == recipe_probe(recipe)
    spec = next(s for s in specs.values() if any(r.probe for r in s.replicas))
    data = json.loads(json.dumps(spec_to_json(spec)))
    wire = next(r["probe"] for r in data["replicas"] if r.get("probe"))
    assert set(wire) == {"model", "ttft_budget_ms", "stall_budget_ms", "engine", "metrics_path"}
    again = spec_from_json(data)
    assert again == spec
    assert all(type(r.probe) is AgentProbe for r in again.replicas if r.probe is not None)
