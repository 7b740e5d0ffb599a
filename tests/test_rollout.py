"""The rollout rule, table-tested without any I/O: which replicas change, in what order, and
when the plan refuses."""

import copy
from typing import Any

import pytest

from denv_iac.core.placement import PlacedReplica, place_replicas
from denv_iac.core.rollout import (
    RolloutPlan,
    RolloutRefused,
    deploy_after,
    min_warm_problem,
    plan_rollout,
)
from denv_iac.core.stack.model import DRAIN_TIMEOUT_S
from denv_iac.core.stack.reader import StackError, read_stack
from tests.stacks import local_site

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


def _placed(*replicas: str) -> list[PlacedReplica]:
    """Placed replicas from `pool@site.node` strings."""
    out = []
    for text in replicas:
        pool, where = text.split("@")
        site, node = where.split(".")
        out.append(PlacedReplica(f"{pool}.{where}.0", pool, site, node, 0, None, "whole", 0))
    return out


@pytest.mark.parametrize(
    ("nodes", "replicas", "after"),
    [
        # One pool over three nodes: a chain.
        (["s.a", "s.b", "s.c"], ["v@s.a", "v@s.b", "v@s.c"], {"s.b": ("s.a",), "s.c": ("s.b",)}),
        # Two pools on their own nodes: two chains, side by side.
        (
            ["s.a", "s.b", "s.c", "s.d"],
            ["v@s.a", "t@s.b", "v@s.c", "t@s.d"],
            {"s.c": ("s.a",), "s.d": ("s.b",)},
        ),
        # A node hosting both waits for the last node of each; the chains cross sites.
        (
            ["x.a", "x.b", "y.a"],
            ["v@x.a", "t@x.b", "v@y.a", "t@y.a"],
            {"y.a": ("x.a", "x.b")},
        ),
        # A node with two replicas of a pool is one link; a node with none waits for nothing.
        (["s.a", "s.b", "s.c"], ["v@s.a", "v@s.a", "v@s.c"], {"s.c": ("s.a",)}),
    ],
)
def test_a_pools_node_deploys_form_a_chain(
    nodes: list[str], replicas: list[str], after: dict[str, tuple[str, ...]]
) -> None:
    assert deploy_after(nodes, _placed(*replicas)) == {n: after.get(n, ()) for n in nodes}
