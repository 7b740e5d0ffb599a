"""Names that would become one resource name, and the other inputs that once ended in a
traceback, are refused at plan time with one line naming both entries: before any resource
is registered. The property test draws every name from a few that collide when dash-joined."""

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from denv_iac.cli import main
from denv_iac.core.plan import make_plan
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.core.stack.stackfile import parse_yaml
from tests.stacks import SECRET

IMAGE = "vllm/vllm-openai:v0.11.0"


def _kubernetes(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "kubernetes",
        "kubeconfig": SECRET,
        "namespace": f"ns-{name}"[:63],
        "gpu": "A100-80GB",
        "gpus_per_node": 4,
        "max_nodes": 1,
    }


def _stack(
    kube_sites: list[str], recipes: list[tuple[str, str]], balancer: list[str] | None = None
) -> dict[str, Any]:
    """Kubernetes sites, recipes (name, site) of one replica each, and a joined balancer host."""
    office = {
        "name": "office",
        "kind": "joined",
        "ssh_private_key": SECRET,
        "admin_cidrs": ["198.51.100.0/24"],
        "nodes": [{"name": "rack-1", "address": "192.0.2.10", "gpu": "L40S", "gpus": 1}],
    }
    return {
        "denv:sites": [office, *(_kubernetes(s) for s in kube_sites)],
        "denv:recipes": [
            {"name": r, "image": IMAGE, "min_warm": 1, "spare": 0, "sites": [s]} for r, s in recipes
        ],
        "denv:balancer": {"sites": balancer or ["office"], "api_key_digests": ["0" * 64]},
    }


def _refusal(config: dict[str, Any]) -> list[str]:
    with pytest.raises(StackError) as refused:
        make_plan(read_stack("s", config))
    return refused.value.problems


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        (
            # Site k8s's Service voice-service-x and site k8s-service-voice's Service x.
            _stack(
                ["k8s", "k8s-service-voice"],
                [("voice-service-x", "k8s"), ("x", "k8s-service-voice")],
            ),
            "sites: k8s-service-voice: recipe x's Service on kubernetes site k8s-service-voice and "
            "recipe voice-service-x's Service on kubernetes site k8s would both be the resource "
            "k8s-service-voice-service-x; rename a site or a recipe (names starting with denv- are "
            "the sites' own)",
        ),
        (
            _stack(["k8s"], [("denv-agent", "k8s")]),
            "sites: k8s: kubernetes site k8s's own Service denv-agent and recipe denv-agent's "
            "Service on kubernetes site k8s would both be the resource k8s-service-denv-agent; "
            "rename a site or a recipe (names starting with denv- are the sites' own)",
        ),
    ],
    ids=["two-sites", "a-recipe-named-like-the-sites-own"],
)
def test_kubernetes_objects_that_would_share_a_resource_name_are_refused(
    config: dict[str, Any], problem: str
) -> None:
    assert _refusal(config) == [problem]


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            lambda c: c["denv:balancer"].update(sites=["office", "office"]),
            'balancer.sites[1]: site "office" is also balancer.sites[0]; list each site once',
        ),
        (
            lambda c: c["denv:sites"][0].update(admin_cidrs=["198.51.100.0/24", "198.51.100.0/24"]),
            'sites[0].admin_cidrs[1]: "198.51.100.0/24" is the block of admin_cidrs[0] '
            '("198.51.100.0/24"); list each block once',
        ),
        (
            # One block written two ways is still one block.
            lambda c: c["denv:sites"][0].update(
                admin_cidrs=["2001:db8::/32", "198.51.100.0/24", "2001:DB8:0::/32"]
            ),
            'sites[0].admin_cidrs[2]: "2001:DB8:0::/32" is the block of admin_cidrs[0] '
            '("2001:db8::/32"); list each block once',
        ),
        (
            lambda c: c["denv:balancer"].update(overlay={"cidr": ""}),
            "balancer.overlay.cidr: expected a non-empty string, got an empty string",
        ),
        (
            lambda c: c["denv:balancer"].update(overlay={"cidr": "  "}),
            "balancer.overlay.cidr: expected a non-empty string, got an empty string",
        ),
    ],
    ids=[
        "balancer-site-twice",
        "admin-cidr-twice",
        "admin-cidr-written-two-ways",
        "overlay-cidr-empty",
        "overlay-cidr-blank",
    ],
)
def test_inputs_that_once_ended_in_a_traceback_are_refused_in_one_line(
    edit: Any, problem: str
) -> None:
    config = _stack(["k8s"], [("voice", "k8s")])
    edit(config)
    with pytest.raises(StackError) as refused:
        read_stack("s", config)
    assert refused.value.problems == [problem]


def test_a_yaml_merge_key_reuses_a_mapping_and_its_own_keys_win() -> None:
    document = parse_yaml(
        b"base: &base {name: a, kind: local, cache_size_gb: 20}\nsite: {<<: *base, name: b}\n",
        "Pulumi.s.yaml",
    )
    assert document["site"] == {"name": "b", "kind": "local", "cache_size_gb": 20}


def test_a_key_written_twice_beside_a_merge_key_is_still_refused() -> None:
    with pytest.raises(StackError) as refused:
        parse_yaml(b"base: &base {x: 1}\nsite: {<<: *base, y: 2, y: 3}\n", "Pulumi.s.yaml")
    assert refused.value.problems == [
        "Pulumi.s.yaml line 2: key 'y' is given twice in one mapping (first on line 2); keep one"
    ]


def test_lock_onto_a_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "Pulumi.s.yaml").write_text(
        yaml.safe_dump({"config": _stack(["k8s"], [("voice", "k8s")])})
    )
    (tmp_path / "Pulumi.s.placement.json").mkdir()
    result = CliRunner().invoke(
        main, ["plan", "--stack", "s", "--stacks-dir", str(tmp_path), "--lock"]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code == 2
    assert result.stdout == ""  # refused before the plan is shown
    assert result.stderr.splitlines()[-1] == (
        f"error: --lock: Pulumi.s.placement.json in {tmp_path.name}/ is not a file; move it away "
        "so the placement lock can be written there"
    )


# Names that collide when dash-joined (site-kind-name), names of a site's own objects, and
# the same entry twice.
SITE_NAMES = ("k8s", "k8s-service-voice", "k8s-statefulset-voice", "office")
RECIPE_NAMES = ("voice", "voice-service-x", "x", "denv-agent", "denv-gateway-node-0", "x-env")
CIDRS = ("198.51.100.0/24", "198.51.100.0/255.255.255.0", "2001:db8::/32", "203.0.113.7/32")


@st.composite
def colliding_stacks(draw: st.DrawFn) -> dict[str, Any]:
    kube = draw(st.lists(st.sampled_from(SITE_NAMES[:3]), min_size=1, max_size=3, unique=True))
    recipes = draw(
        st.lists(
            st.tuples(st.sampled_from(RECIPE_NAMES), st.sampled_from(kube)),
            min_size=1,
            max_size=3,
            unique_by=lambda r: r[0],
        )
    )
    config = _stack(
        kube, recipes, draw(st.lists(st.sampled_from(["office"]), min_size=1, max_size=2))
    )
    config["denv:sites"][0]["admin_cidrs"] = draw(
        st.lists(st.sampled_from(CIDRS), min_size=1, max_size=3)
    )
    return config


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(colliding_stacks())
def test_colliding_names_are_refused_or_registered_never_a_traceback(
    config: dict[str, Any],
) -> None:
    from denv_iac.components.preview import preview_stack

    try:
        stack = read_stack("s", config)
        make_plan(stack)
    except StackError as error:
        assert error.problems and all("\n" not in p for p in error.problems)
        return
    # A plan that succeeds is one the program registers: no two resources share a URN.
    resources = preview_stack(stack, copy.deepcopy(config))
    assert resources
