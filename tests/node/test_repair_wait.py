"""The repair's wait for in-flight streams, run by the shell against this machine's own `ss` and
real connections on a replica's port: it ends when the last one closes, or at its bound by the
clock, naming who still held connections; a connection quiet for `quiet_s` (a balancer's idle
connection kept for reuse) does not hold it, one that moves bytes does."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from denv_iac.node.repair import RepairLevel, _Repair
from denv_iac.node.spec import NodeDeploySpec, ReplicaSpec
from tests.node.test_holders import working
from tests.timing import assert_within


class LocalShell:
    def run(self, command: str) -> tuple[bool, str]:
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
        return done.returncode == 0, (done.stdout + done.stderr).strip()


@contextmanager
def replica_with_a_stream(open_s: float | None, chunk_every_s: float = 0.0) -> Iterator[int]:
    """A replica port on 127.0.0.1 with one established connection, closed after `open_s`
    seconds (None: left open), on which the replica sends a chunk every `chunk_every_s` (0:
    nothing, an idle connection); yields the port."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    closed = threading.Event()

    def close() -> None:
        closed.set()
        client.close()
        accepted.close()

    def stream() -> None:
        while not closed.wait(chunk_every_s):
            accepted.sendall(b"data: {}\n\n")
            client.recv(4096)

    timer = None
    if open_s is not None:
        timer = threading.Timer(open_s, close)
        timer.start()
    streamer = threading.Thread(target=stream, daemon=True)
    if chunk_every_s:
        streamer.start()
    try:
        yield port
    finally:
        if timer is not None:
            timer.cancel()
        closed.set()
        if streamer.is_alive():
            streamer.join(timeout=5)
        for sock in (client, accepted, server):
            sock.close()


def wait(port: int, timeout_s: int, quiet_s: int = NodeDeploySpec.quiet_s) -> tuple[str, float]:
    spec = NodeDeploySpec(
        node_id="n1",
        replicas=(ReplicaSpec("voice.n1.0", "ghcr.io/acme/voice:1.4", port, 0),),
        drain_timeout_s=timeout_s,
        quiet_s=quiet_s,
    )
    start = time.monotonic()
    text = _Repair(spec, RepairLevel.RESET).wait_streams(LocalShell(), working())  # type: ignore[arg-type]
    return text, time.monotonic() - start


@pytest.mark.parametrize("open_s", [0.0, 1.5])
def test_the_wait_ends_when_the_last_stream_closes(open_s: float) -> None:
    with replica_with_a_stream(open_s) as port:
        text, took = wait(port, 30)
    assert text == "no streams open"
    assert took < 10, took


@pytest.mark.timing
def test_past_its_bound_the_wait_names_who_holds_connections() -> None:
    with replica_with_a_stream(None) as port:
        # Start at the very end of a second of the wall clock: the shell's clock counts whole
        # seconds, and a bound read from it must not end the wait up to a second early.
        time.sleep((0.99 - time.time() % 1) % 1)
        text, took = wait(port, 2)
    assert text == "1 connections still open after 2 s (from 127.0.0.1 x1): cut"
    assert 2 <= took < 10, took


@pytest.mark.timing
def test_an_idle_connection_kept_for_reuse_does_not_hold_the_wait() -> None:
    # HAProxy keeps one idle connection to a drained server, open for minutes: it carries no
    # stream, and the wait ends once it has been quiet for quiet_s, long before the bound.
    with replica_with_a_stream(None) as port:
        text, took = wait(port, 60, quiet_s=2)
    assert text == (
        "no streams open; 1 idle connection(s), quiet for 2 s or more, left to close with it"
    )
    assert_within(took, 10, "the wait with one idle connection (quiet_s 2 s, bound 60 s)")


@pytest.mark.timing
def test_a_connection_moving_bytes_holds_the_wait_until_it_closes() -> None:
    # A stream sends a chunk every 0.3 s for 5 s, longer than quiet_s: it is waited for.
    with replica_with_a_stream(5.0, chunk_every_s=0.3) as port:
        text, took = wait(port, 60, quiet_s=2)
    assert text == "no streams open"
    assert took >= 4.5, took
    assert_within(took, 15, "the wait for a 5 s stream")
