"""The simulated replica's HTTP/1.1, spoken through h11: reading a request (h11 parses its head),
writing a response (h11 frames its head and body, whole or chunked), a server-sent event, a
connection cut with a TCP reset; and the OpenAI shapes it answers in (a chat completion, whole
or by chunks, and the error object)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import h11

from denv_iac.local.replica_model import ReplicaSimConfig

SELF_HEADER = "X-Denv-Replica-Self"
MAX_HEAD_BYTES = 64 * 1024
_MAX_BODY_BYTES = 16 * 1024 * 1024
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


@dataclass
class Request:
    method: str
    target: str
    keep_alive: bool
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    body: bytes
    # The h11 connection that read this request's head: the response is framed by it.
    http: h11.Connection = field(
        default_factory=lambda: h11.Connection(h11.SERVER), repr=False, compare=False
    )

    @property
    def path(self) -> str:
        """The target without its query string."""
        return self.target.partition("?")[0]

    @property
    def query(self) -> dict[str, str]:
        """The query string's parameters, percent-decoded; a repeated one keeps its last value."""
        return dict(urllib.parse.parse_qsl(self.target.partition("?")[2], keep_blank_values=True))


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ConnectionAborted(Exception):
    """The simulated fault reset the connection; stop serving it."""


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One request from the connection, or None when the peer closed it between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        if error.partial.strip():
            raise BadRequest(400, "truncated request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise BadRequest(400, "request head too large") from None
    # The head alone goes to h11: the body is read by its length from the stream, so that what
    # follows it (the next request, or a WebSocket's first frames) stays there for its reader.
    http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    http.receive_data(head)
    try:
        event = http.next_event()
    except h11.RemoteProtocolError as error:
        raise BadRequest(400, f"malformed request head: {error}") from None
    assert isinstance(event, h11.Request)  # a whole head always makes one, or the error above
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise BadRequest(501, "chunked request bodies are not supported; send Content-Length")
    length = int(headers.get("content-length") or 0)
    if length > _MAX_BODY_BYTES:
        raise BadRequest(413, "request body too large")
    body = await reader.readexactly(length) if length else b""
    # As h11 frames the answer: HTTP/1.1 keeps the connection unless the client says close;
    # HTTP/1.0 never does (h11 keeps no 1.0 connection alive).
    keep_alive = event.http_version == b"1.1" and "close" not in _tokens(headers, "connection")
    method, target = event.method.decode("ascii"), event.target.decode("ascii")
    return Request(method, target, keep_alive, headers, body, http)


def _tokens(headers: dict[str, str], name: str) -> set[str]:
    return {token.strip().lower() for token in headers.get(name, "").split(",")}


def _sent(
    http: h11.Connection,
    event: h11.Response | h11.InformationalResponse | h11.Data | h11.EndOfMessage,
) -> bytes:
    data = http.send(event)
    assert data is not None  # None only for ConnectionClosed
    return data


def response_head(
    request: Request,
    status: int,
    content_type: str,
    config: ReplicaSimConfig,
    length: int | None = None,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """The head of the answer to `request`: with `length`, a body of that many bytes follows;
    without, a body in pieces (chunked to an HTTP/1.1 client) until `response_end`."""
    headers = [
        ("Content-Type", content_type),
        (SELF_HEADER, config.replica_id),
        ("Connection", "keep-alive" if request.keep_alive else "close"),
        *extra,
    ]
    if length is not None:
        headers.append(("Content-Length", str(length)))
    reason = _REASONS.get(status, "Status").encode()
    return _sent(request.http, h11.Response(status_code=status, headers=headers, reason=reason))


def body_piece(request: Request, data: bytes) -> bytes:
    """A piece of the answer's body, framed (a chunk to an HTTP/1.1 client)."""
    return _sent(request.http, h11.Data(data=data))


def response_end(request: Request) -> bytes:
    """The end of the answer's body (the last chunk, where chunked)."""
    return _sent(request.http, h11.EndOfMessage())


async def respond_json(
    writer: asyncio.StreamWriter,
    status: int,
    body: dict[str, Any],
    config: ReplicaSimConfig,
    request: Request,
) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    await respond_bytes(writer, status, "application/json", payload, config, request)


async def respond_bytes(
    writer: asyncio.StreamWriter,
    status: int,
    content_type: str,
    payload: bytes,
    config: ReplicaSimConfig,
    request: Request,
) -> None:
    head = response_head(request, status, content_type, config, length=len(payload))
    writer.write(head + body_piece(request, payload) + response_end(request))
    await writer.drain()


def switching_protocols(request: Request, headers: list[tuple[str, str]]) -> bytes:
    """The 101 answer that hands the connection to a WebSocket, with `headers`."""
    # h11 answers an upgrade once it has seen the whole request: the body was read apart.
    request.http.receive_data(request.body)
    while not isinstance(request.http.next_event(), h11.EndOfMessage):
        pass
    switching = h11.InformationalResponse(
        status_code=101, headers=headers, reason=b"Switching Protocols"
    )
    return _sent(request.http, switching)


def refusal() -> Request:
    """Where no request could be read, what its refusal answers: a connection h11 saw no
    request on, closed after the answer."""
    return Request("GET", "/", False, {}, b"")


def client_left(next_request: asyncio.Future[Request | None]) -> bool:
    """Whether the read of the next request ended because the client closed or reset."""
    if not next_request.done():
        return False
    error = next_request.exception()
    if error is not None:
        return isinstance(error, ConnectionError)
    return next_request.result() is None


def sse_event(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def reset_connection(writer: asyncio.StreamWriter) -> None:
    """Abort with a TCP reset, as a crashed model server's kernel would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def openai_error(
    message: str, status: int, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, as vLLM and SGLang answer it (and send it as a stream's event):
    a client's mistake is an `invalid_request_error` naming the `param` at fault; the engine's
    own failures keep vLLM's types and its numeric code."""
    if status >= 500 and status != 501:
        kind = "ServiceUnavailableError" if status == 503 else "InternalServerError"
        code = status if code is None else code
    else:
        kind = "authentication_error" if status == 401 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's length as the engine would count it, a word for a token."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))


def token_text(index: int) -> str:
    return f"tok{index} "


@dataclass(frozen=True)
class Completion:
    id: str
    model: str
    replica_id: str

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": int(time.time()),
            "model": self.model,
            "replica": self.replica_id,
        }

    def token_chunk(self, index: int) -> dict[str, Any]:
        delta = {"content": token_text(index)}
        if index == 0:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return {**self._envelope("chat.completion.chunk"), "choices": [choice]}

    def final_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {}, "finish_reason": "stop"}
        return {**self._envelope("chat.completion.chunk"), "choices": [choice]}

    def whole(self, tokens: int) -> dict[str, Any]:
        text = "".join(token_text(index) for index in range(tokens))
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
        return {**self._envelope("chat.completion"), "choices": [choice], "usage": usage}
