"""The fast subset of the reliability scenarios: nothing lost, nothing replayed."""

import shutil

import pytest

from benchmarks.reliability import FAST, SCENARIOS, Scenario, run_scenario

if shutil.which("haproxy") is None:
    pytest.skip("HAProxy is not installed (make setup installs it)", allow_module_level=True)


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.name in FAST], ids=FAST)
def test_scenario(scenario: Scenario) -> None:
    outcome = run_scenario(scenario, concurrency=16, duration_s=4.5)
    assert outcome.requests > 100
    assert outcome.lost == 0
    assert outcome.replayed == 0
    if scenario.faulty is not None:
        assert outcome.detection_ms is not None
        assert outcome.detection_ms < scenario.detect_within_ms
