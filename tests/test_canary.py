"""A recipe's canary: read and refused as stack input, placed beside the recipe's replicas, weighted
in the balancer for its share of new sessions, rolled (share, promotion, retirement) and shown by
`denv status` beside the recipe's version. Pure: no process is started."""

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
from rich.console import Console

from denv_iac.cli.plan_view import render_plan
from denv_iac.core.balancer import render_haproxy_config
from denv_iac.core.balancer.canary import MAX_WEIGHT, SHARE_SLACK, canary_weights
from denv_iac.core.dataplane import balancer_pools, canary_tier_shares
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.placement import PlacementError, place_replicas
from denv_iac.core.plan import make_plan
from denv_iac.core.rollout import plan_rollout
from denv_iac.core.stack.model import SimulatedServer, StackSpec
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.local.rollout import (
    LOCAL_FIELDS,
    local_problems,
    retiring_replicas,
    starting_replicas,
)
from denv_iac.ops.alerts import alert_rules
from denv_iac.ops.status import ReplicaStatus, pool_statuses
from tests.stacks import SECRET, local_site

Config = dict[str, Any]


def config(nodes: int = 4, **canary: Any) -> Config:
    """A voice pool of 3 (min_warm 2, spare 1) on one GPU per node, with a canary when given."""
    voice: dict[str, Any] = {
        "name": "voice",
        "min_warm": 2,
        "spare": 1,
        "sites": ["local"],
        "simulate": {"ttft_ms": 20, "tokens": 16},
    }
    if canary:
        voice["canary"] = canary
    return {
        "denv:sites": [local_site("local", nodes=nodes, gpus=1)],
        "denv:recipes": [voice],
        "denv:balancer": {"sites": ["local"]},
    }


NEW = {"ttft_ms": 30, "tokens": 16}


def voice(c: Config) -> dict[str, Any]:
    return c["denv:recipes"][0]  # type: ignore[no-any-return]


def canary(c: Config) -> dict[str, Any]:
    return voice(c)["canary"]  # type: ignore[no-any-return]


RULE = "give the fraction of new sessions it takes, above 0 and below 1 (0.1 = 10 %)"
CASES: list[tuple[str, Callable[[Config], object], str]] = [
    ("no share", lambda c: canary(c).pop("share"), f"recipes[0].canary.share: missing; {RULE}"),
    ("share 1", lambda c: canary(c).update(share=1), "recipes[0].canary.share: 1 is out of range"),
    ("share 0", lambda c: canary(c).update(share=0), "recipes[0].canary.share: 0 is out of range"),
    (
        "share as a percentage",
        lambda c: canary(c).update(share=10),
        f"recipes[0].canary.share: 10 is out of range; {RULE}",
    ),
    (
        "share a string",
        lambda c: canary(c).update(share="10%"),
        f"recipes[0].canary.share: expected a number, got a string; {RULE}",
    ),
    (
        "share not finite",
        lambda c: canary(c).update(share=float("nan")),
        "recipes[0].canary.share: expected a number, got nan (not a finite number)",
    ),
    (
        "no replica",
        lambda c: canary(c).update(replicas=0),
        "recipes[0].canary.replicas: 0 is out of range; use a number from 1 to 10000",
    ),
    (
        "canary names no field",
        lambda c: canary(c).pop("simulate"),
        "recipes[0].canary: runs what the recipe runs (it names none of the fields); give the"
        " image, command, env, simulate the new version differs in, or remove canary",
    ),
    (
        "canary identical to the recipe",
        lambda c: canary(c).update(simulate=voice(c)["simulate"]),
        "recipes[0].canary: runs what the recipe runs (same simulate)",
    ),
    (
        "canary typo",
        lambda c: canary(c).update(imgae="vllm/vllm-openai:v0.12.0"),
        'recipes[0].canary.imgae: unknown key; did you mean "image"?',
    ),
    (
        "canary of a field it may not change",
        lambda c: canary(c).update(min_warm=1),
        "recipes[0].canary.min_warm: unknown key; known keys: command, env, image, replicas,"
        " share, simulate",
    ),
    (
        "canary not a mapping",
        lambda c: voice(c).update(canary=0.1),
        "recipes[0].canary: expected a mapping of keys to values, got a number",
    ),
    (
        "bad canary image",
        lambda c: canary(c).update(image="-vllm"),
        'recipes[0].canary.image: "-vllm" is not a container image',
    ),
    (
        "canary slower than the stall budget",
        lambda c: canary(c).update(simulate={"ttft_ms": 1500}),
        "recipes[0].canary.simulate: a 1500 ms pause between tokens reaches stall_timeout_ms",
    ),
    (
        "secret in the canary's env",
        lambda c: canary(c).update(env={"HF_TOKEN": SECRET}),
        "recipes[0].canary.env.HF_TOKEN: a canary runs with the recipe's secure: values and"
        " holds none of its own",
    ),
    (
        "canary's plain env shadows a recipe secret",
        lambda c: (
            voice(c).update(env={"HF_TOKEN": SECRET}),
            canary(c).update(env={"HF_TOKEN": "x"}),
        ),
        "recipes[0].canary.env.HF_TOKEN: is a secure: value of the recipe's env",
    ),
    (
        "no session affinity",
        lambda c: voice(c).update(session_affinity=False),
        "recipes[0].canary: needs session_affinity: true",
    ),
    (
        "a recipe named as the canary's pool",
        lambda c: c["denv:recipes"].append({**copy.deepcopy(voice(c)), "name": "voice-canary"}),
        'recipes[1].name: "voice-canary" is the name of the pool of recipes[0].canary;'
        " rename this recipe",
    ),
    (
        "canary on Kubernetes",
        lambda c: (
            c["denv:sites"].append(
                {
                    "name": "k8s",
                    "kind": "kubernetes",
                    "kubeconfig": SECRET,
                    "gpu": "H100",
                    "gpus_per_node": 1,
                    "max_nodes": 1,
                }
            ),
            voice(c)["sites"].append("k8s"),
        ),
        "recipes[0].canary: a canary runs on nodes and local sites, not yet on Kubernetes sites"
        " (k8s); list only other sites, or remove canary",
    ),
]


@pytest.mark.parametrize(
    ("change", "expected"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_bad_canary_gets_one_line_naming_the_field(
    change: Callable[[Config], object], expected: str
) -> None:
    c = config(share=0.1, simulate=NEW)
    change(c)
    with pytest.raises(StackError) as error:
        read_stack("t", c)
    lines = error.value.problems
    assert len(lines) == 1, lines
    assert lines[0].startswith(expected), lines[0]


def test_a_canary_is_a_pool_of_the_recipe_with_its_fields_replaced() -> None:
    c = config(share=0.1, replicas=2, image="vllm/vllm-openai:v0.12.0", env={"A": "2"})
    voice(c).update(image="vllm/vllm-openai:v0.11.0", env={"A": "1", "B": "1", "T": SECRET})
    stack = read_stack("t", c)
    recipe, pool = stack.recipes
    assert stack.pools == (recipe,) and stack.canary_pool("voice") == pool
    assert recipe.canary is not None and recipe.canary.share == 0.1
    assert (pool.name, pool.canary_of, pool.min_warm, pool.spare) == ("voice-canary", "voice", 0, 2)
    assert pool.image == "vllm/vllm-openai:v0.12.0"
    assert pool.env == (("A", "2"),)  # the whole plain env replaced
    assert pool.secret_env == recipe.secret_env  # the recipe's secrets kept
    assert pool.simulate == recipe.simulate  # not given: the recipe's
    assert pool.model_names == ("voice",)  # it serves the recipe's model
    assert (recipe.image, recipe.env) == ("vllm/vllm-openai:v0.11.0", (("A", "1"), ("B", "1")))
    # A canary's simulate block replaces the recipe's whole, defaults for what it leaves out.
    slow = read_stack("t", config(share=0.1, simulate={"ttft_ms": 30}))
    assert slow.recipes[1].simulate == SimulatedServer(ttft_ms=30)


def test_the_canary_is_placed_beside_the_recipe_never_in_its_place() -> None:
    plain = place_replicas(read_stack("t", config())).replicas
    stack = read_stack("t", config(share=0.1, simulate=NEW))
    placed = place_replicas(stack, previous=[r.id for r in plain]).replicas
    assert placed[: len(plain)] == plain  # the recipe's replicas, where they were
    assert [r.id for r in placed[len(plain) :]] == ["voice-canary.local.n3.0"]
    # No GPU left for it: the shortfall names the canary's field, not the recipe's min_warm.
    with pytest.raises(PlacementError) as error:
        place_replicas(read_stack("t", config(nodes=3, share=0.1, simulate=NEW)))
    (line,) = error.value.problems
    assert line.startswith("recipes[0].canary.replicas: the canary of voice needs 1 GPUs")
    assert line.endswith("add capacity to its sites, list more sites, or lower canary.replicas")


@pytest.mark.parametrize(
    ("stable", "canary", "share", "weights"),
    [
        (3, 1, 0.25, (100, 100)),  # equal weights give a quarter
        (3, 1, 0.1, (100, 33)),  # 33 / 333 = 9.9 %
        (2, 1, 0.5, (100, 200)),
        (3, 1, 0.5, (85, 255)),  # 300 is past HAProxy's 256: the stable weight moves
        (3, 1, 0.01, (100, 3)),  # 3 / 303 = 0.99 %
        (30, 1, 0.99, (1, 256)),  # as close as weights of 1..256 get: 89.5 %
        (1, 2, 0.3, (100, 21)),
        (3, 0, 0.1, (100, 100)),  # no canary in this tier
        (0, 1, 0.1, (100, 100)),  # only the canary: it takes all
    ],
)
def test_canary_weights_give_its_share(
    stable: int, canary: int, share: float, weights: tuple[int, int]
) -> None:
    found = canary_weights(stable, canary, share)
    assert (found.stable, found.canary) == weights
    assert 1 <= found.stable <= MAX_WEIGHT and 1 <= found.canary <= MAX_WEIGHT
    if stable and canary and weights != (1, 256):
        assert abs(found.share(stable, canary) - share) <= SHARE_SLACK


def _pools(stack: StackSpec) -> Any:
    placement = place_replicas(stack)
    return balancer_pools(stack, placement, lambda r: ("127.0.0.1", 9000, 9100))


def test_the_canary_serves_in_the_recipes_tier_weighted_for_its_share() -> None:
    stack = read_stack("t", config(share=0.1, simulate=NEW))
    (pool,) = _pools(stack)
    (tier,) = pool.tiers
    assert {(s.replica_id, s.weight, s.canary) for s in tier.servers} == {
        ("voice.local.n0.0", 100, False),
        ("voice.local.n1.0", 100, False),
        ("voice.local.n2.0", 100, False),
        ("voice-canary.local.n3.0", 33, True),
    }
    cfg = render_haproxy_config((pool,), balancer_settings(stack), "/m").haproxy_cfg
    # The tier backend and each twin (realtime, speech) weigh it alike; stable servers keep the
    # default's weight 100.
    assert len(re.findall(r"server voice-canary\.local\.n3\.0 \S+ id \d+ weight 33 ", cfg)) == 3
    assert not re.search(r"^ *server voice\.local\.n\d\.0 .* weight ", cfg, re.M)
    assert "33 of 333, 9.9 %" in cfg
    # Without a canary the config is what it was: no weight on a server line, no note.
    plain = read_stack("t", config())
    text = render_haproxy_config(_pools(plain), balancer_settings(plain), "/m").haproxy_cfg
    assert "Canary" not in text and not re.search(r"^ *server .* weight ", text, re.M)
    assert "voice-canary" not in text


def _plan(before: Config, after: Config) -> tuple[StackSpec, StackSpec, Any]:
    old, new = read_stack("t", before), read_stack("t", after)
    placed = place_replicas(old).replicas
    placed_after = place_replicas(new, previous=[r.id for r in placed]).replicas
    return old, new, plan_rollout(old, placed, new, placed_after)


def test_share_promotion_and_retirement_are_plain_edits() -> None:
    with_canary = config(share=0.1, simulate=NEW)
    # The share: nothing restarts, the balancer's weights change.
    old, new, plan = _plan(with_canary, config(share=0.3, simulate=NEW))
    assert plan.empty and local_problems(old, new, plan) == []
    assert [s.weight for s in _pools(new)[0].tiers[0].servers] == [100, 100, 100, 129]
    # Promotion: the canary's fields into the recipe, the block dropped. Each of the recipe's
    # replicas rolls onto the new version; the canary's replica is retired.
    promoted = config()
    voice(promoted)["simulate"] = NEW
    old, new, plan = _plan(with_canary, promoted)
    assert [s.replica for s in plan.steps] == [f"voice.local.n{i}.0" for i in range(3)]
    assert all(s.changed == ("simulate",) for s in plan.steps)
    assert plan.removed == ("voice-canary.local.n3.0",) and plan.added == ()
    assert retiring_replicas(old, plan) == plan.removed
    assert local_problems(old, new, plan) == []
    # Retirement: the block dropped; only the canary's replica goes.
    old, new, plan = _plan(with_canary, config())
    assert plan.steps == () and retiring_replicas(old, plan) == ("voice-canary.local.n3.0",)
    assert local_problems(old, new, plan) == []
    # Bringing a canary in: its replica is started; nothing else moves or restarts.
    old, new, plan = _plan(config(), with_canary)
    assert plan.steps == () and starting_replicas(new, plan) == ("voice-canary.local.n3.0",)
    assert local_problems(old, new, plan) == []
    assert "canary" in LOCAL_FIELDS
    # Any other replica that placement adds or removes is still a restart's.
    old, new, plan = _plan(
        config(), {**config(), "denv:recipes": [{**voice(config()), "spare": 2}]}
    )
    assert local_problems(old, new, plan) == [
        "recipes[voice].spare: changed; a local roll restarts replicas only; `denv local down`"
        " then `denv local up` apply it"
    ]


def _replica(rid: str, state: str, weight: int, ttft: float | None, ttime: int | None) -> Any:
    return ReplicaStatus(
        rid,
        rid.split(".")[0],
        "local",
        rid.split(".")[2],
        "voice.tier10",
        state,
        weight,
        0,
        "",
        probe_ttft_ms=ttft,
        served=10,
        total_ms=ttime,
    )


def test_status_shows_both_versions_side_by_side() -> None:
    stack = read_stack("t", config(share=0.1, simulate=NEW))
    replicas = [
        _replica("voice.local.n0.0", "UP", 100, 21.0, 200),
        _replica("voice.local.n1.0", "UP", 100, 23.0, 220),
        _replica("voice.local.n2.0", "DRAIN", 0, 22.0, None),
        _replica("voice-canary.local.n3.0", "UP", 33, 31.5, 300),
    ]
    (pool,) = pool_statuses(stack, replicas)
    assert (pool.pool, pool.healthy, pool.min_warm, pool.canary_pool) == (
        "voice",
        2,
        2,
        "voice-canary",
    )
    stable, new = pool.versions
    assert (stable.version, stable.replicas, stable.ready, stable.served) == ("stable", 3, 2, 30)
    assert stable.probe_ttft_ms == 22.0 and stable.total_ms == 210.0
    assert (new.version, new.pool, new.ready, new.probe_ttft_ms) == (
        "canary",
        "voice-canary",
        1,
        31.5,
    )
    # The share now, by the weights of the ready replicas: 33 of 233 (one stable drained).
    assert stable.share_now is not None and new.share_now is not None
    assert round(new.share_now, 3) == round(33 / 233, 3) and new.share_stack == 0.1
    assert round(stable.share_now + new.share_now, 9) == 1
    # The canary is no part of min_warm: the pool is short with one stable replica ready.
    short = [replace_state(r, "DOWN") if r.id == "voice.local.n1.0" else r for r in replicas]
    assert not pool_statuses(stack, short)[0].ok


def replace_state(replica: ReplicaStatus, state: str) -> ReplicaStatus:
    from dataclasses import replace

    return replace(replica, state=state)


def test_the_min_warm_alert_counts_the_recipes_replicas_alone() -> None:
    rules = alert_rules(read_stack("t", config(share=0.1, simulate=NEW)))
    assert 'server!~"voice-canary[.].*"' in rules
    assert rules.count("alert: DenvPoolBelowMinWarm") == 1


def test_plan_shows_the_share_the_weights_give_per_tier() -> None:
    stack = read_stack("t", config(share=0.1, simulate=NEW))
    plan = make_plan(stack)
    assert canary_tier_shares(stack, plan.placement, "voice") == (pytest.approx(33 / 333),)
    console = Console(record=True, width=200)
    render_plan(plan, console)
    assert "canary of voice: 10 % of new sessions (by weight, per tier: 9.9 %)" in (
        console.export_text()
    )
