"""What the zombie and full-replica tests share: a stream of chat through an endpoint, waits
polled against HAProxy's stats, and the agent's own reply to an agent check (the sampler that
reads the pool while load runs is benchmarks.lab.sampling, which the reliability benchmarks use
too)."""

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks.lab.sampling import sampling
from benchmarks.lab.waiting import eventually
from denv_iac.haproxy.runtime import server_stats


def wait_for(what: str, check: Callable[[], bool], within_s: float) -> float:
    """Seconds until `check` holds, polled every 20 ms (what these tests time is that fine);
    fails past `within_s`."""
    return eventually(check, within_s, what, interval_s=0.02)


def server_row(admin_socket: Path, replica_id: str) -> dict[str, str]:
    return server_stats(admin_socket)[replica_id]


def all_up(admin_socket: Path, replica_ids: list[str]) -> bool:
    rows = server_stats(admin_socket)
    return all(rows[replica_id]["status"] == "UP" for replica_id in replica_ids)


def agent_reply(address: str, port: int, replica_id: str) -> str:
    """What the agent answers HAProxy's agent check for `replica_id`."""
    with socket.create_connection((address, port), timeout=2) as sock:
        sock.sendall(f"{replica_id}\n".encode())
        return sock.recv(4096).decode().strip()


@contextmanager
def streaming(endpoint: str, streams: int, model: str = "voice") -> Iterator[None]:
    """`streams` client loops of streamed chat to `endpoint` while the block runs."""
    stop = threading.Event()
    url = f"{endpoint}/v1/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}

    def loop() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                try:
                    with client.stream("POST", url, json=body) as response:
                        for _ in response.iter_bytes():
                            pass
                except httpx.HTTPError:
                    pass  # a cut turn: what these tests bound is how long the replica stays in

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)


def watch_full(
    endpoint: str, replica_ids: list[str], reply: Callable[[str], str], status: Callable[[str], str]
) -> tuple[set[str], set[str]]:
    """The agent's replies and HAProxy's states seen over 4 s of eight streams over two replicas
    of two slots each: every slot busy, a queue behind them."""

    def take() -> list[tuple[str, str]]:
        return [(reply(replica_id), status(replica_id)) for replica_id in replica_ids]

    with streaming(endpoint, streams=8), sampling(take, 0.05) as samples:
        time.sleep(4.0)
    pairs = [pair for sample in samples for pair in sample]
    return {reply for reply, _ in pairs}, {state for _, state in pairs}
