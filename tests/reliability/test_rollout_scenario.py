"""A recipe change rolled under chat streams and realtime conversations on the local data plane
(make reliability runs it at full load): nothing lost, nothing cut within the drain bound, the
long call that outlived it counted and named, min_warm ready at every sample, and a second roll
applying nothing."""

import pytest

from benchmarks.rollout_reliability import MIN_WARM, Load, Outcome, run_scenario

pytestmark = pytest.mark.needs_haproxy


def test_a_recipe_change_rolls_under_realtime_load_keeping_the_contract() -> None:
    outcome = run_scenario(Load(chat_workers=3, realtime_workers=3))
    assert outcome.problems() == [], outcome
    assert outcome.realtime_turns and outcome.requests > outcome.realtime_turns
    assert len(outcome.per_replica_s) == 3 and outcome.min_ready >= MIN_WARM
    # The long call outlived the drain bound: cut, and the roll named its replica.
    (call,) = outcome.long_calls
    assert call["outcome"] in ("aborted", "closed") and outcome.cut_past_drain == {
        call["replica"]: 1
    }


GOOD = Outcome(
    requests=10,
    realtime_turns=5,
    long_calls=[{"replica": "r1", "outcome": "aborted"}],
    cut_past_drain={"r1": 1},
    min_ready=MIN_WARM,
    samples=4,
    second_roll_steps=0,
)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({}, None),
        ({"lost": 1}, "1 request(s) lost"),
        ({"cut": 2}, "2 stream(s) or session(s) cut within the drain bound"),
        ({"min_ready": MIN_WARM - 1}, f"ready replicas fell to {MIN_WARM - 1}"),
        ({"second_roll_steps": 3}, "a second roll restarted 3"),
        ({"cut_past_drain": {}}, "long calls cut on ['r1'], the roll named {}"),
        ({"cut_past_drain": {"r2": 1}}, "long calls cut on ['r1'], the roll named {'r2': 1}"),
        ({"samples": 0}, "no sample of the pool"),
    ],
)
def test_each_broken_promise_is_a_problem(change: dict[str, object], problem: str | None) -> None:
    outcome = Outcome(**{**GOOD.__dict__, **change})
    assert outcome.problems() == ([problem] if problem else [])
