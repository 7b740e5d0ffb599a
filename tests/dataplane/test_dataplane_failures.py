"""Replica failures through a real HAProxy: what clients see, and how fast it acts."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from benchmarks.lab.dataplane import AGENT_UP, Dataplane, StreamOutcome, stream_chat
from denv_iac.haproxy.runtime import server_stats
from denv_iac.local.replica_model import ReplicaSimConfig

VOICE_HOME = ("voice.home-a.n0.0", "voice.home-b.n1.0")
VOICE_FALLBACK = "voice.fallback.n2.0"
SESSION = {"X-Denv-Session": "conversation-7"}


def _replica_of_session(plane: Dataplane) -> str:
    with plane.client() as client:
        outcome = stream_chat(client, {"model": "voice", "max_tokens": 1}, SESSION)
    assert outcome.replica is not None
    return outcome.replica


def test_home_tier_down_falls_back_to_listed_site_only(dataplane: Dataplane) -> None:
    for replica_id in VOICE_HOME:
        dataplane.replicas[replica_id].kill()
    dataplane.wait_until(
        lambda: all(dataplane.status()[r].startswith("DOWN") for r in VOICE_HOME),
        timeout_s=5,
        what="health checks take the dead home replicas out",
    )
    with dataplane.client() as client:
        served = {stream_chat(client, {"model": "voice"}).replica for _ in range(4)}
    assert served == {VOICE_FALLBACK}

    dataplane.agent.set_reply(VOICE_FALLBACK, "down #xid 79")
    dataplane.wait_until(
        lambda: dataplane.status()[VOICE_FALLBACK].startswith("DOWN"), 2, "fallback out"
    )
    with dataplane.client() as client:
        refused = client.post("/v1/chat/completions", json={"model": "voice"})
    # llm's site is up, but voice may not use it.
    assert refused.status_code == 503
    assert dataplane.status()["llm.elsewhere.n3.0"] == "UP"
    assert dataplane.replicas["llm.elsewhere.n3.0"].stats()["requests"] == 0


def test_whole_tier_dying_at_once_costs_at_most_one_retryable_json_503(
    dataplane: Dataplane,
) -> None:
    for replica_id in VOICE_HOME:
        dataplane.replicas[replica_id].kill()
    with dataplane.client() as client:
        first = client.post("/v1/chat/completions", json={"model": "voice", "max_tokens": 1})
        then = [
            client.post("/v1/chat/completions", json={"model": "voice", "max_tokens": 1})
            for _ in range(3)
        ]

    # Retries stay in the tier HAProxy picked, and both its replicas refused.
    if first.status_code != 200:
        assert first.status_code == 503
        assert first.json()["error"]["code"] == "no_healthy_replica"
    assert [r.headers["x-denv-replica"] for r in then] == [VOICE_FALLBACK] * 3


def test_every_server_down_is_503_json(dataplane: Dataplane) -> None:
    for replica_id in (*VOICE_HOME, VOICE_FALLBACK):
        dataplane.agent.set_reply(replica_id, "down #xid 79")
    dataplane.wait_until(
        lambda: all(
            state.startswith("DOWN")
            for name, state in dataplane.status().items()
            if "voice" in name
        ),
        timeout_s=2,
        what="agent takes every voice replica out",
    )
    with dataplane.client() as client:
        response = client.post("/v1/chat/completions", json={"model": "voice"})
        other_pool = client.post("/v1/chat/completions", json={"model": "llm"})

    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "no_healthy_replica"
    assert error["message"].endswith("pool voice")
    assert other_pool.status_code == 200


@pytest.mark.timing
def test_stream_whose_replica_dies_is_aborted_and_never_replayed(dataplane: Dataplane) -> None:
    victim = _replica_of_session(dataplane)
    dataplane.replicas[victim].fault("die_after_tokens", k=3)

    with dataplane.client() as client:
        outcome = stream_chat(
            client, {"model": "voice", "max_tokens": 8}, {**SESSION, "X-Request-Id": "turn-1"}
        )

    assert outcome.status == 200 and outcome.replica == victim
    assert len(outcome.chunks) == 3
    assert not outcome.done and outcome.error is not None
    assert outcome.elapsed_s < 1.0
    assert dataplane.total_requests("turn-1") == 1
    assert dataplane.replicas[victim].stats()["streams_aborted"] == 1


@pytest.mark.timing
@pytest.mark.parametrize("death", ["refuse", "exit"])
def test_next_request_after_replica_death_succeeds_elsewhere(
    dataplane: Dataplane, death: str
) -> None:
    victim = _replica_of_session(dataplane)
    dataplane.replicas[victim].fault(death)

    with dataplane.client() as client:
        outcomes = [
            stream_chat(client, {"model": "voice"}, {**SESSION, "X-Request-Id": f"after-{n}"})
            for n in range(6)
        ]

    assert [(o.status, o.done, o.error) for o in outcomes] == [(200, True, None)] * 6
    assert {o.replica for o in outcomes} == {next(r for r in VOICE_HOME if r != victim)}
    # The retry waits min(timeout connect, 1 s) before it goes elsewhere, no longer.
    first_token_s = outcomes[0].first_token_s
    assert first_token_s is not None and first_token_s < 0.5
    assert dataplane.status()[victim].startswith("DOWN")


@pytest.mark.timing
def test_agent_down_takes_server_out_fast_and_up_brings_it_back(dataplane: Dataplane) -> None:
    victim = _replica_of_session(dataplane)
    dataplane.agent.set_reply(victim, "down #xid 79 gpu fell off the bus")

    took_s = dataplane.wait_until(
        lambda: dataplane.status()[victim].startswith("DOWN"), 2, "agent down"
    )
    assert took_s < 0.6
    assert dataplane.haproxy is not None
    row = server_stats(dataplane.haproxy.stats_socket)[victim]
    assert "xid 79 gpu fell off the bus" in row["last_agt"]
    with dataplane.client() as client:
        moved = {stream_chat(client, {"model": "voice"}, SESSION).replica for _ in range(4)}
    assert moved and victim not in moved

    dataplane.agent.set_reply(victim, AGENT_UP)
    dataplane.wait_until(lambda: dataplane.status()[victim] == "UP", 3, "agent up again")
    assert _replica_of_session(dataplane) == victim


def test_agent_drain_lets_streams_finish_and_sends_new_requests_elsewhere(
    start_dataplane: Callable[..., Dataplane],
) -> None:
    plane = start_dataplane(sim=ReplicaSimConfig("template", ttft_ms=20, itl_ms=10, tokens=40))
    victim = _replica_of_session(plane)
    in_flight: list[StreamOutcome] = []
    with plane.client() as client:
        streaming = threading.Thread(
            target=lambda: in_flight.append(stream_chat(client, {"model": "voice"}, SESSION))
        )
        streaming.start()
        assert plane.haproxy is not None
        socket_path = plane.haproxy.stats_socket
        # Drain only once the stream is on the victim, or it could start elsewhere.
        plane.wait_until(
            lambda: int(server_stats(socket_path)[victim]["scur"]) >= 1, 2, "stream started"
        )
        plane.agent.set_reply(victim, "drain")
        plane.wait_until(lambda: plane.status()[victim].startswith("DRAIN"), 2, "drain")
        with plane.client() as other:
            moved = stream_chat(other, {"model": "voice", "max_tokens": 1}, SESSION)
            for replica_id in VOICE_HOME:
                plane.agent.set_reply(replica_id, "drain")
            plane.wait_until(
                lambda: all(plane.status()[r].startswith("DRAIN") for r in VOICE_HOME), 2, "drain"
            )
            # A fully drained tier counts as empty: the next tier takes the pool.
            fallback = stream_chat(other, {"model": "voice", "max_tokens": 1}, SESSION)
        streaming.join(timeout=10)

    (outcome,) = in_flight
    assert outcome.replica == victim and outcome.done
    assert moved.done and moved.replica != victim
    assert fallback.done and fallback.replica == VOICE_FALLBACK

    # Leaving drain takes `ready`; the percentage scales the configured weight of 100.
    plane.agent.set_reply(victim, "up ready 40%")
    plane.wait_until(lambda: plane.status()[victim] == "UP", 2, "ready again")
    assert plane.haproxy is not None
    assert server_stats(plane.haproxy.stats_socket)[victim]["weight"] == "40"
