"""Realtime client secrets through a real HAProxy: minted with a key, then a session opened by a
WebSocket client that sends no header of its own, only subprotocols, as a browser does."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from benchmarks.lab.dataplane import Dataplane
from denv_iac.core.balancer import KeyScope
from denv_iac.core.balancer.client_secrets import client_secret, key_map, subprotocols

from .scoped_keys import FULL_KEY, POOLS, REPLICAS, SIDE_KEY, digest

SIGNING_KEY = "client-secret-signing-key-of-the-test-0123456789"


@pytest.fixture
def plane(start_dataplane: Callable[..., Dataplane], tmp_path: Path) -> Iterator[Dataplane]:
    key_file = tmp_path / "client-secret.map"
    key_file.write_text(key_map(SIGNING_KEY))
    key_file.chmod(0o600)
    yield start_dataplane(
        pools=POOLS,
        replica_ids=tuple(REPLICAS.values()),
        api_key_digests=(digest(FULL_KEY), digest(SIDE_KEY)),
        key_scopes=(KeyScope(digest(SIDE_KEY), ("side",)),),
        client_secret_key_file=str(key_file),
    )


def _mint(plane: Dataplane, key: str, body: dict[str, Any]) -> httpx.Response:
    with plane.client() as client:
        return client.post(
            "/v1/realtime/client_secrets", json=body, headers={"Authorization": f"Bearer {key}"}
        )


def _secret(plane: Dataplane, pool: str, key: str = FULL_KEY) -> str:
    response = _mint(plane, key, {"session": {"type": "realtime", "model": pool}})
    assert response.status_code == 200, response.text
    return str(response.json()["value"])


def _sessions(plane: Dataplane, pool: str) -> int:
    return int(plane.replicas[REPLICAS[pool]].stats()["realtime_sessions"])


def _url(plane: Dataplane, model: str) -> str:
    return plane.url.replace("http://", "ws://") + f"/v1/realtime?model={model}"


def _audio_bytes(plane: Dataplane, model: str, offered: list[str]) -> tuple[int, str | None]:
    """Open a session offering `offered` and no header, ask for one answer: its audio bytes
    and the subprotocol the session runs."""
    with connect(
        _url(plane, model), subprotocols=[Subprotocol(p) for p in offered], open_timeout=5
    ) as ws:
        assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
        ws.send(json.dumps({"type": "response.create"}))
        audio = 0
        while True:
            event = json.loads(ws.recv(timeout=5))
            if event["type"] == "response.output_audio.delta":
                audio += len(event["delta"])
            if event["type"] == "response.done":
                return audio, ws.subprotocol


def test_a_client_that_can_send_headers_may_send_the_secret_as_its_bearer_token(
    plane: Dataplane,
) -> None:
    """A native app or the OpenAI SDK given the secret as its key: `Authorization: Bearer ek_`,
    on the realtime path alone (the chat path refuses it: see below)."""
    secret = _secret(plane, "voice")
    bearer = {"Authorization": f"Bearer {secret}"}
    offered = [Subprotocol("realtime")]
    with connect(_url(plane, "voice"), additional_headers=bearer, subprotocols=offered) as ws:
        assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
    expired = {"Authorization": f"Bearer {client_secret(SIGNING_KEY, 'voice', 1)}"}
    with pytest.raises(InvalidStatus) as refused:
        connect(_url(plane, "voice"), additional_headers=expired, open_timeout=5)
    assert refused.value.response.status_code == 401
    assert _sessions(plane, "voice") == 1


def test_the_openai_sdk_mints_with_the_key_and_connects_with_the_secret(plane: Dataplane) -> None:
    """The SDK's own calls: `client.realtime.client_secrets.create` on the app's server, then a
    realtime client given the secret as its API key (it sends it as the bearer token)."""

    def client(key: str) -> openai.OpenAI:
        ws_url = plane.url.replace("http://", "ws://") + "/v1"
        return openai.OpenAI(base_url=f"{plane.url}/v1", api_key=key, websocket_base_url=ws_url)

    minted = client(FULL_KEY).realtime.client_secrets.create(
        session={"type": "realtime", "model": "voice"},
        expires_after={"anchor": "created_at", "seconds": 30},
    )
    assert minted.value.startswith("ek_voice.")
    assert abs(minted.expires_at - (time.time() + 30)) <= 2
    with client(minted.value).realtime.connect(model="voice") as connection:
        assert connection.recv().type == "session.created"
        connection.response.create()
        audio = 0
        for event in connection:
            if event.type == "response.output_audio.delta":
                audio += len(event.delta)
            if event.type == "response.done":
                break
    assert audio > 0
    with pytest.raises(openai.AuthenticationError):
        client(minted.value).with_options(max_retries=0).chat.completions.create(
            model="voice", messages=[]
        )


def _refused(plane: Dataplane, model: str, offered: list[str]) -> httpx.Response:
    """The answer to a session that must be refused before the upgrade, as an httpx answer."""
    with (
        pytest.raises(InvalidStatus) as refused,
        connect(_url(plane, model), subprotocols=[Subprotocol(p) for p in offered], open_timeout=5),
    ):
        pass
    response = refused.value.response
    answer = httpx.Response(response.status_code, headers=dict(response.headers))
    answer._content = bytes(response.body or b"")  # read already, by the WebSocket client
    return answer


def test_a_minted_secret_opens_a_session_of_its_pool_and_the_replica_never_sees_it(
    plane: Dataplane,
) -> None:
    before = int(time.time())
    minted = _mint(plane, FULL_KEY, {"session": {"type": "realtime", "model": "tts-voice"}})
    assert minted.status_code == 200, minted.text
    assert minted.headers["cache-control"] == "no-store"
    answer = minted.json()
    assert answer["session"] == {"type": "realtime", "model": "voice"}  # the alias's pool
    assert before + 60 <= answer["expires_at"] <= int(time.time()) + 60
    secret = answer["value"]
    assert secret.startswith("ek_voice.")
    audio, chosen = _audio_bytes(plane, "voice", subprotocols(secret))
    assert audio > 0 and chosen == "realtime"
    assert plane.replicas[REPLICAS["voice"]].stats()["realtime_subprotocols"] == "realtime"
    # An alias of the pool is the pool.
    assert _audio_bytes(plane, "tts-voice", subprotocols(secret))[0] > 0
    log = (plane.workdir / "haproxy.log").read_text()
    assert secret.rsplit(".", 1)[1] not in log


def test_the_ttl_is_the_callers_within_bounds(plane: Dataplane) -> None:
    answer = _mint(
        plane, FULL_KEY, {"session": {"model": "side"}, "expires_after": {"seconds": 600}}
    )
    assert answer.status_code == 200, answer.text
    assert abs(answer.json()["expires_at"] - (time.time() + 600)) <= 2
    # (HAProxy's json_query reads the string "60" as 60: that one is taken.)
    for seconds in (9, 601, "6000", 60.5, -1, "soon"):
        body = {"session": {"model": "side"}, "expires_after": {"seconds": seconds}}
        response = _mint(plane, FULL_KEY, body)
        assert response.status_code == 400, (seconds, response.text)
        assert "expires_after.seconds" in response.json()["error"]["message"]


def _client_secret_error(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert "x-denv-replica" not in response.headers


def test_expired_tampered_or_foreign_secrets_are_refused_before_the_upgrade(
    plane: Dataplane,
) -> None:
    now = int(time.time())
    good = client_secret(SIGNING_KEY, "voice", now + 60)
    pool, expires, mac = good.removeprefix("ek_").split(".")
    flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
    refused = {
        "expired": client_secret(SIGNING_KEY, "voice", now - 1),
        "tampered mac": f"ek_{pool}.{expires}.{flipped}",
        "later expiry": f"ek_{pool}.{now + 3600}.{mac}",
        "other pool named": f"ek_side.{expires}.{mac}",
        "other signing key": client_secret("another-signing-key-" * 3, "voice", now + 60),
        "not hex": f"ek_{pool}.{expires}.{mac.upper()}",
        "another pool's secret": _secret(plane, "side"),
        "an API key": FULL_KEY,
    }
    for what, secret in refused.items():
        response = _refused(plane, "voice", subprotocols(secret))
        assert response.status_code == 401, what
        _client_secret_error(response)
    assert _sessions(plane, "voice") == 0
    assert _audio_bytes(plane, "voice", subprotocols(good))[0] > 0


def test_a_secret_opens_nothing_but_a_realtime_session(plane: Dataplane) -> None:
    secret = _secret(plane, "voice")
    as_bearer = {"Authorization": f"Bearer {secret}"}
    as_subprotocol = {"Sec-WebSocket-Protocol": ", ".join(subprotocols(secret))}
    body = {"model": "voice", "input": "hi", "voice": "alloy", "messages": []}
    with plane.client() as client:
        answers = [
            client.post(path, json=body, headers=headers)
            for path in ("/v1/chat/completions", "/v1/audio/speech")
            for headers in (as_bearer, as_subprotocol)
        ]
        answers += [client.get("/v1/models", headers=h) for h in (as_bearer, as_subprotocol)]
        # Nor does it mint another.
        answers.append(
            client.post(
                "/v1/realtime/client_secrets",
                json={"session": {"model": "voice"}},
                headers=as_bearer,
            )
        )
    for response in answers:
        _client_secret_error(response)
    stats = plane.replicas[REPLICAS["voice"]].stats()
    assert stats["requests"] == 0


def test_minting_is_refused_outside_the_keys_scope(plane: Dataplane) -> None:
    refused = _mint(plane, SIDE_KEY, {"session": {"model": "voice"}})
    unknown = _mint(plane, SIDE_KEY, {"session": {"model": "no-such-pool"}})
    assert refused.status_code == 404
    assert refused.content == unknown.content
    assert refused.json()["error"]["code"] == "model_not_found"
    keyless = _mint(plane, "sk-not-listed", {"session": {"model": "side"}})
    assert keyless.status_code == 401
    # The side key mints for side, and its secret opens a side session.
    assert _audio_bytes(plane, "side", subprotocols(_secret(plane, "side", SIDE_KEY)))[0] > 0
