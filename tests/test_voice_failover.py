"""Realtime failover figures from the sessions' outcomes: cuts by kind, stalls, replays by the
replicas' own logs, failed reconnects, and the close and reconnect times."""

import pytest

from denv_iac.ops.voice_failover import FailoverReport, SessionOutcome, count_replayed

VICTIM = "voice.a.n0.0"
OTHER = "voice.b.n1.0"


def outcome(
    name: str,
    cut: str = "aborted",
    cut_at: float | None = 10.02,
    reconnect_error: str = "",
    reconnect_ms: float | None = 12.0,
    replica: str = OTHER,
    after: str = "",
    idle: bool = False,
) -> SessionOutcome:
    if not cut:
        return SessionOutcome(name, f"id-{name}", OTHER, "", None, False, "", None, "", "")
    new = "" if reconnect_error else replica
    return SessionOutcome(
        name, f"id-{name}", VICTIM, cut, cut_at, idle, reconnect_error, reconnect_ms, new, after
    )


def test_a_clean_failover() -> None:
    outcomes = (
        outcome("s0", reconnect_ms=10.0),
        outcome("s1", cut_at=10.05, reconnect_ms=30.0, idle=True),
        outcome("s2", cut=""),
    )
    report = FailoverReport(VICTIM, 10.0, outcomes, 0)
    assert report.figures() == {
        "sessions": 3,
        "cut": 2,
        "cut_as": {"aborted": 2},
        "cut_idle": 1,
        "stalled": 0,
        "replayed": 0,
        "failed_reconnects": 0,
        "reconnected_elsewhere": 2,
        "close_after_kill_max_ms": 50.0,
        "reconnect_p50_ms": 10.0,  # nearest rank, as every percentile of the load client
        "reconnect_max_ms": 30.0,
    }


def test_stalls_failed_reconnects_and_reconnects_to_the_same_replica_are_counted() -> None:
    outcomes = (
        outcome("s0", cut="timeout", cut_at=15.0),  # no close: found by the client's timeout
        outcome("s1", reconnect_error="http_503", reconnect_ms=None),
        outcome("s2", after="aborted"),  # served, but its first turn broke off
        outcome("s3", cut="closed", replica=VICTIM),  # the victim was back already
    )
    figures = FailoverReport(VICTIM, 10.0, outcomes, 1).figures()
    assert figures["cut_as"] == {"aborted": 2, "closed": 1, "timeout": 1}
    assert figures["stalled"] == 1 and figures["replayed"] == 1
    assert figures["failed_reconnects"] == 2
    assert figures["reconnected_elsewhere"] == 2
    assert figures["close_after_kill_max_ms"] == 5000.0


def test_nothing_cut_has_no_times() -> None:
    figures = FailoverReport(VICTIM, 10.0, (outcome("s0", cut=""),), 0).figures()
    assert figures["cut"] == 0 and figures["reconnect_max_ms"] is None
    assert figures["close_after_kill_max_ms"] is None


@pytest.mark.parametrize(
    ("seen", "replayed"),
    [
        ({}, 0),  # the victim's log went with it
        ({"id-s0": [VICTIM]}, 0),
        ({"id-s0": [OTHER]}, 1),  # the opening request reached another replica
        ({"id-s0": [VICTIM, VICTIM]}, 1),  # or its own twice
        ({"id-s2": [OTHER, OTHER]}, 0),  # a session never cut cannot be replayed
    ],
)
def test_replays_by_the_replicas_logs(seen: dict[str, list[str]], replayed: int) -> None:
    outcomes = (outcome("s0"), outcome("s2", cut=""))
    assert count_replayed(outcomes, seen) == replayed
