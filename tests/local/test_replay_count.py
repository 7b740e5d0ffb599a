"""Counting replayed streams from the replicas' own request logs."""

import pytest

from denv_iac.ops.demo import count_replayed, count_retried
from denv_iac.ops.loadgen_report import StreamResult


def result(request_id: str, error: str, replica: str) -> StreamResult:
    return StreamResult(request_id, 0.0, 200, error, replica, 10.0, 20.0, 3)


@pytest.mark.parametrize(
    ("results", "seen", "replayed", "retried"),
    [
        ([result("a", "", "r1")], {"a": ["r1"]}, 0, 0),
        # Completed, received twice: resent before its first byte, one generation heard.
        ([result("a", "", "r1")], {"a": ["r2", "r1"]}, 0, 1),
        ([result("a", "", "r1")], {"a": ["r1", "r1"]}, 0, 1),
        ([result("a", "http_504", "")], {"a": ["r1", "r2"]}, 0, 1),
        ([result("a", "aborted", "r1")], {}, 0, 0),  # died with its replica, log gone
        ([result("a", "aborted", "r1")], {"a": ["r1"]}, 0, 0),  # cut at the balancer, served once
        ([result("a", "aborted", "r1")], {"a": ["r2"]}, 1, 0),  # resent to another replica
        ([result("a", "aborted", "r1")], {"a": ["r1", "r2"]}, 1, 0),
        ([result("a", "aborted", "r1")], {"a": ["r1", "r1"]}, 1, 0),  # resent to its own
    ],
)
def test_count_replayed_and_retried(
    results: list[StreamResult], seen: dict[str, list[str]], replayed: int, retried: int
) -> None:
    assert count_replayed(results, seen) == replayed
    assert count_retried(results, seen) == retried
