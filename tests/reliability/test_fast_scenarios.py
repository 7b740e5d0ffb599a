"""The fast subset of the reliability scenarios: nothing lost, replayed or hung, and the pool
back at full strength after every fault."""

import pytest

from benchmarks.reliability import FAST, PARTITION, SCENARIOS, Scenario, run_scenario
from tests.timing import DETECTION_SLACK_S, RECOVERY_SLACK_S, assert_within

# Each scenario asserts detection, overshoot and recovery bounds in wall-clock time.
pytestmark = [pytest.mark.timing, pytest.mark.needs_haproxy]
OVERSHOOT_IN_SUITE_MS = 400
# The done-when line of the recovery work: a replica whose fault cleared serves within 1 s.
RECOVERED_WITHIN_MS = 1000
# Recovery that waits on more than a health check: the agent's first-token probe (every
# second, over a few samples) restores a lowered weight; a restarted process must start first.
SLOW_RECOVERY_MS = {
    "replica 5x slower to first token": 5000,
    "replica drips a token every 1500 ms": 5000,
    # Counted from the fault: the whole repair (drain, restart, verify, undrain) is in it.
    "node repaired under load": 3000,
    "replica dies mid-stream": 2500,
    "agent killed and restarted": 2500,
    "balancer killed, second takes over": 2500,
    # A health check still waiting on the hung replica must time out first (500 ms).
    "replica accepts, never answers": 1500,
}


def _check(scenario: Scenario, duration_s: float) -> None:
    outcome = run_scenario(scenario, concurrency=16, duration_s=duration_s)
    assert outcome.requests > 100
    assert (outcome.lost, outcome.replayed) == (0, 0), outcome
    # `make reliability` counts a wait 100 ms past its budget as hung (the healthy replica's
    # own 30 ms first token included); these runs share two cores with the rest of the suite.
    if scenario.healthy_left:
        # With nothing healthy left the answer is a 503, which under the suite's load was seen
        # to take up to 1.9 s; `make reliability` reports it as hung all the same.
        assert outcome.worst_overshoot_ms < OVERSHOOT_IN_SUITE_MS, outcome
    # Detection and recovery wait on checks and agent polls, each a task scheduled on two cores
    # shared with the rest of the suite: `make reliability` holds the scenario's own bounds, the
    # suite adds tests/timing.py's margins (a detection 79 ms past its 500 ms with `make bench`
    # beside; recoveries up to 0.46 s past theirs at a load of 7).
    if scenario.faulty is not None:
        assert outcome.detection_ms is not None
        assert_within(
            outcome.detection_ms / 1000,
            scenario.detect_within_ms / 1000,
            f"{scenario.name}: detection",
            DETECTION_SLACK_S,
        )
    assert outcome.recovered_ms is not None, outcome
    assert_within(
        outcome.recovered_ms / 1000,
        SLOW_RECOVERY_MS.get(scenario.name, RECOVERED_WITHIN_MS) / 1000,
        f"{scenario.name}: recovery",
        RECOVERY_SLACK_S,
    )


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.name in FAST], ids=FAST)
def test_scenario(scenario: Scenario) -> None:
    _check(scenario, duration_s=6)


@pytest.mark.needs_netns
def test_site_partitioned_then_healed() -> None:
    (scenario,) = [s for s in SCENARIOS if s.name == PARTITION]
    _check(scenario, duration_s=6)
