"""An open-loop run's schedule: Poisson arrivals at a rate, seeded, some of them turns of
conversations kept going a few at a time; and what is wrong with a run's settings.
"""

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    """One request of an open-loop run: when it is sent (seconds since the run started) and the
    conversation it belongs to (`session`, None for a request of its own)."""

    at_s: float
    session: str | None = None


# An open-loop run keeps this many conversations going at once: a session arrival is a turn of
# one of them, so a conversation's turns are spread over the run rather than back to back.
OPEN_SESSIONS = 8


def arrivals(
    rate: float,
    *,
    requests: int | None = None,
    duration_s: float | None = None,
    session_share: float = 0.0,
    session_turns: int = 0,
    open_sessions: int = OPEN_SESSIONS,
    seed: int = 0,
) -> Iterator[Arrival]:
    """Poisson arrivals at `rate` requests/s, until `requests` of them or `duration_s`, whichever
    comes first; the same seed gives the same run. A share `session_share` of them are turns of
    conversations of `session_turns` turns each: `open_sessions` go on at once, each turn goes to
    one of them at random, and a conversation that had its last turn gives way to a new one."""
    problems = open_loop_problems(rate, session_share, session_turns)
    if problems:
        raise ValueError("; ".join(problems))
    if requests is None and duration_s is None:
        raise ValueError("give duration_s or requests")
    draw = random.Random(seed)
    live: list[list[int]] = []  # [conversation number, turns taken]
    started = 0
    at_s, count = 0.0, 0
    while requests is None or count < requests:
        at_s += draw.expovariate(rate)
        if duration_s is not None and at_s >= duration_s:
            return
        count += 1
        if draw.random() >= session_share:
            yield Arrival(at_s)
            continue
        if len(live) < open_sessions:
            live.append([started, 0])
            started += 1
        slot = draw.randrange(len(live))
        conversation = live[slot]
        conversation[1] += 1
        yield Arrival(at_s, f"o{seed}-c{conversation[0]}")
        if conversation[1] >= session_turns:
            live[slot] = [started, 0]
            started += 1


def open_loop_problems(rate: float, session_share: float, session_turns: int) -> list[str]:
    """What is wrong with an open-loop run's settings, one line each, naming the fix."""
    problems = []
    if not (math.isfinite(rate) and rate > 0):
        problems.append(f"rate: {rate} is not a positive number of requests/s; e.g. 5")
    if not 0.0 <= session_share <= 1.0:
        problems.append(f"session share: {session_share} is not between 0 and 1; e.g. 0.5")
    elif session_share > 0 and session_turns < 1:
        problems.append("session share: needs turns per conversation (session turns), e.g. 4")
    return problems
