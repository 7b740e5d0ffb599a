"""Cluster as other languages see it: its schema, and args as they arrive over the wire."""

import json
import types
from pathlib import Path
from typing import Any

from pulumi.provider.experimental.component import ComponentProvider
from pulumi.provider.experimental.host import components_from_module

from components import __main__ as hosted
from denv_iac.components import Cluster, ClusterArgs
from tests.components import stacks
from tests.components.harness import cluster_outputs, run_program

ROOT = Path(__file__).parents[2]


def test_cluster_schema_has_plain_data_inputs_and_its_outputs() -> None:
    module = types.ModuleType("denv_cluster")
    module.Cluster = Cluster  # type: ignore[attr-defined]
    module.ClusterArgs = ClusterArgs  # type: ignore[attr-defined]
    schema = json.loads(
        str(ComponentProvider(components_from_module(module), "denv", None, "0.1.0").schema)
    )
    cluster = schema["resources"]["denv:index:Cluster"]
    assert cluster["isComponent"] is True
    assert sorted(cluster["inputProperties"]) == ["balancer", "previous", "recipes", "sites"]
    assert sorted(cluster["requiredInputs"]) == ["balancer", "recipes", "sites"]
    assert sorted(cluster["properties"]) == [
        "balancerAddresses",
        "endpoint",
        "haproxyConfig",
        "replicaIds",
    ]


def _as_floats(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _as_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_floats(v) for v in value]
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def test_integers_arriving_as_floats_build_the_samecluster_outputs() -> None:
    wire = run_program(lambda: cluster_outputs(_as_floats(stacks.multicloud())), preview=False)
    native = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=False)
    assert wire.by_urn() == native.by_urn()
    assert wire.outputs == native.outputs


def test_the_committed_schema_is_the_one_the_components_give() -> None:
    committed = ROOT / "components" / "schema.json"
    assert hosted.schema() == committed.read_text(), (
        "the components' schema changed: regenerate it with "
        "`.venv/bin/python -m components --schema > components/schema.json` and commit it"
    )


def test_the_package_hosts_its_components_with_the_python_runtime() -> None:
    assert (ROOT / "components" / "PulumiPlugin.yaml").read_text() == "runtime: python\n"
    assert sorted(json.loads(hosted.schema())["resources"]) == ["denv:index:Cluster"]
