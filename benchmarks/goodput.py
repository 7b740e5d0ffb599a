"""What a pool did with the requests sent to it under load, counted one way for every benchmark
that reports goodput: `make bench` (overload_bench, the balancer beside a peer router) and `make
reliability` (overload, the levels and the zombie).

Each request is one of:
- completed (the whole answer), and of those, within budget: the first token came within the
  first-token budget (a first token exactly at the budget is within it);
- cut: an answer that began and broke off (the router or a replica ended it mid-stream);
- rejected: answered 503 or 429 before any stream, with how long that answer took;
- another error, by name: `timeout` is the client giving up on silence, the rest (connect,
  no_response, bad_answer...) a request the pool neither served nor refused.

Goodput: requests completed within budget per second, as a share of the pool's capacity (1.0:
the pool did all it can). Which requests count and over how many seconds is the caller's: a
window of send times after a warm-up (overload_bench), or the whole run (overload).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from denv_iac.ops.loadgen_report import StreamResult, percentile

REJECTED = ("http_503", "http_429")
CUT = ("aborted", "closed")  # a stream or a realtime session ended mid-answer
GAVE_UP = "timeout"


@dataclass(frozen=True)
class Tally:
    """The requests of one run (or of a window of it), sorted by what they got."""

    sent: int
    completed: int
    within_budget: int
    cut: tuple[StreamResult, ...]
    rejected: tuple[StreamResult, ...]
    other_errors: dict[str, int]  # by name, sorted; `timeout` (gave up) among them
    firsts_ms: tuple[float, ...]  # the first token of each completed request

    @property
    def gave_up(self) -> int:
        return self.other_errors.get(GAVE_UP, 0)

    @property
    def worst_rejected_ms(self) -> float | None:
        """The longest any rejected request waited for its 503/429, to 0.1 ms."""
        return round(max(r.total_ms for r in self.rejected), 1) if self.rejected else None

    def ttft_ms(self, q: float) -> float | None:
        """Percentile `q` of the completed requests' first tokens, to 0.1 ms."""
        value = percentile(list(self.firsts_ms), q)
        return None if value is None else round(value, 1)

    def goodput(self, seconds: float, capacity_rps: float) -> float:
        """Completed within budget per second of `seconds`, over the capacity, to 0.001."""
        return round(self.within_budget / seconds / capacity_rps, 3) if seconds else 0.0


def tally(
    results: Sequence[StreamResult],
    budget_ms: float,
    since_s: float = 0.0,
    until_s: float = math.inf,
) -> Tally:
    """The requests sent from `since_s` until before `until_s` (seconds into the run)."""
    counted = [r for r in results if since_s <= r.started_s < until_s]
    completed = [r for r in counted if r.ok]
    firsts = tuple(r.ttft_ms for r in completed if r.ttft_ms is not None)
    others = Counter(r.error for r in counted if r.error and r.error not in (*CUT, *REJECTED))
    return Tally(
        sent=len(counted),
        completed=len(completed),
        within_budget=sum(1 for ms in firsts if ms <= budget_ms),
        cut=tuple(r for r in counted if r.error in CUT),
        rejected=tuple(r for r in counted if r.error in REJECTED),
        other_errors=dict(sorted(others.items())),
        firsts_ms=firsts,
    )


def account(
    results: Sequence[StreamResult],
    *,
    since_s: float,
    until_s: float,
    capacity_rps: float,
    budget_ms: float,
) -> dict[str, float]:
    """One router's figures at one level of `make bench`, from what each request sent between
    `since_s` and `until_s` (seconds into the run) got; counts are shares of those sent.

    Counted by the time a request was sent: in a FIFO queue a request's fate depends on those
    before it only, so the requests of an interval that starts once the queues are full are
    served at the pool's rate whatever comes after, and goodput over capacity is at most 1.
    """
    window_s = until_s - since_s
    counted = tally(results, budget_ms, since_s, until_s)
    rejected_ms = [r.total_ms for r in counted.rejected]

    def share(count: int) -> float:
        return round(count / counted.sent, 3) if counted.sent else 0.0

    return {
        "offered": round(counted.sent / window_s / capacity_rps, 3),
        "goodput": counted.goodput(window_s, capacity_rps),
        "completed_late": share(counted.completed - counted.within_budget),
        "ttft_p50_ms": counted.ttft_ms(50) or 0.0,
        "ttft_p90_ms": counted.ttft_ms(90) or 0.0,
        "cut": share(len(counted.cut)),
        "gave_up": share(counted.gave_up),
        "rejected": share(len(counted.rejected)),
        "rejected_p50_ms": round(percentile(rejected_ms, 50) or 0.0, 1),
        "rejected_p99_ms": round(percentile(rejected_ms, 99) or 0.0, 1),
        "rejected_max_ms": counted.worst_rejected_ms or 0.0,
        "other_errors": share(sum(counted.other_errors.values()) - counted.gave_up),
    }
