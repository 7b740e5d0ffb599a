"""Busy is not broken: a zombie engine is out of rotation within 2 s, a full one never.

A real local stack (simulated replicas with slots, their agents reading the engine's metrics,
HAProxy) with the stack's defaults: stall budget 1000 ms, metrics read every 250 ms.
"""

import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from denv_iac.haproxy.runtime import server_stats
from denv_iac.local.runner import LocalCluster, RunState
from denv_iac.ops.demo import replica_fault
from denv_iac.spec.reader import read_stack
from tests.stacks import local_site
from tests.timing import assert_within

if shutil.which("haproxy") is None:
    pytest.skip("HAProxy is not installed (make setup installs it)", allow_module_level=True)

# The done-when goal: out of rotation within 2 s of the first stalled request.
ZOMBIE_OUT_S = 2.0
CONFIG = {
    "denv:sites": [local_site("local", nodes=2, gpus=1)],
    "denv:recipes": [
        {
            "name": "voice",
            "min_warm": 1,
            "spare": 1,
            "sites": ["local"],
            "max_concurrency": 4,
            # Two slots: the balancer's four requests leave two queued in the engine; each
            # stream (16 tokens, 30 ms apart) ends well inside the first-token budget.
            "simulate": {"ttft_ms": 20, "itl_ms": 30, "tokens": 16, "slots": 2},
        }
    ],
    "denv:balancer": {"sites": ["local"]},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunState]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    cluster = LocalCluster(read_stack("t", CONFIG), tmp_path_factory.mktemp("run"), port)
    state = cluster.up()
    try:
        yield state
    finally:
        cluster.down()


def _row(state: RunState, replica_id: str) -> dict[str, str]:
    return server_stats(Path(state.admin_socket))[replica_id]


def _wait(what: str, check: Callable[[], bool], within_s: float) -> float:
    """Seconds until `check` holds, polled every 20 ms; fails past `within_s`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within_s, f"{what} not within {within_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


def _agent_reply(state: RunState, replica_id: str) -> str:
    replica = next(r for r in state.replicas if r.id == replica_id)
    with socket.create_connection(("127.0.0.1", replica.agent_port), timeout=2) as sock:
        sock.sendall(f"{replica_id}\n".encode())
        return sock.recv(4096).decode().strip()


class Load:
    """`streams` client loops of streamed chat through the endpoint until stopped."""

    def __init__(self, state: RunState, streams: int) -> None:
        self.url = f"{state.endpoint}/v1/chat/completions"
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(streams)]

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)

    def _loop(self) -> None:
        body = {"model": "voice", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set():
                try:
                    with client.stream("POST", self.url, json=body) as response:
                        for _ in response.iter_bytes():
                            pass
                except httpx.HTTPError:
                    pass  # a cut turn: what this test bounds is how long the replica stays in


def _all_up(state: RunState) -> bool:
    rows = server_stats(Path(state.admin_socket))
    return all(rows[r.id]["status"] == "UP" for r in state.replicas)


@pytest.mark.timing
def test_a_zombie_is_out_of_rotation_within_2_s_and_back_once_it_makes_tokens(
    stack: RunState,
) -> None:
    _wait("every replica up", lambda: _all_up(stack), 20)
    zombie = stack.replicas[0].id
    with Load(stack, streams=2):
        # The clock starts with a stream running on it: the first stalled request is at once.
        _wait("a stream on the replica", lambda: int(_row(stack, zombie)["scur"] or 0) > 0, 5)
        replica_fault(stack, zombie, "zombie")
        out_s = _wait(
            "the zombie marked down",
            lambda: _row(stack, zombie)["status"].startswith("DOWN"),
            ZOMBIE_OUT_S + 3,
        )
        assert_within(out_s, ZOMBIE_OUT_S, "zombie replica out of rotation")
        assert _agent_reply(stack, zombie).startswith("down #engine stalled")
        # Its healthy peer is never touched.
        assert _row(stack, stack.replicas[1].id)["status"] == "UP"
        replica_fault(stack, zombie, "none")
        # Back once the agent's own request shows a token: a metrics poll, that request, an
        # agent check.
        _wait("the replica back up", lambda: _row(stack, zombie)["status"] == "UP", 5)
    assert _agent_reply(stack, zombie).startswith("up ready")


@pytest.mark.timing
def test_a_full_replica_is_never_marked_down_and_its_queue_lowers_its_weight(
    stack: RunState,
) -> None:
    _wait("every replica up", lambda: _all_up(stack), 20)
    replies: set[str] = set()
    states: set[str] = set()
    # Eight streams over two replicas of two slots each: every slot busy, a queue behind them.
    with Load(stack, streams=8):
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            for replica in stack.replicas:
                replies.add(_agent_reply(stack, replica.id))
                states.add(_row(stack, replica.id)["status"])
            time.sleep(0.05)
    assert states == {"UP"}, states
    assert all(reply.startswith("up ready") for reply in replies), replies
    assert any(reply != "up ready 100%" for reply in replies), replies
