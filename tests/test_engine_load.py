"""The sampler the reliability benchmarks and the engine tests share: it reads while the block
runs, keeps the samples in order, stops with the block, and does not hide a failed read."""

import itertools
import threading
import time

import pytest

from benchmarks.lab.sampling import sampling
from tests.engine_load import wait_for


def test_samples_are_taken_in_order_while_the_block_runs_and_stop_with_it() -> None:
    counter = itertools.count()
    with sampling(lambda: next(counter), 0.005) as samples:
        wait_for("three samples", lambda: len(samples) >= 3, 5)
    taken = len(samples)
    assert samples == list(range(taken))
    # Nothing is taken once the block is done.
    time.sleep(0.05)
    assert len(samples) == taken and next(counter) == taken


def test_a_failed_read_raises_once_the_block_is_done() -> None:
    reads = itertools.count()
    failed = threading.Event()

    def take() -> int:
        if (n := next(reads)) == 2:
            failed.set()
            raise OSError("the balancer's socket is gone")
        return n

    with pytest.raises(OSError, match="socket is gone"), sampling(take, 0.005) as samples:
        wait_for("the failed read", failed.is_set, 5)
        time.sleep(0.05)
    # The sampling stopped at the failure.
    assert samples == [0, 1] and next(reads) == 3
