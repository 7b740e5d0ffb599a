"""The drain rule, one plan for nodes, pods and local rolls (denv_iac.core.drain)."""

from denv_iac.core.drain import DrainPlan, drain_plan, quiet_window_s
from denv_iac.core.stack.model import DRAIN_TIMEOUT_S, QUIET_CONNECTION_S, RecipeSpec


def _recipe(name: str, **fields: int) -> RecipeSpec:
    return RecipeSpec(name=name, share="whole", tiers=(("a",),), min_warm=1, **fields)


def test_the_plan_takes_the_longest_bound_and_the_longest_silence() -> None:
    recipes = [
        _recipe("a", drain_timeout_s=30, stall_timeout_ms=90_500),
        _recipe("b", drain_timeout_s=300, first_token_timeout_ms=10_000),
    ]
    assert drain_plan(recipes, settle_s=3) == DrainPlan(settle_s=3, quiet_s=91, bound_s=300)


def test_the_quiet_window_is_never_shorter_than_a_pooled_connections() -> None:
    assert quiet_window_s([_recipe("a", stall_timeout_ms=1000)]) == QUIET_CONNECTION_S
    assert quiet_window_s([]) == QUIET_CONNECTION_S


def test_the_settle_time_never_passes_the_bound() -> None:
    assert drain_plan([_recipe("a", drain_timeout_s=2)], settle_s=5.0).settle_s == 2
    assert drain_plan([], settle_s=1.4) == DrainPlan(1.4, QUIET_CONNECTION_S, DRAIN_TIMEOUT_S)
