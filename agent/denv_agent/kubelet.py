"""The kubelet's pod-resources API over its unix socket: one unary gRPC call, no gRPC library.

The agent depends on two packages only; grpcio would add a large native one for a single call.
gRPC is HTTP/2 with a 5-byte length prefix on each message, and this call needs little of
HTTP/2: the connection preface and SETTINGS, one request stream (HEADERS encoded as HPACK
literals, which need no table, then one DATA frame), SETTINGS and PING acknowledged, and the
answer's DATA frames read until the stream ends. Flow control is opened wide at the start, so
an answer of any size arrives without WINDOW_UPDATEs from here. The answer's headers are not
decoded (HPACK may use Huffman codes and a dynamic table): a call that ends without a message
is a failure, whatever its grpc-status.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from denv_agent.pod_resources import LIST_METHOD, PodResources, decode_list_response

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
WINDOW_UPDATE = 0x8
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
STREAM = 1
MAX_ANSWER = 64 * 1024 * 1024  # far above any node's pod list


class PodResourcesError(OSError):
    """The kubelet could not be asked, or did not answer with a pod list."""


class KubeletPodResources:
    """A `PodResourcesSource` reading the kubelet's socket, one connection per call."""

    def __init__(self, socket_path: Path, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def list(self) -> tuple[PodResources, ...]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(self.timeout_s)
                conn.connect(str(self.socket_path))
                conn.sendall(request())
                message = _answer(conn)
        except PodResourcesError:
            raise
        except OSError as e:
            reason = e.strerror or type(e).__name__
            raise PodResourcesError(f"pod-resources {self.socket_path}: {reason}") from None
        return decode_list_response(message)


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman coding."""
    return b"\x00" + _string(name.encode()) + _string(value.encode())


def _string(data: bytes) -> bytes:
    return _integer(len(data), 7) + data


def _integer(value: int, prefix_bits: int) -> bytes:
    """HPACK's prefixed integer (RFC 7541, 5.1), the flag bits above the prefix left at 0."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([value])
    out, value = bytearray([top]), value - top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def request() -> bytes:
    """Everything the client sends: preface, settings, a wide window, the call, its message."""
    settings = struct.pack(">HI", SETTINGS_ENABLE_PUSH, 0) + struct.pack(
        ">HI", SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW
    )
    headers = b"".join(
        _literal(name, value)
        for name, value in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", LIST_METHOD),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )
    empty_message = b"\x00" + struct.pack(">I", 0)  # ListPodResourcesRequest has no fields
    return b"".join(
        [
            PREFACE,
            frame(SETTINGS, 0, 0, settings) + settings,
            _window_update(0, MAX_WINDOW - DEFAULT_WINDOW),
            frame(HEADERS, END_HEADERS, STREAM, headers) + headers,
            frame(DATA, END_STREAM, STREAM, empty_message) + empty_message,
        ]
    )


def _window_update(stream: int, increment: int) -> bytes:
    payload = struct.pack(">I", increment)
    return frame(WINDOW_UPDATE, 0, stream, payload) + payload


def _answer(conn: socket.socket) -> bytes:
    """The answer's one gRPC message, once its stream has ended."""
    reader = _Reader(conn)
    body = bytearray()
    while True:
        kind, flags, stream, payload = reader.frame()
        if kind == SETTINGS and not flags & ACK:
            conn.sendall(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            conn.sendall(frame(PING, ACK, 0, payload) + payload)
        elif kind == GOAWAY:
            raise PodResourcesError("the kubelet closed the connection (GOAWAY)")
        elif stream != STREAM:
            continue
        elif kind == RST_STREAM:
            code = int.from_bytes(payload[:4], "big")
            raise PodResourcesError(f"the kubelet reset the call (HTTP/2 error {code})")
        elif kind == DATA:
            body += _unpadded(flags, payload)
            if len(body) > MAX_ANSWER:
                raise PodResourcesError(f"answer over {MAX_ANSWER} bytes")
        if stream == STREAM and kind in (DATA, HEADERS) and flags & END_STREAM:
            return _message(bytes(body))


def _unpadded(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    pad = payload[0]
    return payload[1 : len(payload) - pad]


def _message(body: bytes) -> bytes:
    if len(body) < 5:
        raise PodResourcesError("the call ended without a pod list (a gRPC error)")
    compressed, size = body[0], int.from_bytes(body[1:5], "big")
    if compressed or len(body) != 5 + size:
        raise PodResourcesError("the pod list is compressed or cut")
    return body[5:]


class _Reader:
    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""

    def _exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            chunk = self.conn.recv(65536)
            if not chunk:
                raise PodResourcesError("the kubelet closed the connection mid-answer")
            self.buffer += chunk
        out, self.buffer = self.buffer[:size], self.buffer[size:]
        return out

    def frame(self) -> tuple[int, int, int, bytes]:
        head = self._exactly(9)
        size = int.from_bytes(head[:3], "big")
        stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        return head[3], head[4], stream, self._exactly(size)
