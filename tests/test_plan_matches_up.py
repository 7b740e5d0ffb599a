"""Plain `denv plan` refuses exactly the stacks that `pulumi up` (Cluster) refuses, with the same
lines: every invalid case of the spec tests, and the cases only visible once replicas are placed.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from denv_iac.cli import main
from denv_iac.components.cluster import validate_cluster
from denv_iac.core.balancer.api_surface import MODELS_LIST_LIMIT
from denv_iac.core.stack.reader import StackError
from tests.balancer.sample_pools import aliases_filling
from tests.stacks import SECRET
from tests.test_spec_validation import CASES, valid_config

IMAGE = "vllm/vllm-openai:v0.11.0"
KEYS = ("denv:sites", "denv:recipes", "denv:balancer")


def placeable() -> dict[str, Any]:
    """A valid stack of sites that need no key read before anything exists."""
    local, *_, k8s = valid_config()["denv:sites"]
    office = {
        "name": "office",
        "kind": "joined",
        "ssh_private_key": SECRET,
        "admin_cidrs": ["198.51.100.0/24"],
        "nodes": [
            {"name": f"rack-{n}", "address": f"192.0.2.1{n}", "gpu": "L40S", "gpus": 2}
            for n in "12"
        ],
    }
    return {
        "denv:sites": [local, office, k8s],
        "denv:recipes": [
            {"name": "voice", "min_warm": 1, "sites": ["local"]},
            {"name": "rtx", "image": IMAGE, "port": 8008, "min_warm": 1, "sites": ["office"]},
            {"name": "big", "image": IMAGE, "min_warm": 1, "sites": ["k8s"]},
        ],
        "denv:balancer": {"sites": ["local"]},
    }


def _recipe(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in config["denv:recipes"] if r["name"] == name)  # type: ignore[no-any-return]


PLACED: list[tuple[str, Callable[[dict[str, Any]], object], list[str]]] = [
    (
        "two recipes on one port of a node",
        lambda c: c["denv:recipes"].append(
            {"name": "rtx2", "image": IMAGE, "port": 8000, "min_warm": 1, "sites": ["office"]}
        ),
        [
            f"recipes: rtx2: replica rtx2.office.rack-{n}.1 would take port 8008, used by "
            f"rtx.office.rack-{n}.0; give the recipes ports at least 128 apart"
            for n in "12"
        ],
    ),
    (
        "no image on machines reached over SSH",
        lambda c: _recipe(c, "rtx").pop("image"),
        ["recipes: rtx: give an image; its replicas run in containers on office, reached over SSH"],
    ),
    (
        "no image on kubernetes",
        lambda c: _recipe(c, "big").pop("image"),
        [
            "recipes[2].image: missing; a kubernetes site (k8s) runs the model server as a "
            "container: add image: vllm/vllm-openai:v0.11.0"
        ],
    ),
    (
        "the model list outgrows HAProxy's buffer",
        lambda c: _recipe(c, "voice").update(
            models=list(aliases_filling(("voice", "rtx", "big"), MODELS_LIST_LIMIT + 1))
        ),
        [
            f"recipes[].models: the model list the endpoint answers on /v1/models would be"
            f" {MODELS_LIST_LIMIT + 1} bytes, over HAProxy's limit of {MODELS_LIST_LIMIT}"
            " (one buffer); give fewer aliases or shorter names"
        ],
    ),
    (
        "kubernetes gateway ports run out",
        lambda c: c["denv:sites"][2].update(gpus_per_node=8, max_nodes=1000),
        [
            "sites: k8s.max_nodes: 1000 nodes of 8 GPUs need gateway ports up to 73999; keep "
            "max_nodes x gpus_per_node at most 6942"
        ],
    ),
]


def _plain_plan(config: dict[Any, Any], folder: Path) -> list[str]:
    (folder / "Pulumi.s.yaml").write_text(yaml.safe_dump({"config": config}))
    result = CliRunner().invoke(main, ["plan", "--stack", "s", "--stacks-dir", str(folder)])
    assert result.exit_code == 2, result.output
    return [line.removeprefix("error: ") for line in result.stderr.splitlines()]


def _up(config: dict[Any, Any]) -> list[str]:
    args = {key.removeprefix("denv:"): config[key] for key in KEYS}
    with pytest.raises(StackError) as raised:
        validate_cluster("s", args)  # type: ignore[arg-type]
    return raised.value.problems


@pytest.mark.parametrize(
    ("change", "expected"), [(c[1], c[2]) for c in PLACED], ids=[c[0] for c in PLACED]
)
def test_placed_problems_refused_by_both(
    tmp_path: Path, change: Callable[[dict[str, Any]], object], expected: list[str]
) -> None:
    config = placeable()
    change(config)
    assert _plain_plan(config, tmp_path) == _up(config) == expected


@pytest.mark.parametrize("longest_model_list", [False, True])
def test_the_placeable_stack_is_accepted_by_both(tmp_path: Path, longest_model_list: bool) -> None:
    config = placeable()
    if longest_model_list:
        aliases = aliases_filling(("voice", "rtx", "big"), MODELS_LIST_LIMIT)
        _recipe(config, "voice")["models"] = ["voice", *aliases]
    (tmp_path / "Pulumi.s.yaml").write_text(yaml.safe_dump({"config": config}))
    result = CliRunner().invoke(main, ["plan", "--stack", "s", "--stacks-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    validate_cluster("s", {key.removeprefix("denv:"): config[key] for key in KEYS})  # type: ignore[misc]


# Cluster takes the three denv: keys as arguments: a missing or unknown top key cannot reach it.
TOP_KEY_CASES = ("unknown top key", "no sites", "integer config key")
SPEC_CASES = [c for c in CASES if c[0] not in TOP_KEY_CASES]


@pytest.mark.parametrize("change", [c[1] for c in SPEC_CASES], ids=[c[0] for c in SPEC_CASES])
def test_every_spec_case_refused_by_both_alike(
    tmp_path: Path, change: Callable[[dict[str, Any]], object]
) -> None:
    config = valid_config()
    change(config)
    assert _plain_plan(config, tmp_path) == _up(config)


def test_a_robot_firewall_over_robots_limit_is_refused_by_plain_plan(tmp_path: Path) -> None:
    # Counted only under `--resources` before: plain `denv plan` accepted the stack.
    config = valid_config()
    hetzner = next(s for s in config["denv:sites"] if s["kind"] == "hetzner")
    cidrs = [f"198.51.100.{n}/32" for n in range(12)]
    hetzner.update(robot_user=SECRET, robot_password=SECRET, admin_cidrs=cidrs)
    refused = _plain_plan(config, tmp_path)
    line = (
        f"sites: {hetzner['name']}: the Robot firewall takes at most 10 input rules and this site"
        " needs 17 ("
    )
    assert [r for r in refused if r.startswith(line)], "\n".join(refused)
