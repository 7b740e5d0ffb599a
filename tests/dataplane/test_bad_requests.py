"""Hostile and malformed requests get a clean error from the endpoint, never a hang or a leak."""

from __future__ import annotations

import hashlib
import socket
from typing import Any

import httpx
import pytest

from benchmarks.lab.dataplane import Dataplane

KEY = "sk-test-0123456789"


def post(plane: Dataplane, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    with plane.client() as client:
        return client.post(
            "/v1/chat/completions",
            content=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        )


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"{not json", {}, 404),  # no model can be read: no pool
        (b'{"model": 17}', {}, 404),
        (b'{"model": "voice\\nuse_backend llm"}', {}, 404),
        (b'{"model": "../../etc/passwd"}', {}, 404),
        (b'{"model": "voice"}', {"X-Denv-Pool": "voice llm"}, 404),
        (b'{"model": "voice"}', {"X-Denv-Pool": "x" * 4000}, 404),
    ],
)
def test_unroutable_requests_get_json_404(
    dataplane: Dataplane, body: bytes, headers: dict[str, str], status: int
) -> None:
    response = post(dataplane, body, headers)
    assert response.status_code == status
    assert response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["message"].endswith("to a served pool: llm, voice")
    assert "x-denv-replica" not in response.headers


def test_session_id_with_odd_bytes_still_routes(dataplane: Dataplane) -> None:
    response = post(
        dataplane,
        b'{"model": "voice", "max_tokens": 2}',
        {"X-Denv-Session": "a\tb;c=d, %0d%0aX-Injected: 1"},
    )
    assert response.status_code == 200
    assert "x-injected" not in response.headers


def test_huge_body_is_refused_or_served_not_hung(dataplane: Dataplane) -> None:
    body = b'{"model": "voice", "pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    response = post(dataplane, body)
    # Larger than the routing buffer: the model field is read from the first 64 KiB, and the
    # request is served (it is only not retryable); it must never hang or leak an HTML page.
    assert response.status_code == 200
    assert response.headers["x-denv-replica"].startswith("voice.")
    assert response.headers["content-type"].startswith("application/json")


def test_bad_and_missing_keys_never_reach_a_replica(start_dataplane: Any) -> None:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    plane: Dataplane = start_dataplane(api_key_digests=(digest,))
    body = b'{"model": "voice", "max_tokens": 2}'
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
    ):
        response = post(plane, body, headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert sum(r.stats()["requests"] for r in plane.replicas.values()) == 0
    ok = post(plane, body, {"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    log = (plane.workdir / "haproxy.log").read_text(errors="replace")
    assert KEY not in log


def raw_exchange(plane: Dataplane, request: bytes) -> bytes:
    """Send `request` as is on one connection; what came back until the balancer closed it."""
    answer = b""
    with socket.create_connection(("127.0.0.1", plane.settings.port), timeout=5) as sock:
        sock.sendall(request)
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


# Every control character but the tab (allowed in a value) and LF, which ends a line (a lone LF
# is a line end HAProxy accepts, as RFC 9112 lets a recipient).
CONTROL_BYTES = [bytes([c]) for c in (*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F)]


def with_header(header: bytes) -> bytes:
    body = b'{"model": "voice", "max_tokens": 1}'
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        + header
        + b"\r\nConnection: close\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def test_a_control_character_in_a_header_is_refused_with_400(dataplane: Dataplane) -> None:
    # Each byte in a value, at the start, in the middle and past 24 KiB and 48 KiB of headers
    # (where the balancer reads the headers in another piece), and in a name.
    pad = b"X-Pad: " + b"p" * 30000 + b"\r\n"
    for control in CONTROL_BYTES:
        for header in (
            b"X-Note: " + control + b"b",
            b"X-Note: a" + control + b"b",
            pad + b"X-Note: a" + control,
            pad + pad + b"X-Note: a" + control,
            b"X-N" + control + b"te: ab",
        ):
            answer = raw_exchange(dataplane, with_header(header))
            assert answer.startswith(b"HTTP/1.1 400 "), (control, header[-12:], answer[:200])
    assert sum(r.stats()["requests"] for r in dataplane.replicas.values()) == 0
    # A tab in a value, and large headers, still pass.
    answer = raw_exchange(dataplane, with_header(pad + pad + b"X-Note: a\tb"))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def _replica_requests(plane: Dataplane) -> int:
    return sum(r.stats()["requests"] for r in plane.replicas.values())


# The balancer reads the first model key; a replica's parser (Python's json, vLLM) the last.
@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "voice", "model": "llm"}',
        b'{"model":"voice","messages":[],"model":"llm"}',
        b'{"model": "voice", "mod\\u0065l": "llm"}',
        b'{"\\u006d\\u006F\\u0064\\u0065\\u006C": "llm", "model": "voice"}',
        b'{"mod\\u0065l": "voice"}',  # once, but the balancer cannot read it as model
        b'{\n  "model" : "voice",\n\t"model"\t:\t"llm"\n}',
        b'{"model": "voice", "stream": false, "n": {"model": "llm"}}',  # nested: counted too
    ],
)
def test_a_body_with_its_model_key_twice_or_escaped_is_refused_before_routing(
    dataplane: Dataplane, body: bytes
) -> None:
    response = post(dataplane, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "ambiguous_model")
    assert "X-Denv-Pool" in error["message"]
    assert "x-denv-replica" not in response.headers
    assert _replica_requests(dataplane) == 0


@pytest.mark.parametrize(
    ("body", "headers", "pool"),
    [
        (b'{"model": "voice", "messages": [{"role": "user", "content": "hi"}]}', {}, "voice"),
        # "model" inside string values, quotes escaped: text, not keys.
        (
            b'{"model": "llm", "messages": [{"role": "user", "content":'
            b' "{\\"model\\": \\"voice\\", \\"model\\": \\"x\\"}"}], "user": "model"}',
            {},
            "llm",
        ),
        (b'{"messages": [{"content": "\\u00e9t\\u00e9"}], "model": "voice"}', {}, "voice"),
        (b'{"tools": [{"caf\\u00e9": 1}], "model": "llm"}', {}, "llm"),
        (b'{"model_name": "x", "models": [], "model": "voice"}', {}, "voice"),
        # The header names the pool: the body's keys do not route it.
        (b'{"model": "voice", "model": "llm"}', {"X-Denv-Pool": "llm"}, "llm"),
    ],
)
def test_a_body_read_one_way_is_still_routed(
    dataplane: Dataplane, body: bytes, headers: dict[str, str], pool: str
) -> None:
    response = post(dataplane, body, headers)
    assert response.status_code == 200, response.text
    assert response.headers["x-denv-replica"].startswith(f"{pool}.")
