"""A tier on a far site, through a link on which every packet takes 75 ms each way (the
handshake's too): its connect timeout follows the round trip the stack states, so a request
that fails over to it is served, where the one value for every tier (80 ms) cut every connect.
"""

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from denv_iac.core.stack.reader import read_stack
from denv_iac.haproxy.runtime import server_stats
from denv_iac.local.netns import NetnsCluster, running_in_netns
from denv_iac.ops.status import replica_statuses, site_distances

ROUND_TRIP_MS = 150
NEAR, FAR = "voice.near.n0.0", "voice.far.n0.0"
REQUESTS = 6


def _stack(far_round_trip_ms: float | None) -> dict[str, Any]:
    far: dict[str, Any] = {"name": "far", "kind": "local", "nodes": [_node()]}
    if far_round_trip_ms is not None:
        far["round_trip_ms"] = far_round_trip_ms
    return {
        "denv:sites": [{"name": "near", "kind": "local", "nodes": [_node()]}, far],
        "denv:recipes": [
            {
                "name": "voice",
                "min_warm": 2,
                "spare": 0,
                "sites": [["near"], ["far"]],
                "simulate": {"ttft_ms": 20, "itl_ms": 5, "tokens": 4},
            }
        ],
        "denv:balancer": {"sites": ["near"]},
    }


def _node() -> dict[str, Any]:
    return {"name": "n0", "gpu": "H100", "gpus": 1}


def _status(cluster: NetnsCluster) -> dict[str, str]:
    assert cluster.state is not None
    rows = server_stats(Path(cluster.state.admin_socket))
    return {replica: row["status"] for replica, row in rows.items() if "." in replica}


def _wait(cluster: NetnsCluster, wanted: dict[str, str], limit_s: float) -> dict[str, str]:
    deadline = time.monotonic() + limit_s
    while (seen := _status(cluster)) != wanted and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def _ask(endpoint: str) -> list[tuple[int, str]]:
    """Streamed turns, each on a fresh connection: the status and the replica that served."""
    answers = []
    for _ in range(REQUESTS):
        with httpx.Client(timeout=5) as client:
            body = {"model": "voice", "stream": True, "max_tokens": 4, "messages": []}
            with client.stream("POST", f"{endpoint}/v1/chat/completions", json=body) as reply:
                reply.read()
                answers.append((reply.status_code, reply.headers.get("x-denv-replica", "")))
    return answers


def _distances(cluster: NetnsCluster) -> dict[str, tuple[float | None, float | None]]:
    """What `denv status` shows of each site: measured and stated round trip."""
    assert cluster.state is not None
    rows = server_stats(Path(cluster.state.admin_socket))
    found = site_distances(cluster.stack, replica_statuses(rows))
    return {d.site: (d.measured_round_trip_ms, d.stated_round_trip_ms) for d in found}


@dataclass(frozen=True)
class FailOver:
    before: dict[str, str]  # the servers' states once the stack was up
    distances: dict[str, tuple[float | None, float | None]]  # then, by site
    answers: list[tuple[int, str]]  # each request's once the near replica was dead
    after: dict[str, str]


def _fail_over(far_round_trip_ms: float | None, tmp_path: Path) -> FailOver:
    """The near replica killed once both are up (or the far one never comes up): what each
    request then got, and the servers' states before and after (and the sites' distances,
    as `denv status` shows them, while both were up)."""
    stack = read_stack("far-tier", _stack(far_round_trip_ms))
    trips = {"far": float(ROUND_TRIP_MS)}
    with running_in_netns(stack, tmp_path, round_trips=trips) as cluster:
        assert cluster.state is not None
        up = _wait(cluster, {NEAR: "UP", FAR: "UP"}, 10)
        distances = _distances(cluster)
        near = next(r for r in cluster.state.replicas if r.id == NEAR)
        os.kill(near.pid, signal.SIGKILL)  # nothing supervises it here: it stays dead
        _wait(cluster, {NEAR: "DOWN", FAR: up[FAR]}, 10)
        answers = cluster.lab.call(_ask, cluster.state.endpoint)
        seen = _status(cluster)
    return FailOver(up, distances, answers, seen)


@pytest.mark.needs_netns
def test_a_far_tier_with_its_round_trip_stated_serves_the_failover(tmp_path: Path) -> None:
    seen = _fail_over(ROUND_TRIP_MS, tmp_path)
    assert seen.answers == [(200, FAR)] * REQUESTS, seen
    # `denv status` measured both sites by their health checks, beside what the stack states.
    (near_ms, near_stated), (far_ms, far_stated) = seen.distances["near"], seen.distances["far"]
    assert (near_stated, far_stated) == (0.0, ROUND_TRIP_MS)
    assert near_ms is not None and near_ms <= 5
    assert far_ms is not None and ROUND_TRIP_MS <= far_ms <= ROUND_TRIP_MS + 100


@pytest.mark.needs_netns
def test_without_its_round_trip_the_stacks_connect_timeout_cuts_every_connect_to_it(
    tmp_path: Path,
) -> None:
    # The same link with the tier's distance unknown: 80 ms for a 150 ms handshake. Its
    # health checks never pass, and no request reaches it.
    seen = _fail_over(None, tmp_path)
    assert [status for status, _ in seen.answers] == [503] * REQUESTS, seen
    assert seen.before[FAR] != "UP" and seen.after[FAR] != "UP", seen
