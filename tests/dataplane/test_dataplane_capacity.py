"""A replica never gets more than its recipe's max_concurrency: the rest wait in HAProxy's queue
for at most the first-token budget, spill to the next tier when the home tier is full, and are
answered a JSON 503 with Retry-After, before any byte, past that budget.

The replicas here have no capacity limit of their own: only HAProxy's maxconn bounds them, and
slow streams (a pause between tokens) keep their slots taken.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from denv_iac.balancer.model import queue_timeout_ms
from denv_iac.balancer.runtime import server_stats, stats_command
from denv_iac.local.replica_sim import ReplicaSimConfig

from .dataplane_harness import Dataplane, PoolLayout, StreamOutcome, stream_chat

# A token every 100 ms: a stream of n tokens holds its slot for about n / 10 seconds, and no
# pause comes near the stall budget.
SLOW = ReplicaSimConfig("template", ttft_ms=20, itl_ms=100, tokens=8)
HOME = ("voice.home-a.n0.0", "voice.home-b.n1.0")
BODY = {"model": "voice"}

Start = Callable[..., Dataplane]


def _home_tier(first_token_timeout_ms: int) -> PoolLayout:
    return PoolLayout(
        "voice",
        ((10, ("home-a", "home-b")),),
        session_affinity=True,
        max_concurrency=1,
        first_token_timeout_ms=first_token_timeout_ms,
    )


def _stat_rows(plane: Dataplane) -> list[dict[str, str]]:
    assert plane.haproxy is not None
    text = stats_command(plane.haproxy.stats_socket, "show stat")
    return list(csv.DictReader(io.StringIO(text.removeprefix("# "))))


def _server_row(plane: Dataplane, replica_id: str) -> dict[str, str]:
    assert plane.haproxy is not None
    return server_stats(plane.haproxy.stats_socket)[replica_id]


def _busy(plane: Dataplane, replica_id: str) -> int:
    """Requests HAProxy has on a replica right now."""
    return int(_server_row(plane, replica_id)["scur"])


def _queued(plane: Dataplane, backend: str) -> int:
    """Requests waiting for a slot in a tier backend: its own queue and its servers' queues."""
    return sum(int(row["qcur"] or 0) for row in _stat_rows(plane) if row["pxname"] == backend)


def _most_at_once(plane: Dataplane, replica_id: str) -> int:
    return int(_server_row(plane, replica_id)["smax"])


@contextmanager
def _streams(plane: Dataplane) -> Iterator[Callable[[int], Future[StreamOutcome]]]:
    """Start streamed turns in the background, each on its own connection."""
    with ThreadPoolExecutor(max_workers=4) as pool, plane.client(timeout_s=10) as client:

        def start(tokens: int) -> Future[StreamOutcome]:
            return pool.submit(stream_chat, client, {**BODY, "max_tokens": tokens})

        yield start


def _served_whole(outcome: StreamOutcome) -> bool:
    return outcome.status == 200 and outcome.done and outcome.error is None


def test_a_request_past_every_slot_waits_in_the_queue_and_is_served_whole(
    start_dataplane: Start,
) -> None:
    plane = start_dataplane(pools=(_home_tier(3000),), replica_ids=HOME, sim=SLOW)
    with _streams(plane) as start:
        running = [start(6), start(6)]
        plane.wait_until(
            lambda: all(_busy(plane, r) == 1 for r in HOME), 5, "both replicas take one stream"
        )
        waiting = start(2)
        plane.wait_until(lambda: _queued(plane, "voice.tier10") == 1, 5, "the third one queued")
        outcomes = [future.result() for future in (*running, waiting)]

    assert all(_served_whole(outcome) for outcome in outcomes), outcomes
    assert outcomes[2].replica in HOME
    # It got its first token only once a slot was free: not sent on to a busy replica.
    assert outcomes[2].first_token_s is not None and outcomes[2].first_token_s > 0.3
    assert [_most_at_once(plane, r) for r in HOME] == [1, 1]


def test_past_the_first_token_budget_a_queued_request_gets_a_json_503_with_retry_after(
    start_dataplane: Start,
) -> None:
    budget_s = 0.3
    plane = start_dataplane(pools=(_home_tier(int(budget_s * 1000)),), replica_ids=HOME, sim=SLOW)
    with _streams(plane) as start, plane.client() as client:
        running = [start(12), start(12)]  # about 1.2 s each
        plane.wait_until(
            lambda: all(_busy(plane, r) == 1 for r in HOME), 5, "both replicas take one stream"
        )
        asked = time.monotonic()
        refused = client.post(
            "/v1/chat/completions", json={**BODY, "stream": True, "max_tokens": 2}
        )
        waited_s = time.monotonic() - asked
        outcomes = [future.result() for future in running]

    # Answered whole, before any byte of a stream: a status, JSON, and when to retry.
    assert refused.status_code == 503
    assert refused.headers["content-type"] == "application/json"
    assert refused.headers["retry-after"] == "1"
    assert "x-denv-replica" not in refused.headers
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "pool_full")
    # It waited the queue's share of the budget for a slot (the rest is a replica's prefill),
    # and no longer: the streams holding them ran on.
    queue_s = queue_timeout_ms(int(budget_s * 1000)) / 1000
    assert queue_s < budget_s
    assert queue_s - 0.05 <= waited_s < queue_s + 0.5
    assert not any(outcome.done for outcome in outcomes if outcome.elapsed_s < waited_s)
    # The streams that held the slots were never cut because of the load.
    assert all(_served_whole(outcome) for outcome in outcomes), outcomes
    assert [_most_at_once(plane, r) for r in HOME] == [1, 1]


def test_a_full_home_tier_spills_to_the_next_tier_and_takes_requests_back_once_free(
    start_dataplane: Start,
) -> None:
    layout = PoolLayout(
        "voice",
        ((10, ("home",)), (20, ("fallback",))),
        max_concurrency=1,
        first_token_timeout_ms=3000,
    )
    home, fallback = "voice.home.n0.0", "voice.fallback.n1.0"
    plane = start_dataplane(pools=(layout,), replica_ids=(home, fallback), sim=SLOW)
    with _streams(plane) as start:
        assert start(1).result().replica == home  # the home tier, while it has room
        holding = start(8)
        plane.wait_until(lambda: _busy(plane, home) == 1, 5, "the home replica is full")
        spilled = start(1).result()
        held = holding.result()
        back = start(1).result()

    assert _served_whole(spilled) and spilled.replica == fallback
    assert _served_whole(held) and held.replica == home
    assert _served_whole(back) and back.replica == home
    assert _queued(plane, "voice.tier10") == 0
    assert _most_at_once(plane, home) == 1


def test_the_wait_for_a_slot_does_not_count_against_the_replica_silence_budget(
    start_dataplane: Start,
) -> None:
    # 900 ms to the first token: a request that waited for a slot (at most 1.5 s of the 2 s
    # first-token budget) has its first byte past `timeout server` (2 s).
    prefill = ReplicaSimConfig("template", ttft_ms=900, itl_ms=100, tokens=8)
    layout = _home_tier(2000)
    plane = start_dataplane(pools=(layout,), replica_ids=HOME, sim=prefill)
    with _streams(plane) as start:
        running = [start(5), start(5)]  # about 1.4 s each
        plane.wait_until(
            lambda: all(_busy(plane, r) == 1 for r in HOME), 5, "both replicas take one stream"
        )
        waited = start(2).result()
        outcomes = [future.result() for future in running]

    assert all(_served_whole(outcome) for outcome in (*outcomes, waited)), (outcomes, waited)
    assert waited.first_token_s is not None
    timeout_server_ms = max(layout.first_token_timeout_ms, layout.stall_timeout_ms)
    assert waited.first_token_s > timeout_server_ms / 1000
