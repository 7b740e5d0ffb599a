"""The overload benchmarks' one accounting (benchmarks/goodput.py), on hand-made results:
goodput counts only requests sent in the counted window and completed with their first token
within budget, per second of that window, over capacity; `make bench` (overload_bench) and `make
reliability` (overload) read their figures from it."""

import pytest

from benchmarks.goodput import account, tally
from benchmarks.overload import count
from benchmarks.overload_bench import goodput_ratio
from denv_iac.ops.loadgen_report import LoadReport, StreamResult


def _result(
    error: str = "", ttft_ms: float | None = 100.0, total_ms: float = 900.0, sent_s: float = 5.0
) -> StreamResult:
    status = int(error.removeprefix("http_")) if error.startswith("http_") else 200
    return StreamResult("r", sent_s, status, error, "voice.a.n0.0", ttft_ms, total_ms, 19)


GOOD = _result()
LATE = _result(ttft_ms=1200.0)
AT_BUDGET = _result(ttft_ms=1000.0)
CUT = _result("aborted", ttft_ms=150.0)
GAVE_UP = _result("timeout", ttft_ms=None, total_ms=3000.0)
FULL = _result("http_503", ttft_ms=None, total_ms=1004.0)
LIMITED = _result("http_429", ttft_ms=None, total_ms=2.0)
REFUSED = _result("connect", ttft_ms=None, total_ms=1.0)
CLOSED = _result("closed", ttft_ms=80.0)
BAD = _result("bad_answer", ttft_ms=None)


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        # 20 good in a 10 s window at 2 requests/s of capacity: the pool did all it can.
        ([GOOD] * 20, {"offered": 1.0, "goodput": 1.0, "completed_late": 0.0, "rejected": 0.0}),
        # A first token exactly at the budget is in budget; one past it is late, not goodput.
        ([AT_BUDGET] * 10 + [LATE] * 10, {"goodput": 0.5, "completed_late": 0.5}),
        # Cut, abandoned, rejected and refused requests are sent but never goodput.
        (
            [GOOD] * 4 + [CUT, GAVE_UP, FULL, FULL, LIMITED, REFUSED],
            {
                "offered": 0.5,
                "goodput": 0.2,
                "cut": 0.1,
                "gave_up": 0.1,
                "rejected": 0.3,
                "rejected_p50_ms": 1004.0,
                "rejected_max_ms": 1004.0,
                "other_errors": 0.1,
            },
        ),
        # Twice the capacity offered, all of it in budget: goodput can exceed 1 only if the
        # capacity were wrong, and the figure shows it.
        ([GOOD] * 40, {"offered": 2.0, "goodput": 2.0}),
        ([], {"offered": 0.0, "goodput": 0.0, "cut": 0.0, "rejected_max_ms": 0.0}),
        # Sent during the warm-up or after the window: not counted at all.
        (
            [GOOD] * 10
            + [_result(sent_s=1.9), _result(sent_s=12.0), _result("http_503", sent_s=0)],
            {"offered": 0.5, "goodput": 0.5, "rejected": 0.0},
        ),
        ([_result(sent_s=2.0), _result(sent_s=11.99)], {"offered": 0.1, "goodput": 0.1}),
    ],
)
def test_goodput_accounting(results: list[StreamResult], expected: dict[str, float]) -> None:
    figures = account(results, since_s=2.0, until_s=12.0, capacity_rps=2.0, budget_ms=1000.0)
    assert {key: figures[key] for key in expected} == expected


def test_ttft_figures_are_those_of_completed_requests() -> None:
    completed = [_result(ttft_ms=float(ms)) for ms in range(100, 1100, 100)]
    # Streams cut soon after their first token would pull the percentiles down if counted.
    figures = account(
        completed + [_result("aborted", ttft_ms=1.0)] * 5,
        since_s=0.0,
        until_s=10.0,
        capacity_rps=10.0,
        budget_ms=1000.0,
    )
    assert (figures["ttft_p50_ms"], figures["ttft_p90_ms"]) == (500.0, 900.0)


@pytest.mark.parametrize(
    ("product", "peer", "ratio"),
    [(0.9, 0.3, 3.0), (0.5, 0.5, 1.0), (0.2, 0.4, 0.5), (0.9, 0.0, None)],
)
def test_goodput_ratio(product: float, peer: float, ratio: float | None) -> None:
    assert goodput_ratio({"goodput": product}, {"goodput": peer}) == ratio


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        (
            [GOOD, AT_BUDGET, LATE, CUT, CLOSED, GAVE_UP, FULL, LIMITED, REFUSED, BAD],
            {
                "sent": 10,
                "completed": 3,
                "within_budget": 2,
                "cut": 2,
                "rejected": 2,
                "worst_rejected_ms": 1004.0,
                "other_errors": {"bad_answer": 1, "connect": 1, "timeout": 1},
                "gave_up": 1,
                "ttft_p50_ms": 1000.0,
            },
        ),
        (
            [],
            {
                "sent": 0,
                "completed": 0,
                "within_budget": 0,
                "cut": 0,
                "rejected": 0,
                "worst_rejected_ms": None,
                "other_errors": {},
                "gave_up": 0,
                "ttft_p50_ms": None,
            },
        ),
    ],
)
def test_each_request_is_counted_once_by_what_it_got(
    results: list[StreamResult], expected: dict[str, object]
) -> None:
    counted = tally(results, budget_ms=1000.0)
    figures = {
        "sent": counted.sent,
        "completed": counted.completed,
        "within_budget": counted.within_budget,
        "cut": len(counted.cut),
        "rejected": len(counted.rejected),
        "worst_rejected_ms": counted.worst_rejected_ms,
        "other_errors": counted.other_errors,
        "gave_up": counted.gave_up,
        "ttft_p50_ms": counted.ttft_ms(50),
    }
    assert figures == expected
    # Every request sent is in exactly one of completed, cut, rejected or another error.
    others = sum(counted.other_errors.values())
    assert counted.completed + len(counted.cut) + len(counted.rejected) + others == counted.sent


@pytest.mark.parametrize(
    ("results", "wall_s", "expected"),
    [
        # make reliability's levels: goodput over the whole run, every request sent counted.
        (
            [GOOD] * 6 + [LATE, CUT, FULL, _result("http_503", total_ms=1080.0, sent_s=0.5)],
            4.0,
            {
                "requests": 10,
                "completed": 7,
                "within_budget": 6,
                "cut": 1,
                "shed": 2,
                "worst_shed_ms": 1080.0,
                "other_errors": {},
                "goodput": 0.75,
                "within_budget_share": 0.6,
            },
        ),
        # A client that gave up is neither cut nor shed: it is an error the level reports.
        (
            [GOOD, GAVE_UP],
            2.0,
            {
                "requests": 2,
                "completed": 1,
                "within_budget": 1,
                "cut": 0,
                "shed": 0,
                "worst_shed_ms": None,
                "other_errors": {"timeout": 1},
                "goodput": 0.25,
                "within_budget_share": 0.5,
            },
        ),
        (
            [],
            0.0,
            {
                "requests": 0,
                "completed": 0,
                "within_budget": 0,
                "cut": 0,
                "shed": 0,
                "worst_shed_ms": None,
                "other_errors": {},
                "goodput": 0.0,
                "within_budget_share": 0.0,
            },
        ),
    ],
)
def test_overload_levels_read_their_figures_from_the_same_accounting(
    results: list[StreamResult], wall_s: float, expected: dict[str, object]
) -> None:
    level = count("one tier 2.0x", 2.0, 2.0, 3.0, LoadReport(results, wall_s))
    assert {key: getattr(level, key) for key in expected} == expected
    assert (level.rate_per_s, level.capacity_per_s) == (4.0, 2.0)
