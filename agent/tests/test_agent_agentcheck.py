from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from denv_agent.agentcheck import MALFORMED, UNKNOWN, UNNAMED, AgentCheckServer, answer

from agent.tests.agent_testkit import ask

REPLIES = {"voice.local.node-a.0": b"up ready 100%\n", "voice.local.node-a.1": b"down #gpu lost\n"}


@pytest.mark.parametrize(
    ("request_bytes", "reply"),
    [
        (b"voice.local.node-a.0\n", b"up ready 100%\n"),
        (b"voice.local.node-a.1", b"down #gpu lost\n"),
        (b"voice.local.node-a.1\r\n", b"down #gpu lost\n"),
        (b"  voice.local.node-a.0  \nextra", b"up ready 100%\n"),
        (b"voice.local.node-a.9\n", UNKNOWN),
        (b"", UNNAMED),
        (b"\n", UNNAMED),
        (b"x" * 257, MALFORMED),
        (b"x" * 300 + b"\n", MALFORMED),
        (b"\xff\xfe\n", MALFORMED),
        (b"voice\x00.local\n", MALFORMED),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", UNKNOWN),
    ],
)
def test_answer_to_any_request(request_bytes: bytes, reply: bytes) -> None:
    assert answer(request_bytes, REPLIES) == reply


def test_single_replica_node_answers_without_agent_send() -> None:
    assert answer(b"", {"only": b"drain #operator\n"}) == b"drain #operator\n"


@pytest.fixture
def server() -> Iterator[AgentCheckServer]:
    server = AgentCheckServer(("127.0.0.1", 0), lambda: REPLIES, read_timeout_s=0.2)
    server.start()
    yield server
    server.stop()


@pytest.mark.timing
def test_known_id_is_answered_at_once_even_without_newline(server: AgentCheckServer) -> None:
    with socket.create_connection(server.address, timeout=5) as s:
        started = time.monotonic()
        s.sendall(b"voice.local.node-a.0")
        assert s.recv(100) == b"up ready 100%\n"
        assert time.monotonic() - started < 0.1
        assert s.recv(100) == b""  # and closed


@pytest.mark.parametrize(
    ("payload", "half_close", "reply"),
    [
        (b"voice.local.node-a.1\n", False, b"down #gpu lost\n"),
        (b"voice.local.node-a.1", True, b"down #gpu lost\n"),
        (b"nobody", False, UNKNOWN),
        (b"", False, UNNAMED),
        (b"y" * 5000, False, MALFORMED),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", False, MALFORMED),
    ],
)
def test_server_replies_one_line_and_closes(
    server: AgentCheckServer, payload: bytes, half_close: bool, reply: bytes
) -> None:
    assert ask(server.address, payload, half_close=half_close) == reply


def test_clients_that_vanish_do_not_hurt_the_server(server: AgentCheckServer) -> None:
    for _ in range(20):
        with socket.create_connection(server.address) as s:
            s.sendall(b"voice.local")
    silent = [socket.create_connection(server.address) for _ in range(50)]
    try:
        assert ask(server.address, b"voice.local.node-a.0\n") == b"up ready 100%\n"
    finally:
        for s in silent:
            s.close()


def test_many_concurrent_checks_all_get_their_reply(server: AgentCheckServer) -> None:
    results: list[bytes] = []

    def check() -> None:
        results.append(ask(server.address, b"voice.local.node-a.1\n"))

    threads = [threading.Thread(target=check) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert results == [b"down #gpu lost\n"] * 32
