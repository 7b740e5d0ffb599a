"""Realtime sessions through a balancer reload on the local data plane: 50 open sessions, each
mid-turn at the reload, none cut, stalled or replayed (the rest of `make reliability`'s realtime
scenarios run there: the demo test covers a replica killed mid-session)."""

import pytest

from benchmarks.realtime_reliability import SCENARIOS, failed, run_scenario

pytestmark = pytest.mark.needs_haproxy


def test_a_balancer_reload_cuts_none_of_50_open_sessions() -> None:
    (reload,) = [s for s in SCENARIOS if s.name.startswith("realtime: balancer reload")]
    row = run_scenario(reload)
    assert row["sessions"] == 50
    assert row["cut"] == 0 and not failed(row), row


@pytest.mark.parametrize(
    ("counts", "broken"),
    [
        ({"stalled": 0, "replayed": 0, "failed_reconnects": 0}, False),
        ({"stalled": 1, "replayed": 0, "failed_reconnects": 0}, True),
        ({"stalled": 0, "replayed": 1, "failed_reconnects": 0}, True),
        ({"stalled": 0, "replayed": 0, "failed_reconnects": 2}, True),
    ],
)
def test_the_contract_is_broken_by_a_stall_a_replay_or_a_failed_reconnect(
    counts: dict[str, object], broken: bool
) -> None:
    assert failed({"scenario": "s", "cut": 3, **counts}) is broken
