"""The one poll-until-deadline loop, on a fake clock: when it asks, sleeps, returns and gives up."""

from dataclasses import dataclass, field

import pytest

from denv_iac.core.polling import SleptClock, poll_until, poll_until_or_last


class TimedOut(Exception):
    pass


@dataclass
class Fake:
    """A clock that moves only when slept through or asked a question that takes time."""

    answers: list[int]
    probe_s: float = 0.0
    now: float = 0.0
    asked_at: list[float] = field(default_factory=list)
    slept: list[float] = field(default_factory=list)

    def probe(self) -> int:
        self.asked_at.append(self.now)
        self.now += self.probe_s
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _poll(fake: Fake, timeout_s: float, interval_s: float, wait_first: bool = False) -> int:
    return poll_until(
        fake.probe,
        lambda answer: answer >= 3,
        timeout_s=timeout_s,
        interval_s=interval_s,
        clock=lambda: fake.now,
        sleep=fake.sleep,
        timed_out=lambda answer: TimedOut(f"still {answer}"),
        wait_first=wait_first,
    )


# answers (the last repeats), probe_s, timeout_s, interval_s, wait_first; then what comes back
# (an answer, or the timeout's message) and the times the probe was asked at.
CASES = [
    ("done at once", [3], 0, 10, 5, False, 3, [0]),
    ("done on the third try", [1, 2, 3], 0, 10, 5, False, 3, [0, 5, 10]),
    ("done on the last try before the deadline", [1, 2, 4], 0, 10, 5, False, 4, [0, 5, 10]),
    ("never done: one try at the deadline", [1], 0, 10, 5, False, "still 1", [0, 5, 10]),
    ("a deadline between tries: one past it", [2], 0, 12, 5, False, "still 2", [0, 5, 10, 15]),
    ("slow answers count against the wait", [0], 4, 10, 5, False, "still 0", [0, 9]),
    ("no wait at all: one try", [0, 3], 0, 0, 5, False, "still 0", [0]),
    ("the error gets the last answer", [0, 1, 2], 0, 10, 5, False, "still 2", [0, 5, 10]),
    ("wait first: a pause before the first try", [1, 3], 0, 10, 5, True, 3, [5, 10]),
    ("wait first, never done", [1], 0, 10, 5, True, "still 1", [5, 10]),
]


@pytest.mark.parametrize(
    ("answers", "probe_s", "timeout_s", "interval_s", "wait_first", "outcome", "asked_at"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_poll_until(
    answers: list[int],
    probe_s: float,
    timeout_s: float,
    interval_s: float,
    wait_first: bool,
    outcome: int | str,
    asked_at: list[float],
) -> None:
    fake = Fake(list(answers), probe_s)
    if isinstance(outcome, str):
        with pytest.raises(TimedOut, match=f"^{outcome}$"):
            _poll(fake, timeout_s, interval_s, wait_first)
    else:
        assert _poll(fake, timeout_s, interval_s, wait_first) == outcome
    assert fake.asked_at == asked_at
    # A pause between tries (and before the first when asked), never after the last.
    assert fake.slept == [interval_s] * (len(asked_at) - 1 + wait_first)


@pytest.mark.parametrize(
    ("answers", "probe_s", "timeout_s", "interval_s", "wait_first", "outcome", "asked_at"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_poll_until_or_last(
    answers: list[int],
    probe_s: float,
    timeout_s: float,
    interval_s: float,
    wait_first: bool,
    outcome: int | str,
    asked_at: list[float],
) -> None:
    """The same tries as poll_until's; where that one raises, the last answer comes back."""
    fake = Fake(list(answers), probe_s)
    answer = poll_until_or_last(
        fake.probe,
        lambda answer: answer >= 3,
        timeout_s=timeout_s,
        interval_s=interval_s,
        clock=lambda: fake.now,
        sleep=fake.sleep,
        wait_first=wait_first,
    )
    assert answer == (outcome if isinstance(outcome, int) else int(outcome.split()[-1]))
    assert fake.asked_at == asked_at
    assert fake.slept == [interval_s] * (len(asked_at) - 1 + wait_first)


def test_what_the_probe_raises_ends_the_wait_at_once() -> None:
    asked: list[int] = []

    def probe() -> int:
        asked.append(1)
        if len(asked) == 2:
            raise TimedOut("gone")
        return 0

    with pytest.raises(TimedOut, match=r"^gone$"):
        poll_until(
            probe,
            bool,
            timeout_s=60,
            interval_s=1,
            clock=lambda: 0.0,
            sleep=lambda _: None,
            timed_out=lambda _: AssertionError("not a timeout"),
        )
    assert len(asked) == 2


def test_a_slept_clock_counts_the_pauses_only() -> None:
    slept: list[float] = []
    clock = SleptClock(slept.append)
    asked = []

    def probe() -> int:
        asked.append(clock.clock())
        return 0

    with pytest.raises(TimedOut):
        poll_until(
            probe,
            bool,
            timeout_s=30,
            interval_s=10,
            clock=clock.clock,
            sleep=clock.sleep,
            timed_out=lambda _: TimedOut(),
        )
    # The sleep itself returned at once: the wait still ended, after 30 s of pauses.
    assert asked == [0, 10, 20, 30] and slept == [10, 10, 10] and clock.slept_s == 30
