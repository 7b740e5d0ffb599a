"""Requests through a real HAProxy running the generated config: streaming, routing, auth."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable

from benchmarks.lab.dataplane import Dataplane, stream_chat

VOICE_HOME = {"voice.home-a.n0.0", "voice.home-b.n1.0"}


def test_stream_arrives_whole_and_names_its_replica(dataplane: Dataplane) -> None:
    with dataplane.client() as client:
        outcome = stream_chat(client, {"model": "voice", "max_tokens": 6})

    assert outcome.status == 200
    assert outcome.done and outcome.error is None
    assert outcome.replica in VOICE_HOME
    assert [chunk["replica"] for chunk in outcome.chunks] == [outcome.replica] * 7
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in outcome.chunks)
    assert text == "tok0 tok1 tok2 tok3 tok4 tok5 "
    assert outcome.chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_non_streamed_completion_and_replica_headers(dataplane: Dataplane) -> None:
    with dataplane.client() as client:
        response = client.post(
            "/v1/chat/completions",
            json={"model": "llm", "max_tokens": 3},
            headers={"X-Denv-Replica": "forged"},
        )

    assert response.status_code == 200
    assert response.headers["x-denv-replica"] == "llm.elsewhere.n3.0"
    assert response.headers["x-denv-replica-self"] == "llm.elsewhere.n3.0"
    assert response.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "


def test_pool_is_chosen_by_model_field_or_header(dataplane: Dataplane) -> None:
    with dataplane.client() as client:
        by_model = client.post("/v1/chat/completions", json={"model": "llm"})
        by_header = client.post(
            "/v1/chat/completions", json={"model": "llm"}, headers={"X-Denv-Pool": "voice"}
        )
        header_only = client.post("/v1/chat/completions", json={}, headers={"X-Denv-Pool": "llm"})

    assert by_model.headers["x-denv-replica"] == "llm.elsewhere.n3.0"
    assert by_header.headers["x-denv-replica"] in VOICE_HOME
    assert header_only.headers["x-denv-replica"] == "llm.elsewhere.n3.0"


def test_unknown_pool_is_404_json(dataplane: Dataplane) -> None:
    with dataplane.client() as client:
        unknown_model = client.post("/v1/chat/completions", json={"model": "gpt-9"})
        unknown_header = client.post(
            "/v1/chat/completions", json={"model": "voice"}, headers={"X-Denv-Pool": "nope"}
        )
        no_model = client.post("/v1/chat/completions", json={"messages": []})

    for response in (unknown_model, unknown_header, no_model):
        assert response.status_code == 404
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == "model_not_found"
    assert sum(replica.stats()["requests"] for replica in dataplane.replicas.values()) == 0


def test_api_key_is_checked_against_digests(start_dataplane: Callable[..., Dataplane]) -> None:
    key = "sk-denv-test-key"
    plane = start_dataplane(api_key_digests=(hashlib.sha256(key.encode()).hexdigest(),))
    with plane.client() as client:
        missing = client.post("/v1/chat/completions", json={"model": "llm"})
        wrong = client.post(
            "/v1/chat/completions",
            json={"model": "llm"},
            headers={"Authorization": "Bearer sk-denv-other"},
        )
        good = client.post(
            "/v1/chat/completions",
            json={"model": "llm"},
            headers={"Authorization": f"Bearer {key}"},
        )

    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert good.status_code == 200
    assert good.headers["x-denv-replica"] == "llm.elsewhere.n3.0"


def test_session_sticks_to_one_replica(dataplane: Dataplane) -> None:
    with dataplane.client() as client:
        sticky = Counter(
            client.post(
                "/v1/chat/completions",
                json={"model": "voice", "max_tokens": 1},
                headers={"X-Denv-Session": "conversation-42"},
            ).headers["x-denv-replica"]
            for _ in range(12)
        )
        spread = {
            client.post(
                "/v1/chat/completions",
                json={"model": "voice", "max_tokens": 1},
                headers={"X-Denv-Session": f"conversation-{n}"},
            ).headers["x-denv-replica"]
            for n in range(24)
        }

        # Without the header, hashing has no key: HAProxy goes round robin.
        headerless = [
            client.post("/v1/chat/completions", json={"model": "voice", "max_tokens": 1}).headers[
                "x-denv-replica"
            ]
            for _ in range(6)
        ]

    assert len(sticky) == 1 and sum(sticky.values()) == 12
    assert spread == VOICE_HOME  # sessions hash over both home replicas, never the fallback
    assert Counter(headerless) == {replica_id: 3 for replica_id in VOICE_HOME}
