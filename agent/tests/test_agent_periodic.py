"""Background rounds: start to start by default; a whole pause after each round when asked."""

import itertools
import threading
import time

import pytest
from denv_agent.periodic import start_periodic


@pytest.mark.parametrize(("pause_after", "least_gap_s"), [(False, 0.0), (True, 0.2)])
def test_a_round_longer_than_the_interval(pause_after: bool, least_gap_s: float) -> None:
    starts: list[float] = []

    def slow_round() -> None:
        starts.append(time.monotonic())
        time.sleep(0.3)  # longer than the interval

    stop = threading.Event()
    thread = start_periodic("t", 0.2, slow_round, stop, pause_after=pause_after)
    time.sleep(1.3)
    stop.set()
    thread.join(2)
    gaps = [b - a - 0.3 for a, b in itertools.pairwise(starts)]
    assert len(gaps) >= 2
    # Start to start: the next round begins as the last one ends; with a pause, an interval on.
    assert all(gap >= least_gap_s - 0.02 for gap in gaps)
    assert pause_after or all(gap < 0.1 for gap in gaps)
