"""The simulated replica's HTTP: h11 parses the request head, the body is read by its length
and nothing past it, the query string is read as a query string; h11 frames the answers, which
a client's h11 reads back."""

import asyncio
import socket

import h11
import pytest

from denv_iac.local.replica_http import (
    SELF_HEADER,
    BadRequest,
    Request,
    body_piece,
    read_request,
    refusal,
    respond_bytes,
    response_end,
    response_head,
    switching_protocols,
)
from denv_iac.local.replica_model import ReplicaSimConfig

CONFIG = ReplicaSimConfig(replica_id="voice.local.n0.0")


def read(data: bytes) -> tuple[Request | None, bytes]:
    """The request read from a stream holding `data`, and what the stream still holds after."""

    async def go() -> tuple[Request | None, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_request(reader), await reader.read()

    return asyncio.run(go())


def test_the_body_is_read_by_its_length_and_what_follows_stays_for_the_next_reader() -> None:
    request, left = read(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nContent-Length: 4\r\n"
        b"X-Tag: a\r\nx-tag: b\r\n\r\nbodyGET /health"
    )
    assert request is not None
    assert (request.method, request.path, request.body) == ("POST", "/v1/chat/completions", b"body")
    assert request.headers == {"host": "sim", "content-length": "4", "x-tag": "b"}
    assert request.keep_alive
    assert left == b"GET /health"


def test_the_query_string_is_percent_decoded_and_left_out_of_the_path() -> None:
    request, _ = read(b"GET /v1/realtime?model=gpt%2Drealtime&beta HTTP/1.1\r\nHost: sim\r\n\r\n")
    assert request is not None
    assert request.path == "/v1/realtime"
    assert request.query == {"model": "gpt-realtime", "beta": ""}


@pytest.mark.parametrize(
    ("head", "keep_alive"),
    [
        (b"GET /health HTTP/1.0\r\n\r\n", False),  # HAProxy's health check: no Host in 1.0
        # h11 frames the answers and keeps no HTTP/1.0 connection alive: neither does the
        # replica, so that what it does matches what its answer's head says.
        (b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", False),
        (b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n", True),
        (b"GET /health HTTP/1.1\r\nHost: sim\r\nConnection: close\r\n\r\n", False),
        (b"GET /health HTTP/1.1\r\nHost: sim\r\nConnection: TE, Close\r\n\r\n", False),
    ],
)
def test_keep_alive_follows_the_version_and_the_connection_header(
    head: bytes, keep_alive: bool
) -> None:
    request, _ = read(head)
    assert request is not None and request.keep_alive is keep_alive


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"nonsense\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: sim\r\nContent-Length: many\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: sim\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nHost: sim\r\nContent-Length: 99999999999\r\n\r\n", 413),
        (b"GET / HTTP/1.1\r\nHost: sim\r\n", 400),  # the connection ended inside the head
    ],
)
def test_a_bad_request_is_refused_with_its_status(head: bytes, status: int) -> None:
    with pytest.raises(BadRequest) as refused:
        read(head)
    assert refused.value.status == status


def test_a_connection_closed_between_requests_reads_as_none() -> None:
    assert read(b"") == (None, b"")


def answered(request_head: bytes, answer: bytes) -> list[object]:
    """What a client's h11, having sent `request_head`, reads from `answer`, to the end."""
    client = h11.Connection(h11.CLIENT)
    client.send(_request_event(request_head))
    client.send(h11.EndOfMessage())
    client.receive_data(answer)
    client.receive_data(b"")  # the replica's side closes, where it says it will
    events: list[object] = []
    while not isinstance(event := client.next_event(), h11.ConnectionClosed):
        if event is h11.NEED_DATA or event is h11.PAUSED:
            break
        events.append(event)
    return events


def _request_event(head: bytes) -> h11.Request:
    server = h11.Connection(h11.SERVER)
    server.receive_data(head)
    event = server.next_event()
    assert isinstance(event, h11.Request)
    return event


def streamed(head: bytes) -> tuple[Request, bytes]:
    request, _ = read(head)
    assert request is not None
    answer = response_head(request, 200, "text/event-stream", CONFIG, extra=(("X-Tag", "a"),))
    answer += body_piece(request, b"data: 1\n\n") + body_piece(request, b"data: [DONE]\n\n")
    return request, answer + response_end(request)


def test_a_stream_to_an_http_1_1_client_is_chunked_and_read_back_whole() -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nContent-Length: 0\r\n\r\n"
    request, answer = streamed(head)
    assert b"Transfer-Encoding: chunked\r\n" in answer
    response, *pieces, end = answered(head, answer)
    assert isinstance(response, h11.Response) and response.status_code == 200
    assert dict(response.headers)[SELF_HEADER.lower().encode()] == b"voice.local.n0.0"
    assert dict(response.headers)[b"x-tag"] == b"a"
    assert dict(response.headers)[b"connection"] == b"keep-alive"
    assert b"".join(bytes(p.data) for p in pieces if isinstance(p, h11.Data)) == (
        b"data: 1\n\ndata: [DONE]\n\n"
    )
    assert isinstance(end, h11.EndOfMessage)
    assert request.http.our_state is h11.DONE


def test_a_stream_to_an_http_1_0_client_ends_with_the_connection() -> None:
    head = b"GET /v1/chat/completions HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    request, answer = streamed(head)
    assert b"Transfer-Encoding" not in answer and b"Connection: close\r\n" in answer
    assert not request.keep_alive and request.http.our_state is h11.MUST_CLOSE


def test_a_whole_answer_carries_its_length() -> None:
    head = b"GET /metrics HTTP/1.1\r\nHost: sim\r\n\r\n"
    request, _ = read(head)
    assert request is not None

    async def written() -> bytes:
        ours, theirs = socket.socketpair()
        with theirs:
            _, writer = await asyncio.open_connection(sock=ours)
            await respond_bytes(writer, 200, "text/plain", b"ok", CONFIG, request)
            writer.close()
            await writer.wait_closed()
            return theirs.recv(65536)

    response, data, end = answered(head, asyncio.run(written()))
    assert isinstance(response, h11.Response)
    assert dict(response.headers)[b"content-length"] == b"2"
    assert isinstance(data, h11.Data) and bytes(data.data) == b"ok"
    assert isinstance(end, h11.EndOfMessage)


def test_a_refusal_where_no_request_was_read_closes_the_connection() -> None:
    request = refusal()
    answer = response_head(request, 400, "application/json", CONFIG, length=2)
    answer += body_piece(request, b"{}") + response_end(request)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"Connection: close\r\n" in answer and b"Content-Length: 2\r\n" in answer
    assert request.http.our_state is h11.MUST_CLOSE


def test_an_upgrade_is_answered_101_and_the_connection_handed_over() -> None:
    head = (
        b"GET /v1/realtime HTTP/1.1\r\nHost: sim\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    request, _ = read(head)
    assert request is not None
    answer = switching_protocols(request, [("Upgrade", "websocket"), ("Connection", "Upgrade")])
    assert answer.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
    assert request.http.our_state is h11.SWITCHED_PROTOCOL
    client = h11.Connection(h11.CLIENT)
    client.send(_request_event(head))
    client.send(h11.EndOfMessage())
    client.receive_data(answer + b"first frame")
    switched = client.next_event()
    assert isinstance(switched, h11.InformationalResponse) and switched.status_code == 101
    assert client.trailing_data == (b"first frame", False)
