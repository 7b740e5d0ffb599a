"""A replica never gets more than its recipe's max_concurrency: the rest spill to the next tier
when the home tier is full, wait in HAProxy's queue for at most the queue budget when the tier
would start them within it, and are otherwise answered a JSON 503 with Retry-After, before any
byte: at once, or past that budget.

The replicas here have no capacity limit of their own: only HAProxy's maxconn bounds them, and
slow streams (a pause between tokens) keep their slots taken.
"""

from __future__ import annotations

import csv
import io
import json
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.lab.dataplane import Dataplane, PoolLayout, StreamOutcome, stream_chat
from denv_iac.cli import main
from denv_iac.core.balancer.saturation import PoolSaturation, pool_saturation
from denv_iac.haproxy.runtime import server_stats, stats_command, stats_rows
from denv_iac.local.processes import free_port
from denv_iac.local.replica_model import ReplicaSimConfig

# A token every 100 ms: a stream of n tokens holds its slot for about n / 10 seconds, and no
# pause comes near the stall budget.
SLOW = ReplicaSimConfig("template", ttft_ms=20, itl_ms=100, tokens=8)
HOME = ("voice.home-a.n0.0", "voice.home-b.n1.0")
BODY = {"model": "voice"}

Start = Callable[..., Dataplane]


def _home_tier(first_token_timeout_ms: int, queue_budget_ms: int | None = None) -> PoolLayout:
    return PoolLayout(
        "voice",
        ((10, ("home-a", "home-b")),),
        session_affinity=True,
        max_concurrency=1,
        first_token_timeout_ms=first_token_timeout_ms,
        queue_budget_ms=queue_budget_ms,
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
    # The tier started two requests in the last second (three, with this one): with one slot
    # freed every 0.3 s or so on average it would start the third within its 2 s budget.
    plane = start_dataplane(pools=(_home_tier(3000, 2000),), replica_ids=HOME, sim=SLOW)
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
    queue_s = 0.6  # long enough for the tier to take it into its queue (see the first test)
    layout = _home_tier(3000, int(queue_s * 1000))
    plane = start_dataplane(pools=(layout,), replica_ids=HOME, sim=SLOW)
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
    # It waited its queue budget for a slot, and no longer: the streams holding them ran on.
    assert queue_s - 0.05 <= waited_s < queue_s + 0.5
    assert not any(outcome.done for outcome in outcomes if outcome.elapsed_s < waited_s)
    # The streams that held the slots were never cut because of the load.
    assert all(_served_whole(outcome) for outcome in outcomes), outcomes
    assert [_most_at_once(plane, r) for r in HOME] == [1, 1]


def test_a_request_the_full_tier_would_not_start_within_its_queue_budget_is_refused_at_once(
    start_dataplane: Start,
) -> None:
    # Two streams of about 1.2 s hold both slots; the tier started three requests in the last
    # second with this one, so it would start one more within about a third of a second:
    # not within a 300 ms budget.
    queue_s = 0.3
    plane = start_dataplane(
        pools=(_home_tier(3000, int(queue_s * 1000)),), replica_ids=HOME, sim=SLOW
    )
    with _streams(plane) as start, plane.client() as client:
        running = [start(12), start(12)]
        plane.wait_until(
            lambda: all(_busy(plane, r) == 1 for r in HOME), 5, "both replicas take one stream"
        )
        asked = time.monotonic()
        refused = client.post(
            "/v1/chat/completions", json={**BODY, "stream": True, "max_tokens": 2}
        )
        waited_s = time.monotonic() - asked
        queued = _saturation(plane).queued
        shed = _saturation(plane).shed
        outcomes = [future.result() for future in running]

    # The same answer as after a wait, but before the queue budget ran: it never queued.
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert "x-denv-replica" not in refused.headers
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "pool_full")
    assert waited_s < queue_s
    assert (queued, shed) == (0, 1)  # counted as shed by the pool's tier backend
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


def test_a_turn_whose_replica_is_full_goes_to_the_next_tier_while_its_tier_has_one_slot_left(
    start_dataplane: Start,
) -> None:
    # HAProxy's bounded-load hash lets one of two replicas take a second request when the tier
    # has one slot left: a turn hashed to the full one waited in its queue and was refused
    # after the queue budget (80 ms here) while the next tier idled.
    layout = PoolLayout(
        "voice",
        ((10, ("home-a", "home-b")), (20, ("fallback",))),
        max_concurrency=1,
        first_token_timeout_ms=3000,
    )
    fallback = "voice.fallback.n2.0"
    plane = start_dataplane(pools=(layout,), replica_ids=(*HOME, fallback), sim=SLOW)
    with plane.client(timeout_s=10) as client:
        conversation: dict[str, str] = {}  # replica -> a conversation hashed to it
        for n in range(64):
            turn = stream_chat(client, {**BODY, "max_tokens": 1}, {"X-Denv-Session": f"c{n}"})
            assert _served_whole(turn), turn
            conversation.setdefault(str(turn.replica), f"c{n}")
            if set(HOME) <= conversation.keys():
                break
        assert set(HOME) <= conversation.keys(), conversation

    with ThreadPoolExecutor(max_workers=2) as pool, plane.client(timeout_s=10) as client:
        for replica in HOME:
            session = {"X-Denv-Session": conversation[replica]}
            holding = pool.submit(stream_chat, client, {**BODY, "max_tokens": 8}, session)
            plane.wait_until(lambda r=replica: _busy(plane, r) == 1, 5, f"{replica} is full")
            turn = stream_chat(client, {**BODY, "max_tokens": 2}, session)
            # Without a conversation the request takes the tier's last slot.
            other = stream_chat(client, {**BODY, "max_tokens": 2})
            held = holding.result()
            assert _served_whole(held) and held.replica == replica, held
            # Never left waiting on its full replica: served at once, here by the next tier.
            assert _served_whole(turn) and turn.replica != replica, (replica, turn)
            assert turn.first_token_s is not None and turn.first_token_s < 0.5, turn
            assert _served_whole(other) and other.replica in set(HOME) - {replica}, other
            assert turn.replica == fallback, turn
    assert _queued(plane, "voice.tier10") == 0


def test_the_wait_for_a_slot_does_not_count_against_the_replica_silence_budget(
    start_dataplane: Start,
) -> None:
    # 900 ms to the first token: a request that waited for a slot (at most its 1.5 s queue
    # budget of the 2 s first-token budget) has its first byte past `timeout server` (2 s).
    prefill = ReplicaSimConfig("template", ttft_ms=900, itl_ms=100, tokens=8)
    layout = _home_tier(2000, 1500)
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


def _status_output(plane: Dataplane, *flags: str) -> str:
    """What `denv status` prints of the plane's balancer, read from its admin socket."""
    assert plane.haproxy is not None
    socket_path = str(plane.haproxy.stats_socket)
    printed = CliRunner().invoke(main, ["status", "--admin-socket", socket_path, *flags])
    # 1 says an agent check went unanswered (a loaded test host): not what is read here.
    assert printed.exit_code in (0, 1), printed.output
    return printed.output


def _status(plane: Dataplane) -> dict[str, Any]:
    """`denv status --json` of the plane's balancer."""
    document: dict[str, Any] = json.loads(_status_output(plane, "--json"))
    return document


def _saturation(plane: Dataplane) -> PoolSaturation:
    assert plane.haproxy is not None
    return pool_saturation(stats_rows(plane.haproxy.stats_socket))["voice"]


# What the alert rules record, from the exporter's series: the proxies of the pool's slot-taking
# backends (tier and speech twin), its tier backends and its later tiers.
BOUNDED = re.compile(r"voice\.tier[0-9]+(\.speech)?")
TIERS = re.compile(r"voice\.tier[0-9]+")
LATER = re.compile(r"voice\.tier20(\.speech|\.realtime)?")


def _exported(plane: Dataplane) -> dict[str, int]:
    """The pool's saturation as the alert rules record it, from HAProxy's exporter (counters
    as totals, where the rules take their rate)."""
    text = httpx.get(f"http://127.0.0.1:{plane.settings.prometheus_port}/metrics").text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def total(name: str, proxies: re.Pattern[str], **labels: str) -> int:
        return int(
            sum(
                s.value
                for s in samples
                if s.name == name
                and proxies.fullmatch(s.labels.get("proxy", ""))
                and labels.items() <= s.labels.items()
            )
        )

    up = {
        (s.labels["proxy"], s.labels["server"])
        for s in samples
        if s.name == "haproxy_server_status" and s.labels["state"] == "UP" and s.value == 1
    }
    return {
        "slots_in_use": total("haproxy_server_current_sessions", BOUNDED),
        "slots": int(
            sum(
                s.value
                for s in samples
                if s.name == "haproxy_server_limit_sessions"
                and TIERS.fullmatch(s.labels["proxy"])
                and (s.labels["proxy"], s.labels["server"]) in up
            )
        ),
        "queued": total("haproxy_backend_current_queue", BOUNDED)
        + total("haproxy_server_current_queue", BOUNDED),
        "spilled": total("haproxy_backend_sessions_total", LATER),
        "shed": total("haproxy_backend_http_responses_total", BOUNDED, code="5xx")
        - total("haproxy_server_http_responses_total", BOUNDED, code="5xx"),
    }


def _figures(saturation: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in saturation.items() if k not in ("pool", "saturated")}


def test_status_shows_a_full_pool_its_slots_queue_spill_and_shed(start_dataplane: Start) -> None:
    layout = PoolLayout(
        "voice",
        ((10, ("home",)), (20, ("fallback",))),
        session_affinity=False,
        max_concurrency=1,
        first_token_timeout_ms=1000,
        queue_budget_ms=800,  # the home tier takes the third request into its queue
    )
    home, fallback = "voice.home.n0.0", "voice.fallback.n1.0"
    plane = start_dataplane(
        pools=(layout,), replica_ids=(home, fallback), sim=SLOW, prometheus_port=free_port()
    )
    idle = _status(plane)["pools"][0]["saturation"]
    with _streams(plane) as start, plane.client() as client:
        held = start(30)  # about 3 s each: they hold both slots past the queue budget
        plane.wait_until(lambda: _busy(plane, home) == 1, 5, "the home replica is full")
        spilled = start(30)
        plane.wait_until(lambda: _busy(plane, fallback) == 1, 5, "the next tier takes one")
        refused: Future[httpx.Response] = ThreadPoolExecutor(1).submit(
            client.post, "/v1/chat/completions", json={**BODY, "stream": True, "max_tokens": 2}
        )
        plane.wait_until(lambda: _saturation(plane).queued == 1, 5, "the third one waits")
        full = _status(plane)["pools"][0]["saturation"]
        full_exported = _exported(plane)
        assert refused.result().status_code == 503
        after = _status(plane)["pools"][0]["saturation"]
        after_exported = _exported(plane)
        outcomes = [held.result(), spilled.result()]

    assert idle == {
        "pool": "voice",
        "slots_in_use": 0,
        "slots": 2,
        "queued": 0,
        "spilled": 0,
        "shed": 0,
        "saturated": False,
    }
    # Every slot taken, one request waiting for one, one already sent to the next tier.
    assert full == {**idle, "slots_in_use": 2, "queued": 1, "spilled": 1, "saturated": True}
    # It waited out the queue budget and was shed; the streams holding slots ran on.
    assert after == {**full, "queued": 0, "shed": 1}
    assert refused.result().json()["error"]["code"] == "pool_full"
    # The exporter's series the alert rules read say the same.
    assert [full_exported, after_exported] == [_figures(full), _figures(after)]
    assert all(_served_whole(outcome) for outcome in outcomes), outcomes
    assert [o.replica for o in outcomes] == [home, fallback]
    # Once the streams end, every slot is free again; what was spilled and shed stays counted.
    plane.wait_until(lambda: _saturation(plane).slots_in_use == 0, 5, "the slots are free")
    done = {**after, "slots_in_use": 0, "saturated": False}
    assert _status(plane)["pools"][0]["saturation"] == done
    assert (
        "pool voice: slots 0/2 in use, 0 queued; since the balancer started 1 spilled to a later"
        " tier, 1 shed\n"
    ) in _status_output(plane)
    print(f"idle {idle}\nfull {full}\nafter the budget {after}")
