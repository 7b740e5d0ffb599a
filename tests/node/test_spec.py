"""Node spec validation: one line per problem, naming the field and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from denv_iac.node import NodeDeploySpec, NodeSpecError, ReplicaSpec, load_spec, spec_from_json


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
