"""The simulated replica's request reading: h11 parses the head, the body is read by its length
and nothing past it, and the query string is read as a query string."""

import asyncio

import pytest

from denv_iac.local.replica_http import BadRequest, Request, read_request


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
        (b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True),
        (b"GET /health HTTP/1.1\r\nHost: sim\r\nConnection: close\r\n\r\n", False),
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
