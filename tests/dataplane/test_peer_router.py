"""The peer router of the overload benchmark routes streamed chat to the simulated replicas."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.lab.dataplane import FAST_REPLICA, stream_chat
from benchmarks.lab.peer_router import PeerRouter
from denv_iac.local.replica_sim import ReplicaProcess


@pytest.fixture
def replicas() -> Iterator[list[ReplicaProcess]]:
    processes = [
        ReplicaProcess(dataclasses.replace(FAST_REPLICA, replica_id=f"voice.peer.n{n}.0"))
        for n in range(2)
    ]
    try:
        for process in processes:
            process.spawn()
        for process in processes:
            process.wait_ready()
        yield processes
    finally:
        for process in processes:
            process.stop()


def _received(process: ReplicaProcess, request_id: str) -> int:
    stats = httpx.get(f"http://127.0.0.1:{process.port}/stats", timeout=2).json()
    return int(stats["by_request_id"].get(request_id, 0))


def test_streamed_chat_through_vllm_router_reaches_a_replica(
    replicas: list[ReplicaProcess], tmp_path: Path
) -> None:
    router = PeerRouter([f"http://127.0.0.1:{p.port}" for p in replicas], tmp_path).start()
    body = {"model": "voice", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with httpx.Client(base_url=router.url, timeout=5) as client:
            outcomes = [stream_chat(client, body, {"X-Request-Id": f"peer-{n}"}) for n in range(4)]
    finally:
        router.close()
    for n, outcome in enumerate(outcomes):
        assert (outcome.status, outcome.done, outcome.error) == (200, True, None), outcome
        tokens = [chunk["choices"][0]["delta"].get("content") for chunk in outcome.chunks]
        assert tokens[:3] == ["tok0 ", "tok1 ", "tok2 "], tokens
        # Sent once, to one replica: the router neither dropped nor replayed it.
        assert sorted(_received(process, f"peer-{n}") for process in replicas) == [0, 1]
