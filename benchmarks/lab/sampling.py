"""A sampler that reads something (a pool's rows, a replica's load) in a thread of its own while
load runs: the reliability benchmarks' and the engine tests' view of a run as it goes."""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


@contextmanager
def sampling(take: Callable[[], T], every_s: float) -> Iterator[list[T]]:
    """`take()` every `every_s` in a thread of its own while the block runs (after a first
    wait of `every_s`): the list of samples, in order, grows as the block runs. A sample that
    raised stops the sampling and raises once the block is done."""
    samples: list[T] = []
    failed: list[Exception] = []
    stop = threading.Event()

    def sample() -> None:
        try:
            while not stop.wait(every_s):
                samples.append(take())
        except Exception as error:
            failed.append(error)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield samples
    finally:
        stop.set()
        sampler.join()
    if failed:
        raise failed[0]
