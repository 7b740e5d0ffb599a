"""The rollout rule, table-tested without any I/O: which replicas change, in what order, and
when the plan refuses."""

import copy
import itertools
from typing import Any

import pytest

from denv_iac.core.placement import place_replicas
from denv_iac.core.rollout import (
    RolloutPlan,
    RolloutRefused,
    RolloutUnit,
    min_warm_problem,
    plan_rollout,
    rollout_after,
    rollout_units,
)
from denv_iac.core.stack.model import DRAIN_TIMEOUT_S
from denv_iac.core.stack.reader import StackError, read_stack
from tests.stacks import kube_site, local_site

BASE: dict[str, Any] = {
    "denv:sites": [local_site("local", nodes=6, gpus=1)],
    "denv:recipes": [
        {"name": "chat", "min_warm": 2, "spare": 1, "sites": ["local"]},
        {"name": "tts", "min_warm": 1, "spare": 1, "sites": ["local"]},
    ],
    "denv:balancer": {"sites": ["local"]},
}


def _changed(**recipes: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(BASE)
    for recipe in config["denv:recipes"]:
        recipe.update(recipes.get(recipe["name"], {}))
    return config


def _plan(after: dict[str, Any], before: dict[str, Any] = BASE) -> RolloutPlan:
    old, new = read_stack("t", before), read_stack("t", after)
    placed_old = place_replicas(old).replicas
    placed_new = place_replicas(new, previous=[r.id for r in placed_old]).replicas
    return plan_rollout(old, placed_old, new, placed_new)


CHAT = ("chat.local.n0.0", "chat.local.n1.0", "chat.local.n2.0")
TTS = ("tts.local.n3.0", "tts.local.n4.0")


@pytest.mark.parametrize(
    ("change", "restarted", "fields"),
    [
        ({}, (), ()),
        ({"chat": {"image": "vllm/vllm-openai:v0.9.0"}}, CHAT, ("image",)),
        ({"chat": {"command": ["vllm", "serve", "m2"]}}, CHAT, ("command",)),
        ({"tts": {"env": {"MODEL_REV": "2"}}}, TTS, ("env",)),
        ({"tts": {"simulate": {"tokens": 8}}}, TTS, ("simulate",)),
        ({"chat": {"models": ["chat", "chat-v2"]}}, CHAT, ("models",)),
        # Settings of the balancer or of the rollout itself restart nothing.
        ({"chat": {"drain_timeout_s": 30, "cold_start_budget_s": 60}}, (), ()),
        ({"chat": {"stall_timeout_ms": 2000, "max_concurrency": 8}}, (), ()),
    ],
)
def test_what_changes(
    change: dict[str, dict[str, Any]], restarted: tuple[str, ...], fields: tuple[str, ...]
) -> None:
    plan = _plan(_changed(**change))
    assert tuple(sorted(s.replica for s in plan.steps)) == tuple(sorted(restarted))
    assert all(s.changed == fields for s in plan.steps)
    all_ids = set(CHAT) | set(TTS)
    assert set(plan.unchanged) == all_ids - set(restarted)
    assert plan.added == plan.removed == ()
    assert plan.empty == (not restarted)


def test_one_replica_of_a_pool_per_wave_pools_side_by_side() -> None:
    plan = _plan(_changed(chat={"image": "a/b:2"}, tts={"image": "a/c:2"}))
    assert [[s.replica for s in wave] for wave in plan.waves] == [
        [CHAT[0], TTS[0]],
        [CHAT[1], TTS[1]],
        [CHAT[2]],
    ]
    for wave in plan.waves:
        pools = [s.pool for s in wave]
        assert len(pools) == len(set(pools))


@pytest.mark.parametrize(
    ("recipes", "change", "problem"),
    [
        # No spare: restarting the only replica leaves none.
        (
            {"chat": {"min_warm": 1, "spare": 0}},
            {"chat": {"min_warm": 1, "spare": 0, "image": "a/b:2"}},
            "recipes[chat]: restarting replica chat.local.n0.0 would leave 0 ready replica(s), "
            "under min_warm 1",
        ),
        # Raising min_warm to what the pool holds in the same change: the larger one counts.
        (
            {},
            {"tts": {"min_warm": 2, "spare": 0, "image": "a/b:2"}},
            "recipes[tts]: restarting replica tts.local.n3.0 would leave 1 ready replica(s), "
            "under min_warm 2",
        ),
    ],
)
def test_refuses_below_min_warm(
    recipes: dict[str, dict[str, Any]], change: dict[str, dict[str, Any]], problem: str
) -> None:
    with pytest.raises(RolloutRefused) as refused:
        _plan(_changed(**change), before=_changed(**recipes))
    line = str(refused.value)
    assert line.startswith(problem)
    assert "\n" not in line and "spare" in line


def test_placement_changes_are_listed_not_restarted() -> None:
    plan = _plan(_changed(chat={"min_warm": 3}))
    assert len([r for r in plan.added if r.startswith("chat.")]) == 1
    assert plan.steps == ()
    plan = _plan(_changed(), before=_changed(chat={"min_warm": 3}))
    assert len([r for r in plan.removed if r.startswith("chat.")]) == 1
    assert plan.steps == ()


@pytest.mark.parametrize(
    ("ready_others", "min_warm", "ok"),
    [(["b"], 1, True), ([], 1, False), (["b", "c"], 2, True), (["b"], 2, False)],
)
def test_min_warm_problem(ready_others: list[str], min_warm: int, ok: bool) -> None:
    problem = min_warm_problem("chat", "a", ready_others, min_warm)
    assert (problem == "") == ok
    if not ok:
        assert problem.startswith(
            f"recipes[chat]: restarting replica a would leave {len(ready_others)}"
        )


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (0, "recipes[0].drain_timeout_s: 0 is out of range; use a number from 1 to 86400"),
        ("2m", "recipes[0].drain_timeout_s: expected a whole number, got a string"),
    ],
)
def test_drain_timeout_is_validated_in_one_line(value: object, problem: str) -> None:
    with pytest.raises(StackError) as error:
        read_stack("t", _changed(chat={"drain_timeout_s": value}))
    assert problem in error.value.problems


def test_drain_timeout_defaults_to_a_voice_call() -> None:
    assert read_stack("t", BASE).recipes[0].drain_timeout_s == DRAIN_TIMEOUT_S == 120
    assert read_stack("t", _changed(chat={"drain_timeout_s": 30})).recipes[0].drain_timeout_s == 30


def _units(*units: str) -> list[RolloutUnit]:
    """Rollout units from `name:pool,pool` strings (a node deploy, or a workload of one pool)."""
    out = []
    for text in units:
        name, _, pools = text.partition(":")
        out.append(RolloutUnit(name, tuple(p for p in pools.split(",") if p)))
    return out


@pytest.mark.parametrize(
    ("units", "after"),
    [
        # One pool over three nodes: a chain.
        (["s.a:v", "s.b:v", "s.c:v"], {"s.b": ("s.a",), "s.c": ("s.b",)}),
        # Two pools on their own nodes: two chains, side by side.
        (["s.a:v", "s.b:t", "s.c:v", "s.d:t"], {"s.c": ("s.a",), "s.d": ("s.b",)}),
        # A node hosting both waits for the last node of each; the chains cross sites.
        (["x.a:v", "x.b:t", "y.a:t,v"], {"y.a": ("x.a", "x.b")}),
        # A node with no replica waits for nothing, and nothing waits for it.
        (["s.a:v", "s.b:", "s.c:v"], {"s.c": ("s.a",)}),
        # Two Kubernetes sites serving one pool: the second site's workload after the first's.
        (["k1/v:v", "k2/v:v"], {"k2/v": ("k1/v",)}),
        # A Kubernetes site's workloads of two pools roll side by side.
        (["k1/v:v", "k1/t:t", "k2/v:v"], {"k2/v": ("k1/v",)}),
        # Nodes and Kubernetes sites of one pool, interleaved: one chain across both kinds.
        (
            ["x.a:v", "k1/v:v", "y.a:t,v", "k2/v:v", "k2/t:t"],
            {"k1/v": ("x.a",), "y.a": ("k1/v",), "k2/v": ("y.a",), "k2/t": ("y.a",)},
        ),
    ],
)
def test_a_pools_rollout_units_form_a_chain(
    units: list[str], after: dict[str, tuple[str, ...]]
) -> None:
    parsed = _units(*units)
    assert rollout_after(parsed) == {u.name: after.get(u.name, ()) for u in parsed}


def test_units_follow_the_stacks_sites_nodes_then_kubernetes_pools() -> None:
    stack = read_stack(
        "prod",
        {
            "denv:sites": [
                kube_site("k8s-a", max_nodes=2),
                {
                    "name": "rack",
                    "kind": "joined",
                    "ssh_private_key": {"secure": "sealed"},
                    "nodes": [
                        {"name": f"n{i}", "address": f"192.0.2.{i}", "gpu": "L4", "gpus": 1}
                        for i in (1, 2)
                    ],
                },
                kube_site("k8s-b", max_nodes=2),
            ],
            "denv:recipes": [
                {
                    "name": name,
                    "min_warm": warm,
                    "spare": 1,
                    "sites": sites,
                    "image": "vllm/vllm-openai:v0.11.0",
                }
                for name, warm, sites in (
                    ("voice", 5, ["k8s-a", "rack", "k8s-b"]),
                    ("side", 1, ["k8s-a"]),
                )
            ],
            "denv:balancer": {"sites": ["rack"]},
        },
    )
    placement = place_replicas(stack)
    units = rollout_units(stack, placement)
    placed = {(r.site, r.pool) for r in placement.replicas}
    assert {("k8s-a", "voice"), ("rack", "voice"), ("k8s-b", "voice")} <= placed
    names = [u.name for u in units]
    # Sites as listed; a Kubernetes site's pools in recipe order; a node site's every node.
    assert names[:2] == ["k8s-a/voice", "k8s-a/side"]
    assert names[2:4] == ["rack.n1", "rack.n2"]
    assert names[4:] == ["k8s-b/voice"]
    chains = rollout_after(units)
    voice = [u.name for u in units if "voice" in u.pools]
    for previous, unit in itertools.pairwise(voice):
        assert chains[unit] == (previous,), unit
    assert chains["k8s-a/side"] == ()
