"""The endpoint's API surface through a real HAProxy: what it forwards, what it answers itself."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest

from benchmarks.lab.dataplane import STANDARD_POOLS, STANDARD_REPLICAS, Dataplane
from denv_iac.core.balancer.api_surface import MODELS_LIST_LIMIT, REQUEST_ID_MAX
from tests.balancer.sample_pools import aliases_filling

VOICE = ("voice.home-a.n0.0", "voice.home-b.n1.0", "voice.fallback.n2.0")


def _replica_requests(plane: Dataplane) -> int:
    return sum(r.stats()["requests"] for r in plane.replicas.values())


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/control/fault"),  # the simulator's own fault switch
        ("GET", "/stats"),
        ("GET", "/metrics"),
        ("POST", "/v1/chat/completions/../../control/fault"),
        ("GET", "/v1/chat/completions"),
        ("DELETE", "/v1/models"),
        ("POST", "/v2/chat/completions"),
    ],
)
def test_anything_off_the_api_is_answered_by_the_balancer(
    dataplane: Dataplane, method: str, path: str
) -> None:
    with dataplane.client() as client:
        response = client.request(method, path, json={"mode": "exit", "model": "voice"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert "x-denv-replica" not in response.headers
    assert _replica_requests(dataplane) == 0
    # Nothing was forwarded: every replica still runs.
    assert all(r.process.running for r in dataplane.replicas.values())


def test_models_lists_the_pools(dataplane: Dataplane) -> None:
    with dataplane.client() as client:
        response = client.get("/v1/models")
    assert response.status_code == 200
    assert response.json() == {
        "object": "list",
        "data": [
            {"id": "llm", "object": "model", "owned_by": "denv"},
            {"id": "voice", "object": "model", "owned_by": "denv"},
        ],
    }
    assert _replica_requests(dataplane) == 0


def test_the_longest_model_list_a_stack_may_have_comes_whole(
    start_dataplane: Callable[..., Dataplane],
) -> None:
    # Longer lists are refused by `denv plan`; HAProxy answered them with a 200 and no body.
    voice, llm = STANDARD_POOLS
    aliases = aliases_filling((voice.name, llm.name), MODELS_LIST_LIMIT)
    plane = start_dataplane(
        pools=(dataclasses.replace(voice, models=aliases), llm),
        replica_ids=(STANDARD_REPLICAS[0], STANDARD_REPLICAS[-1]),
    )
    with plane.client() as client:
        # A client's own request id is echoed on the answer too: room is left for it.
        response = client.get("/v1/models", headers={"X-Request-Id": "r" * 1024})
    assert response.status_code == 200
    assert len(response.content) == MODELS_LIST_LIMIT
    ids = [model["id"] for model in response.json()["data"]]
    assert ids == sorted([voice.name, llm.name, *aliases])
    assert _replica_requests(plane) == 0


def test_health_says_whether_every_pool_can_serve(dataplane: Dataplane) -> None:
    with dataplane.client() as client:
        assert client.get("/health").json() == {"status": "ok"}
        for replica_id in VOICE:
            dataplane.agent.set_reply(replica_id, "down #xid 79")
        dataplane.wait_until(
            lambda: all(dataplane.status()[r].startswith("DOWN") for r in VOICE), 3, "voice down"
        )
        down = client.get("/health")
        assert down.status_code == 503 and down.json()["status"] == "unavailable"
        for replica_id in VOICE:
            dataplane.agent.set_reply(replica_id, "up ready 100%")
        dataplane.wait_until(lambda: client.get("/health").status_code == 200, 3, "health back")


def test_every_answer_carries_a_request_id_the_replica_saw_too(dataplane: Dataplane) -> None:
    with dataplane.client() as client:
        kept = client.post(
            "/v1/chat/completions",
            json={"model": "voice", "max_tokens": 1},
            headers={"X-Request-Id": "turn-42"},
        )
        made = client.post("/v1/chat/completions", json={"model": "voice", "max_tokens": 1})
        refused = client.post("/v1/chat/completions", json={"model": "nope"})
        off_api = client.get("/nowhere")
    assert kept.headers["x-request-id"] == "turn-42"
    assert dataplane.total_requests("turn-42") == 1
    generated = made.headers["x-request-id"]
    assert re.fullmatch(_UUID, generated)
    assert dataplane.total_requests(generated) == 1
    for answer in (refused, off_api):
        assert answer.status_code == 404 and answer.headers["x-request-id"]
    assert dataplane.haproxy is not None
    log = dataplane.haproxy.log_path.read_text()
    assert "{turn-42}" in log and f"{{{generated}}}" in log


_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}"


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ([b"a" * REQUEST_ID_MAX], True),
        ([b"0f1e:span/9+x=_.-Z"], True),
        ([b"a" * (REQUEST_ID_MAX + 1)], False),
        ([b"r" * 8000], False),
        ([b"two words"], False),
        ([b'quo"te'], False),
        ([b"per%cent"], False),
        ([b"a,b"], False),  # a comma: a list of two ids to some readers
        (["caf\u00e9".encode()], False),
        ([b""], False),
        ([b"first", b"second"], False),  # sent twice: the log and a replica could read either
    ],
)
def test_a_clients_request_id_is_kept_only_when_short_and_plain(
    dataplane: Dataplane, sent: list[bytes], kept: bool
) -> None:
    headers = [(b"X-Request-Id", value) for value in sent]
    with dataplane.client() as client:
        answer = client.post(
            "/v1/chat/completions", json={"model": "voice", "max_tokens": 1}, headers=headers
        )
    assert answer.status_code == 200
    used = answer.headers["x-request-id"]
    if kept:
        assert used == sent[0].decode()
    else:
        assert re.fullmatch(_UUID, used)
        assert all(dataplane.total_requests(value.decode()) == 0 for value in sent if value)
    # The replica saw the id the answer carries, once, and the log has it whole.
    assert dataplane.total_requests(used) == 1
    assert dataplane.haproxy is not None
    assert f"{{{used}}}" in dataplane.haproxy.log_path.read_text()


def test_realtime_sessions_are_routed_by_the_model_in_the_query(dataplane: Dataplane) -> None:
    with dataplane.client() as client:
        response = client.get("/v1/realtime", params={"model": "voice"})
        unknown = client.get("/v1/realtime", params={"model": "nope"})
    # Forwarded to a voice replica (a plain GET is no WebSocket upgrade: the replica says so).
    assert response.headers["x-denv-replica"].startswith("voice.")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
