"""API keys limited to pools, and to a rate, through a real HAProxy on every path of the API."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from benchmarks.lab.dataplane import Dataplane
from denv_iac.core.balancer import KeyScope

from .scoped_keys import FULL_KEY, POOLS, REPLICAS, SIDE_KEY
from .scoped_keys import digest as _digest

RATED_KEY = "sk-denv-two-a-second"  # every pool, at most 2 requests a second
WAV = b"RIFF\x24\x08\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00" + bytes(2000)


@pytest.fixture
def plane(start_dataplane: Callable[..., Dataplane]) -> Iterator[Dataplane]:
    yield start_dataplane(
        pools=POOLS,
        replica_ids=tuple(REPLICAS.values()),
        api_key_digests=tuple(_digest(key) for key in (FULL_KEY, SIDE_KEY, RATED_KEY)),
        key_scopes=(
            KeyScope(_digest(SIDE_KEY), ("side",)),
            KeyScope(_digest(RATED_KEY), None, 2),
        ),
    )


def _requests(plane: Dataplane, pool: str) -> int:
    stats = plane.replicas[REPLICAS[pool]].stats()
    return int(stats["requests"]) + int(stats.get("realtime_sessions", 0))


def _call(client: httpx.Client, path: str, model: str, key: str) -> httpx.Response:
    """One request of `path` for `model`, as the OpenAI SDKs send it."""
    auth = {"Authorization": f"Bearer {key}"}
    if path == "/v1/audio/transcriptions":
        upload = {"model": (None, model), "file": ("a.wav", WAV)}
        return client.post(path, files=upload, headers=auth)
    if path == "pool-header":  # the X-Denv-Pool header names the pool, whatever the body says
        body = {"model": "anything", "messages": []}
        headers = {**auth, "X-Denv-Pool": model}
        return client.post("/v1/chat/completions", json=body, headers=headers)
    body = {"model": model, "input": "hello", "voice": "alloy", "messages": [], "max_tokens": 2}
    return client.post(path, json=body, headers=auth)


PATHS = ("/v1/chat/completions", "/v1/audio/speech", "/v1/audio/transcriptions", "pool-header")


@pytest.mark.parametrize("path", PATHS)
def test_a_key_scoped_to_side_is_served_there_and_refused_voice_before_any_replica(
    plane: Dataplane, path: str
) -> None:
    with plane.client() as client:
        served = _call(client, path, "side", SIDE_KEY)
        refused = [_call(client, path, model, SIDE_KEY) for model in ("voice", "tts-voice")]
        unknown = _call(client, path, "no-such-pool", SIDE_KEY)
        unknown_to_all = _call(client, path, "no-such-pool", FULL_KEY)
        # A key of every pool reaches voice on the same path.
        other = _call(client, path, "voice", FULL_KEY)
    assert served.status_code == 200, served.text
    assert served.headers["x-denv-replica"] == REPLICAS["side"]
    for response in refused:
        assert response.status_code == 404
        assert response.headers["content-type"] == "application/json"
        assert "x-denv-replica" not in response.headers
        # Word for word the answer for a pool that does not exist: nothing to tell them apart.
        assert response.content == unknown.content
        assert response.json()["error"]["code"] == "model_not_found"
    # The 404 names the pools served, to each key those it may use.
    assert unknown.json()["error"]["message"].endswith("to a served pool: side")
    assert unknown_to_all.json()["error"]["message"].endswith("to a served pool: side, voice")
    assert other.status_code == 200, other.text
    assert other.headers["x-denv-replica"] == REPLICAS["voice"]
    assert _requests(plane, "voice") == 1  # the full key's request alone
    assert _requests(plane, "side") == 1


def _realtime(plane: Dataplane, model: str, key: str) -> str:
    """Open a realtime session and read its first event; the replica that took it."""
    url = plane.url.replace("http://", "ws://") + f"/v1/realtime?model={model}"
    headers = {"Authorization": f"Bearer {key}"}
    with connect(url, additional_headers=headers, subprotocols=["realtime"], open_timeout=5) as ws:
        assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
        assert ws.response is not None
        return str(ws.response.headers["X-Denv-Replica"])


def test_a_realtime_session_outside_the_keys_scope_is_refused_before_the_upgrade(
    plane: Dataplane,
) -> None:
    with pytest.raises(InvalidStatus) as refused:
        _realtime(plane, "voice", SIDE_KEY)
    response = refused.value.response
    assert response.status_code == 404
    assert json.loads(response.body or b"")["error"]["code"] == "model_not_found"
    assert "X-Denv-Replica" not in response.headers
    assert _requests(plane, "voice") == 0
    assert _realtime(plane, "side", SIDE_KEY) == REPLICAS["side"]
    assert _realtime(plane, "voice", FULL_KEY) == REPLICAS["voice"]


def test_the_model_list_shows_a_key_its_pools_alone(plane: Dataplane) -> None:
    def listed(key: str) -> list[str]:
        with plane.client() as client:
            response = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
        return [model["id"] for model in response.json()["data"]]

    assert listed(SIDE_KEY) == ["side"]
    assert listed(FULL_KEY) == ["side", "tts-voice", "voice"]
    assert listed(RATED_KEY) == ["side", "tts-voice", "voice"]
    assert _requests(plane, "voice") + _requests(plane, "side") == 0


def test_a_key_past_its_rate_gets_429_and_other_keys_do_not(plane: Dataplane) -> None:
    """Ten requests in a row from a key of 2 a second: its first two served, at least one of the
    rest refused with OpenAI's 429 and Retry-After; a key without a rate is served every time.
    The model list, which the balancer answers itself, keeps the burst within a second however
    busy the machine; a chat request past the rate is refused before it reaches a replica."""
    auth = {"Authorization": f"Bearer {RATED_KEY}"}
    with plane.client() as client:
        rated = [client.get("/v1/models", headers=auth) for _ in range(10)]
        chat = _call(client, "/v1/chat/completions", "side", RATED_KEY)
        full = [_call(client, "/v1/chat/completions", "side", FULL_KEY) for _ in range(5)]
    assert [r.status_code for r in rated[:2]] == [200, 200]
    limited = [r for r in (*rated, chat) if r.status_code == 429]
    assert limited and {r.status_code for r in rated} == {200, 429}, [r.status_code for r in rated]
    for response in limited:
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "more than 2 requests in the last second" in error["message"]
    assert [r.status_code for r in full] == [200] * 5
    assert _requests(plane, "side") == len(full) + (chat.status_code == 200)
