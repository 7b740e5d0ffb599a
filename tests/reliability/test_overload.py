"""The fast cases of `make reliability`'s overload and zombie scenarios (benchmarks/overload.py):
a pool at twice its capacity cuts no stream, answers what it cannot serve with a 503 within the
first-token budget, and keeps serving at its capacity; a zombie engine is out of rotation within
2 s with the stack's defaults, costing only the turns in flight on it."""

import pytest

from benchmarks.observe_bench import busy_stack
from benchmarks.overload import ZOMBIE_OUT_MS, run_levels, run_zombie
from denv_iac.core.stack.model import FIRST_TOKEN_TIMEOUT_MS
from tests.timing import DETECTION_SLACK_S, RECOVERY_SLACK_S, assert_within

pytestmark = [pytest.mark.timing, pytest.mark.needs_haproxy]

# Back at full strength once the zombie makes tokens again: an agent's metrics poll, its own
# request, an agent check.
RECOVERED_WITHIN_S = 1.5


def test_twice_the_capacity_is_served_at_capacity_and_the_rest_refused_in_budget() -> None:
    (level,) = run_levels((2.0,), duration_s=5.0)
    assert level.requests > 100, level
    # On healthy replicas no stream is ever cut, however loaded the pool.
    assert level.cut == 0, level
    # Every request not served was answered 503/429, none timed out or failed otherwise.
    assert level.other_errors == {}, level
    assert level.shed > 0 and level.worst_shed_ms is not None, level
    assert level.completed + level.shed == level.requests, level
    assert_within(
        level.worst_shed_ms / 1000, FIRST_TOKEN_TIMEOUT_MS / 1000, "pool full: the 503's wait"
    )
    # Busy is not broken: no replica left rotation, however full.
    assert level.left_rotation == (), level
    # The slots stay busy: completions with their first token in budget at 90 % of capacity.
    assert level.goodput >= 0.9, level


def test_a_zombie_is_out_within_2_s_with_the_defaults_and_cuts_only_its_turns() -> None:
    zombie = run_zombie(duration_s=9.0)
    assert zombie.out_of_rotation_ms is not None, zombie
    assert_within(
        zombie.out_of_rotation_ms / 1000,
        ZOMBIE_OUT_MS / 1000,
        "zombie out of rotation (stack defaults)",
        DETECTION_SLACK_S,
    )
    # The turns it held are cut by the stall budget; every other turn is served or refused.
    assert zombie.cut == zombie.cut_in_flight, zombie
    assert zombie.other_errors == {}, zombie
    assert zombie.completed + zombie.cut + zombie.shed == zombie.requests, zombie
    assert zombie.recovered_ms is not None, zombie
    assert_within(
        zombie.recovered_ms / 1000,
        RECOVERED_WITHIN_S,
        "zombie cleared: back at full strength",
        RECOVERY_SLACK_S,
    )


def test_an_engine_answering_503_when_its_queue_is_full_stays_in_rotation() -> None:
    """Busy is not broken on live traffic too: the balancer's passive checks (`observe layer4`)
    leave a replica whose engine refuses work past its queue in rotation, where `observe layer7`
    took both replicas out (docs/balancer.md, "Passive checks")."""
    (level,) = run_levels((2.0,), duration_s=5.0, stack=busy_stack())
    assert level.shed > 0, level  # the engines did answer 503
    assert level.cut == 0 and level.other_errors == {}, level
    assert level.left_rotation == (), level
    assert level.goodput >= 0.85, level
