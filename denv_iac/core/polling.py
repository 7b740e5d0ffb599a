"""The one poll-until-deadline loop: ask again, at an interval, until the answer will do or the
time is up.

The API clients wait on a cloud this way (a booting instance, a terminating one, a resource still
held, a firewall being switched), a node deploy waits on a rebooting machine, HAProxy's start
waits on its stats socket, and the local runner on its processes, ports and HAProxy's view of a
rolled replica. The caller gives the clock and the sleep, so that this module reads no
time itself (it is part of the pure core) and a test runs any wait on a fake clock in no time.
"""

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_until(
    probe: Callable[[], T],
    done: Callable[[T], bool],
    *,
    timeout_s: float,
    interval_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    timed_out: Callable[[T], Exception],
    wait_first: bool = False,
) -> T:
    """The first answer of `probe` that is `done`, asked every `interval_s`.

    Past `timeout_s` (counted from the call) an answer that is not done raises
    `timed_out(answer)`, so the error can say what the last answer was. `wait_first` sleeps before
    the first question too: a machine just told to reboot still answers from its old boot. What
    `probe` raises is not caught: an answer that can never become done raises at once.
    """
    answer, finished = _poll(probe, done, timeout_s, interval_s, clock, sleep, wait_first)
    if not finished:
        raise timed_out(answer)
    return answer


def poll_until_or_last(
    probe: Callable[[], T],
    done: Callable[[T], bool],
    *,
    timeout_s: float,
    interval_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    wait_first: bool = False,
) -> T:
    """As `poll_until`, but past `timeout_s` the last answer comes back instead of an error: for
    a wait whose end is not a failure (processes given time to exit before what follows goes on
    anyway) or whose caller reports what was left (sessions still open when a drain is cut)."""
    return _poll(probe, done, timeout_s, interval_s, clock, sleep, wait_first)[0]


def _poll(
    probe: Callable[[], T],
    done: Callable[[T], bool],
    timeout_s: float,
    interval_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    wait_first: bool,
) -> tuple[T, bool]:
    """The last answer asked, and whether it is done."""
    deadline = clock() + timeout_s
    if wait_first:
        sleep(interval_s)
    while True:
        answer = probe()
        if done(answer):
            return answer, True
        if clock() >= deadline:
            return answer, False
        sleep(interval_s)


class SleptClock:
    """A clock that reads the time slept through it, and nothing else.

    A wait bounded by it counts its pauses only, not the time its requests take; and with a sleep
    that returns at once (a test's) it still ends, after the same number of questions.
    """

    def __init__(self, sleep: Callable[[float], None]) -> None:
        self._sleep = sleep
        self.slept_s = 0.0

    def clock(self) -> float:
        return self.slept_s

    def sleep(self, seconds: float) -> None:
        self._sleep(seconds)
        self.slept_s += seconds
