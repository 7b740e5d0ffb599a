"""Counting replayed streams from the replicas' own request logs."""

import pytest

from denv_iac.loadgen import StreamResult
from denv_iac.local.demo import count_replayed


def result(request_id: str, error: str, replica: str) -> StreamResult:
    return StreamResult(request_id, 0.0, 200, error, replica, 10.0, 20.0, 3)


@pytest.mark.parametrize(
    ("results", "seen", "replayed"),
    [
        ([result("a", "", "r1")], {"a": ["r1"]}, 0),
        ([result("a", "", "r1")], {"a": ["r1", "r2"]}, 1),  # received twice
        ([result("a", "aborted", "r1")], {}, 0),  # died with its replica, log gone
        ([result("a", "aborted", "r1")], {"a": ["r1"]}, 0),  # cut at the balancer, served once
        ([result("a", "aborted", "r1")], {"a": ["r2"]}, 1),  # resent to another replica
    ],
)
def test_count_replayed(
    results: list[StreamResult], seen: dict[str, list[str]], replayed: int
) -> None:
    assert count_replayed(results, seen) == replayed
