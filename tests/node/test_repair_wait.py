"""The repair's wait for in-flight streams, run by the shell against this machine's own `ss` and
real connections on a replica's port: it ends when the last one closes, or at its bound by the
clock, naming who still held connections."""

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


class LocalShell:
    def run(self, command: str) -> tuple[bool, str]:
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
        return done.returncode == 0, (done.stdout + done.stderr).strip()


@contextmanager
def replica_with_a_stream(open_s: float | None) -> Iterator[int]:
    """A replica port on 127.0.0.1 with one established connection, closed after `open_s`
    seconds (None: left open); yields the port."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    timer = None
    if open_s is not None:
        timer = threading.Timer(open_s, lambda: (client.close(), accepted.close()))
        timer.start()
    try:
        yield port
    finally:
        if timer is not None:
            timer.cancel()
        for sock in (client, accepted, server):
            sock.close()


def wait(port: int, timeout_s: int) -> tuple[str, float]:
    spec = NodeDeploySpec(
        node_id="n1",
        replicas=(ReplicaSpec("voice.n1.0", "ghcr.io/acme/voice:1.4", port, 0),),
        drain_timeout_s=timeout_s,
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
