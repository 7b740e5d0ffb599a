"""examples/team-repo: a team's own program mixing its resources with the product's Cluster."""

import json
import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml

from tests.components import stacks
from tests.components.harness import plain_strings, run_program
from tests.components.test_stack_program import _decrypted

TEAM_REPO = Path(__file__).parents[2] / "examples" / "team-repo"


@pytest.fixture
def team_config() -> Iterator[None]:
    args = stacks.multicloud()
    config = {"gpu:sites": args["sites"], "gpu:recipes": args["recipes"]}
    config["gpu:balancer"] = args["balancer"]
    pulumi.runtime.set_all_config(
        {key: json.dumps(_decrypted(value)) for key, value in config.items()},
        secret_keys=["gpu:sites", "gpu:balancer"],
    )
    yield
    pulumi.runtime.set_all_config({})


def _program() -> dict[str, pulumi.Output[Any]]:
    namespace = runpy.run_path(str(TEAM_REPO / "__main__.py"))
    return {"endpoint": namespace["cluster"].endpoint, "logs": namespace["logs"].bucket}


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_the_team_program_registers_its_bucket_beside_the_cluster(
    team_config: None, preview: bool
) -> None:
    run = run_program(_program, preview=preview)
    (bucket,) = run.of_type("aws:s3/bucket:Bucket")
    # The team's own resource sits at the top of its stack, beside the Cluster.
    assert bucket.name == "voice-logs" and bucket.parent.endswith(
        "pulumi:pulumi:Stack::project-stack"
    )
    assert bucket.inputs["tags"] == {"team": "voice"}
    (cluster,) = run.of_type("denv:index:Cluster")
    assert cluster.name == "voice"
    assert len(run.of_type("aws:ec2/instance:Instance")) == 4
    assert len(run.of_type("denv:index:NodeSetup")) == 9
    for registration in run.registrations:
        strings = plain_strings(registration.inputs)
        for secret in stacks.SECRETS:
            for line in secret.splitlines()[1:-1]:
                assert not any(line in s for s in strings), registration.name
    if not preview:
        assert run.outputs["endpoint"].startswith("https://")


def test_the_example_stack_file_holds_the_keys_the_program_reads() -> None:
    config = yaml.safe_load((TEAM_REPO / "Pulumi.prod.yaml").read_text())["config"]
    assert {"gpu:sites", "gpu:recipes", "gpu:balancer"} <= set(config)
    assert all("secure" in site["ssh_private_key"] for site in config["gpu:sites"])
