"""The load client's HTTP/1.1 (h11 over one kept connection per worker): keep-alive, a
connection the server closed, chunked streams split anywhere, TLS, responses framed each way a
server may frame them, and the upgrade to a realtime WebSocket."""

import asyncio
import contextlib
import datetime
import ipaddress
import json
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from websockets.frames import Opcode
from websockets.protocol import Protocol as WsProtocol
from websockets.protocol import Side, State

from denv_iac.local.replica_http import read_request, switching_protocols
from denv_iac.local.voice_sim import realtime_event
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_transport import Endpoint
from denv_iac.wire.audio import audio_frame
from denv_iac.wire.websocket import WebSocket, handshake_headers

# The n-th request on a connection -> the raw response; a list is written piece by piece, a
# pause between pieces, so that the client reads each on its own.
Respond = Callable[[int], bytes | list[bytes]]
PAUSE_S = 0.05


def _sse(*tokens: str) -> list[bytes]:
    events = [f"data: {json.dumps({'choices': [{'delta': {'content': t}}]})}\n\n" for t in tokens]
    return [e.encode() for e in [*events, "data: [DONE]\n\n"]]


def _chunked(parts: list[bytes], pieces: int = 1) -> bytes:
    """Each part as its own chunk, split further into `pieces` chunks mid-line."""
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    out += b"X-Denv-Replica: r1\r\n\r\n"
    for part in parts:
        step = max(1, len(part) // pieces)
        for i in range(0, len(part), step):
            piece = part[i : i + step]
            out += b"%x\r\n" % len(piece) + piece + b"\r\n"
    return out + b"0\r\n\r\n"


class Server:
    """An asyncio server on 127.0.0.1 in a thread; counts connections and requests."""

    def __init__(self, respond: Respond, tls: ssl.SSLContext | None = None) -> None:
        self.respond, self.tls = respond, tls
        self.connections = 0
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        )
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                self.requests += 1
                response = self.respond(n)
                n += 1
                if not response:
                    break  # close without answering, as a keep-alive timeout does
                pieces = response if isinstance(response, list) else [response]
                for index, piece in enumerate(pieces):
                    if index:
                        await asyncio.sleep(PAUSE_S)
                    writer.write(piece)
                    await writer.drain()
                if b"Connection: close" in pieces[0]:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(respond: Respond, tls: ssl.SSLContext | None = None) -> Server:
        servers.append(Server(respond, tls))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _load(url: str, concurrency: int, requests: int) -> list[tuple[str, int]]:
    report = asyncio.run(run_load(url, "voice", concurrency=concurrency, requests=requests))
    return [(r.error, r.tokens) for r in report.results]


def test_each_worker_keeps_one_connection_and_reads_streams_split_mid_line(
    serve: Callable[..., Server],
) -> None:
    server = serve(lambda n: _chunked(_sse("a", "b", "c"), pieces=3))
    assert _load(f"http://127.0.0.1:{server.port}", 3, 12) == [("", 3)] * 12
    assert (server.connections, server.requests) == (3, 12)


def test_a_kept_connection_the_server_closed_is_opened_again_not_an_error(
    serve: Callable[..., Server],
) -> None:
    # Every second request on a connection finds it closed before any response byte.
    server = serve(lambda n: _chunked(_sse("a")) if n == 0 else b"")
    assert _load(f"http://127.0.0.1:{server.port}", 1, 3) == [("", 1)] * 3
    assert server.connections == 3


def test_error_responses_are_read_whole_and_connection_close_is_honoured(
    serve: Callable[..., Server],
) -> None:
    body = b'{"error":{"code":"no_healthy_replica"}}'
    answers = [
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body,
    ]
    server = serve(lambda n: answers[n % 2])
    assert _load(f"http://127.0.0.1:{server.port}", 1, 4) == [("http_503", 0)] * 4
    assert server.connections == 2


def _framed(kind: str) -> bytes:
    body = b"".join(_sse("a", "b"))
    return {
        "length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        # No length and no chunks: the body ends when the server closes the connection.
        "eof": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body,
        "informational": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n"
        b"Link: </a>\r\n\r\n" + _chunked(_sse("a", "b")),
    }[kind]


@pytest.mark.parametrize(("kind", "connections"), [("length", 1), ("eof", 3), ("informational", 1)])
def test_streams_framed_by_length_by_the_close_or_after_informational_answers(
    serve: Callable[..., Server], kind: str, connections: int
) -> None:
    server = serve(lambda n: _framed(kind))
    assert _load(f"http://127.0.0.1:{server.port}", 1, 3) == [("", 2)] * 3
    assert server.connections == connections


def test_a_speech_chunk_read_in_pieces_is_one_unit_of_audio(
    serve: Callable[..., Server],
) -> None:
    frame = audio_frame(0)
    stream = _chunked([frame, frame]).replace(b"text/event-stream", b"audio/pcm")
    split = stream.index(frame) + len(frame) // 2  # mid-way through the first chunk's data
    server = serve(lambda n: [stream[:split], stream[split:]])
    url = f"http://127.0.0.1:{server.port}"
    report = asyncio.run(run_load(url, "voice", protocol="speech", requests=1))
    (result,) = report.results
    assert (result.error, result.tokens, len(result.gaps_ms)) == ("", 2 * len(frame), 1)
    # The first audio byte is timed when the first chunk is whole, after the pause.
    assert result.ttft_ms is not None and result.ttft_ms >= PAUSE_S * 1000


async def _realtime_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers the upgrade and sends `session.created` in the same write, so the client's
    HTTP parser holds the first frame when the 101 is parsed; then one audio delta per turn."""
    request = await read_request(reader)
    assert request is not None
    headers = handshake_headers(request.headers, {})
    assert headers is not None
    answer = switching_protocols(request, headers)
    server = WsProtocol(Side.SERVER, state=State.OPEN)
    server.send_text(realtime_event("session.created", 0))
    writer.write(answer + b"".join(server.data_to_send()))
    ws = WebSocket(reader, writer, Side.SERVER)
    with contextlib.suppress(ConnectionError):
        while (await ws.receive())[0] is Opcode.TEXT:
            delta = realtime_event("response.output_audio.delta", 1, delta="AAAA")
            await ws.send_text(delta)
            await ws.send_text(realtime_event("response.done", 2))
    writer.close()


def test_a_realtime_upgrade_hands_the_bytes_after_the_101_to_the_websocket() -> None:
    async def scenario() -> list[tuple[str, int]]:
        server = await asyncio.start_server(_realtime_server, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            report = await run_load(
                f"http://127.0.0.1:{port}", "voice", protocol="realtime", requests=3, timeout_s=5
            )
        return [(r.error, r.tokens) for r in report.results]

    assert asyncio.run(scenario()) == [("", 1)] * 3


def test_a_stream_cut_before_done_is_an_abort_a_silent_one_a_timeout(
    serve: Callable[..., Server],
) -> None:
    stream = _chunked(_sse("a", "b"))
    unfinished = stream[: stream.index(b"[DONE]") - 8]
    # The server closes mid-body: the stream was cut.
    closes = serve(lambda n: unfinished.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
    assert _load(f"http://127.0.0.1:{closes.port}", 1, 1) == [("aborted", 2)]
    # The server keeps the connection and says nothing more: the read timeout ends it.
    silent = serve(lambda n: unfinished)
    url = f"http://127.0.0.1:{silent.port}"
    report = asyncio.run(run_load(url, "voice", concurrency=1, requests=1, timeout_s=0.5))
    assert [(r.error, r.tokens) for r in report.results] == [("timeout", 2)]
    assert 500 <= report.results[0].total_ms < 2000
    # A connection closed before any response byte, on a fresh connection: no response.
    mute = serve(lambda n: b"")
    assert _load(f"http://127.0.0.1:{mute.port}", 1, 1) == [("no_response", 0)]


def _tls(tmp_path: Path) -> tuple[ssl.SSLContext, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context, cert_file


def test_https_endpoints_are_verified_against_the_trusted_authorities(
    serve: Callable[..., Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    context, cert_file = _tls(tmp_path)
    server = serve(lambda n: _chunked(_sse("a", "b")), tls=context)
    url = f"https://127.0.0.1:{server.port}"
    # Not trusted: the connection is refused by the client, as a connect error.
    assert _load(url, 1, 1) == [("connect", 0)]
    monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))
    assert _load(url, 2, 4) == [("", 2)] * 4


@pytest.mark.parametrize(
    ("url", "authority", "path"),
    [
        ("http://127.0.0.1:8080", "127.0.0.1:8080", ""),
        ("https://gpu.example.com/", "gpu.example.com", ""),
        ("https://gpu.example.com:8443/team/", "gpu.example.com:8443", "/team"),
        ("http://[::1]:9000", "[::1]:9000", ""),
    ],
)
def test_endpoint_parts(url: str, authority: str, path: str) -> None:
    endpoint = Endpoint(url)
    assert (endpoint.authority, endpoint.prefix) == (authority, path)
