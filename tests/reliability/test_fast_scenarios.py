"""The fast subset of the reliability scenarios: nothing lost, nothing replayed."""

import shutil

import pytest

from benchmarks.reliability import FAST, PARTITION, SCENARIOS, Scenario, run_scenario
from denv_iac.local.netns import unavailable_reason

if shutil.which("haproxy") is None:
    pytest.skip("HAProxy is not installed (make setup installs it)", allow_module_level=True)

NO_NETNS = unavailable_reason()


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.name in FAST], ids=FAST)
def test_scenario(scenario: Scenario) -> None:
    outcome = run_scenario(scenario, concurrency=16, duration_s=4.5)
    assert outcome.requests > 100
    assert outcome.lost == 0
    assert outcome.replayed == 0
    if scenario.faulty is not None:
        assert outcome.detection_ms is not None
        assert outcome.detection_ms < scenario.detect_within_ms


@pytest.mark.skipif(NO_NETNS is not None, reason=NO_NETNS or "")
def test_site_partitioned() -> None:
    (scenario,) = [s for s in SCENARIOS if s.name == PARTITION]
    outcome = run_scenario(scenario, concurrency=16, duration_s=5)
    assert outcome.requests > 100
    assert outcome.lost == 0
    assert outcome.replayed == 0
    assert outcome.detection_ms is not None
    assert outcome.detection_ms < scenario.detect_within_ms
    # A partition sends no reset: streams caught on the far side fall silent, and the pool's
    # stall budget (1 s) cuts them, or the mark-down does, well before the client's own 10 s.
    if outcome.aborted:
        assert outcome.streams_cut_ms is not None and outcome.streams_cut_ms < 1500
