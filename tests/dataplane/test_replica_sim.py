"""The simulated replica on its own: HTTP framing, SSE, statistics and fault injection."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from websockets.frames import Frame, Opcode
from websockets.protocol import Protocol as WsProtocol
from websockets.protocol import Side

from denv_iac.local.replica_model import ReplicaSimConfig, control_headers
from denv_iac.local.replica_server import ReplicaSim
from denv_iac.local.replica_sim import ReplicaProcess

Scenario = Callable[[ReplicaSim], Awaitable[None]]
TOKEN = "t0k3n-of-this-test"
# Sent with every /control/fault request that names no Authorization of its own.
AUTH = "".join(f"{k}: {v}\r\n" for k, v in control_headers(TOKEN).items())


def run_with_sim(scenario: Scenario, **config: Any) -> None:
    async def main() -> None:
        sim = ReplicaSim(ReplicaSimConfig("voice.local.n0.0", control_token=TOKEN, **config))
        await sim.start()
        try:
            await asyncio.wait_for(scenario(sim), timeout=10)
        finally:
            await sim.close()

    asyncio.run(main())


async def request(
    sim: ReplicaSim, method: str, path: str, body: object = None, headers: str = ""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    await send(writer, method, path, body, headers)
    return reader, writer


async def send(
    writer: asyncio.StreamWriter, method: str, path: str, body: object = None, headers: str = ""
) -> None:
    payload = b"" if body is None else json.dumps(body).encode()
    if path == "/control/fault" and "authorization:" not in headers.lower():
        headers = AUTH + headers
    writer.write(
        f"{method} {path} HTTP/1.1\r\nHost: sim\r\n{headers}"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    status_line, *lines = head.strip().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers


async def read_json(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], object]:
    status, headers = await read_head(reader)
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, json.loads(body)


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """One chunk of a chunked body; b"" for the terminal chunk."""
    size = int((await reader.readuntil(b"\r\n")).strip(), 16)
    return (await reader.readexactly(size + 2))[:-2]


async def read_chunks(reader: asyncio.StreamReader) -> list[bytes]:
    """Chunked body up to the terminal chunk; raises if the connection ends before it."""
    chunks = []
    while chunk := await read_chunk(reader):
        chunks.append(chunk)
    return chunks


def test_health_and_self_header() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        reader, writer = await request(sim, "GET", "/health")
        status, headers, body = await read_json(reader)
        assert status == 200
        assert body == {"status": "ok", "replica": "voice.local.n0.0"}
        assert headers["x-denv-replica-self"] == "voice.local.n0.0"
        writer.close()

    run_with_sim(scenario)


def test_stream_is_chunked_sse_ending_in_done_and_keeps_the_connection() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        reader, writer = await request(
            sim, "POST", "/v1/chat/completions", {"model": "voice", "stream": True, "max_tokens": 3}
        )
        status, headers = await read_head(reader)
        assert (status, headers["content-type"]) == (200, "text/event-stream")
        assert headers["transfer-encoding"] == "chunked"
        events = [chunk.decode() for chunk in await read_chunks(reader)]
        assert all(event.startswith("data: ") and event.endswith("\n\n") for event in events)
        assert events[-1] == "data: [DONE]\n\n"
        chunks = [json.loads(event[6:]) for event in events[:-1]]
        assert [c["choices"][0]["delta"].get("content") for c in chunks] == [
            "tok0 ", "tok1 ", "tok2 ", None,
        ]  # fmt: skip
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert {c["replica"] for c in chunks} == {"voice.local.n0.0"}

        await send(writer, "POST", "/v1/chat/completions", {"model": "voice", "max_tokens": 2})
        status, _, body = await read_json(reader)
        assert status == 200
        assert body["choices"][0]["message"]["content"] == "tok0 tok1 "  # type: ignore[index]
        writer.close()

    run_with_sim(scenario, ttft_ms=1, itl_ms=1)


@pytest.mark.timing
def test_stream_timing_follows_ttft_and_gap() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        started = time.monotonic()
        reader, writer = await request(
            sim, "POST", "/v1/chat/completions", {"stream": True, "max_tokens": 5}
        )
        await read_head(reader)
        first = await read_chunk(reader)
        first_token_s = time.monotonic() - started
        await read_chunks(reader)
        total_s = time.monotonic() - started
        assert b"tok0" in first
        assert 0.08 <= first_token_s < 0.2
        assert 0.08 + 4 * 0.02 <= total_s < 0.4
        writer.close()

    run_with_sim(scenario, ttft_ms=80, itl_ms=20)


def test_stats_count_requests_by_request_id_header_or_user() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        for headers, body in (
            ("X-Request-Id: turn-1\r\n", {"max_tokens": 1}),
            ("X-Request-Id: turn-1\r\n", {"max_tokens": 1}),
            ("", {"max_tokens": 1, "user": "caller-9"}),
        ):
            reader, writer = await request(sim, "POST", "/v1/chat/completions", body, headers)
            await read_json(reader)
            writer.close()
        reader, writer = await request(sim, "GET", "/stats")
        _, _, stats = await read_json(reader)
        assert stats == {
            "replica": "voice.local.n0.0",
            "fault": "none",
            "requests": 3,
            "health_checks": 0,
            "streams_completed": 0,
            "streams_aborted": 0,
            "streams_failed": 0,
            "requests_aborted": 0,
            "realtime_sessions": 0,
            "realtime_turns_completed": 0,
            "realtime_turns_aborted": 0,
            "realtime_subprotocols": "",  # what the last realtime upgrade offered: none yet
            "by_request_id": {"caller-9": 1, "turn-1": 2},
        }
        writer.close()

    run_with_sim(scenario, ttft_ms=0, itl_ms=0)


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/nowhere", None, 404),
        ("GET", "/v1/chat/completions", None, 405),
        ("POST", "/v1/chat/completions", "not an object", 400),
        ("POST", "/v1/chat/completions", {"max_tokens": "many"}, 400),
        ("POST", "/control/fault", {"mode": "explode"}, 400),
    ],
)
def test_bad_requests_get_json_errors(method: str, path: str, body: object, status: int) -> None:
    async def scenario(sim: ReplicaSim) -> None:
        reader, writer = await request(sim, method, path, body)
        got, headers, payload = await read_json(reader)
        assert got == status
        assert headers["content-type"] == "application/json" and "error" in payload  # type: ignore[operator]
        writer.close()

    run_with_sim(scenario)


def test_die_after_tokens_resets_mid_stream_without_terminal_chunk() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        reader, writer = await request(
            sim, "POST", "/control/fault", {"mode": "die_after_tokens", "k": 2}
        )
        assert (await read_json(reader))[2] == {"fault": "die_after_tokens", "k": 2}
        await send(writer, "POST", "/v1/chat/completions", {"stream": True, "max_tokens": 6})
        await read_head(reader)
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await read_chunks(reader)
        assert sim.stats.streams_aborted == 1 and sim.stats.streams_completed == 0
        writer.close()

    run_with_sim(scenario, ttft_ms=0, itl_ms=0)


def test_refuse_closes_the_port_until_fault_is_cleared() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        control_reader, control = await request(sim, "POST", "/control/fault", {"mode": "refuse"})
        await read_json(control_reader)
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", sim.port)
        # The connection that asked stays usable, so the fault can be cleared through it.
        await send(control, "POST", "/control/fault", {"mode": "none"})
        await read_json(control_reader)
        reader, writer = await request(sim, "GET", "/health")
        assert (await read_json(reader))[0] == 200
        writer.close()
        control.close()

    run_with_sim(scenario)


def test_refuse_also_drops_idle_keep_alive_connections() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        idle_reader, idle = await request(sim, "GET", "/health")
        await read_json(idle_reader)
        control_reader, control = await request(sim, "POST", "/control/fault", {"mode": "refuse"})
        await read_json(control_reader)
        assert await asyncio.wait_for(idle_reader.read(), 1) == b""
        idle.close()
        control.close()

    run_with_sim(scenario)


def test_hang_reads_requests_but_never_answers() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        reader, writer = await request(sim, "POST", "/control/fault", {"mode": "hang"})
        await read_json(reader)
        hung_reader, hung = await request(sim, "GET", "/health")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(hung_reader.read(1), 0.3)
        await send(writer, "GET", "/stats")
        assert (await read_json(reader))[2]["fault"] == "hang"  # type: ignore[index]
        hung.close()
        writer.close()

    run_with_sim(scenario)


def test_exit_ends_the_process_and_cli_prints_readiness() -> None:
    process = ReplicaProcess(ReplicaSimConfig("voice.local.n1.0", ttft_ms=0, itl_ms=0))
    process.spawn()
    try:
        port = process.wait_ready()
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["replica"] == "voice.local.n1.0"
        url = f"http://127.0.0.1:{port}/control/fault"
        # The token travels to the process (in its environment): without it, nothing happens.
        assert httpx.post(url, json={"mode": "exit"}).status_code == 401
        assert process.running
        headers = control_headers(process.config.control_token)
        httpx.post(url, json={"mode": "exit"}, headers=headers)
        deadline = time.monotonic() + 5
        while process.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not process.running
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        process.stop()


@pytest.mark.timing
def test_streams_thousands_of_tokens_per_second() -> None:
    streams, tokens = 20, 200

    async def one_stream(sim: ReplicaSim) -> int:
        reader, writer = await request(
            sim, "POST", "/v1/chat/completions", {"stream": True, "max_tokens": tokens}
        )
        await read_head(reader)
        received = len(await read_chunks(reader))
        writer.close()
        return received

    async def scenario(sim: ReplicaSim) -> None:
        started = time.monotonic()
        received = await asyncio.gather(*(one_stream(sim) for _ in range(streams)))
        rate = sum(received) / (time.monotonic() - started)
        assert received == [tokens + 2] * streams  # tokens, final chunk, [DONE]
        # Client and server share this one core here; the server alone is faster still.
        assert rate > 2000, f"{rate:.0f} tokens/s"

    run_with_sim(scenario, ttft_ms=0, itl_ms=0)


@pytest.mark.parametrize(
    "authorization",
    [
        "",
        "Authorization: Bearer wrong\r\n",
        "Authorization: Bearer \r\n",
        f"Authorization: Basic {TOKEN}\r\n",
        f"Authorization: Bearer {TOKEN}x\r\n",
        f"X-Authorization: Bearer {TOKEN}\r\n",
    ],
)
def test_the_fault_route_obeys_only_its_token(authorization: str) -> None:
    async def scenario(sim: ReplicaSim) -> None:
        for mode in ("exit", "refuse", "hang", "die_after_tokens"):
            reader, writer = await request(
                sim, "POST", "/control/fault", {"mode": mode}, authorization or "Authorization:\r\n"
            )
            status, _, payload = await read_json(reader)
            assert status == 401 and "control token" in payload["error"]["message"]  # type: ignore[index]
            writer.close()
        assert sim.fault.value == "none"
        reader, writer = await request(sim, "GET", "/health")
        assert (await read_json(reader))[0] == 200
        writer.close()

    run_with_sim(scenario)


def test_two_replicas_get_different_tokens() -> None:
    first, second = ReplicaSimConfig("a.s.n.0"), ReplicaSimConfig("b.s.n.0")
    assert len(first.control_token) == 32 and first.control_token != second.control_token
    assert first.control_token not in repr(first)


def test_a_realtime_message_fragmented_around_a_ping_is_answered_whole() -> None:
    """RFC 6455 5.4: a client may send a ping between the fragments of a message; the replica
    answers the ping and then the whole `response.create`."""

    async def scenario(sim: ReplicaSim) -> None:
        upgrade = (
            "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        )
        reader, writer = await request(sim, "GET", "/v1/realtime?model=voice", None, upgrade)
        status, headers = await read_head(reader)
        assert status == 101
        assert headers["sec-websocket-accept"] == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        client = WsProtocol(Side.CLIENT)
        received: list[Frame] = []

        async def until(done: Callable[[Frame], bool]) -> None:
            while not any(done(frame) for frame in received):
                data = await reader.read(65536)
                assert data, "the replica closed the session"
                client.receive_data(data)
                received.extend(e for e in client.events_received() if isinstance(e, Frame))

        def event(frame: Frame) -> str:
            return str(json.loads(frame.data)["type"]) if frame.opcode is Opcode.TEXT else ""

        await until(lambda frame: event(frame) == "session.created")
        client.send_text(b'{"type":"response', fin=False)
        client.send_ping(b"mid-message")
        client.send_continuation(b'.create"}', fin=True)
        for chunk in client.data_to_send():
            writer.write(chunk)
            await writer.drain()
        async with asyncio.timeout(3):
            await until(lambda frame: event(frame) == "response.done")
        pongs = [frame.data for frame in received if frame.opcode is Opcode.PONG]
        assert pongs == [b"mid-message"]
        kinds = [event(frame) for frame in received if frame.opcode is Opcode.TEXT]
        assert kinds.count("response.output_audio.delta") == 3
        assert sim.stats.realtime_turns_completed == 1
        writer.close()

    run_with_sim(scenario, ttft_ms=1, itl_ms=1, tokens=3)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("GET", "/v1/embeddings", None, 404, None),
        ("GET", "/v1/chat/completions", None, 405, None),
        ("POST", "/v1/chat/completions", [1, 2], 400, None),
        ("POST", "/v1/audio/speech", {"input": ""}, 400, None),
        (
            "POST",
            "/v1/audio/speech",
            {"input": "hi", "response_format": "mp3"},
            400,
            "response_format",
        ),
        ("POST", "/v1/audio/transcriptions", {"not": "a form"}, 400, None),
        ("GET", "/v1/realtime", None, 400, None),
        ("POST", "/control/fault", {"mode": "unknown"}, 400, "mode"),
    ],
)
def test_every_error_is_in_openai_s_shape(
    method: str, path: str, body: object, status: int, param: str | None
) -> None:
    async def scenario(sim: ReplicaSim) -> None:
        reader, writer = await request(sim, method, path, body)
        answered, _, payload = await read_json(reader)
        writer.close()
        assert answered == status
        assert isinstance(payload, dict) and set(payload) == {"error"}
        error = payload["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["type"] == "invalid_request_error" and error["param"] == param

    run_with_sim(scenario)
