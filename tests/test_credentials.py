"""No `denv` command sends a credential to a host it was not meant for.

Every outgoing request of the commands that talk HTTP is recorded by listeners on 127.0.0.1: the
endpoint's API key goes to the endpoint alone; a replica called directly (`denv bench --direct`)
and a balancer's stats page (`denv status --endpoint`) get no credential at all.
"""

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from click.testing import CliRunner

from denv_iac.cli import main
from denv_iac.ops.loadgen import PROTOCOLS

KEY = "sk-endpoint-only-4f1c"
REFUSAL = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
CREDENTIAL_HEADERS = ("authorization", "proxy-authorization", "cookie", "x-api-key", "api-key")


@dataclass
class Recorder:
    """A listener that keeps the head of every request it gets and answers 503."""

    heads: list[bytes] = field(default_factory=list)
    sock: socket.socket = field(default_factory=socket.socket)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def serve(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            with connection:
                connection.settimeout(5)
                head = b""
                try:
                    while b"\r\n\r\n" not in head and (chunk := connection.recv(65536)):
                        head += chunk
                    connection.sendall(REFUSAL)
                except OSError:
                    pass
                self.heads.append(head)

    def headers(self) -> list[dict[str, str]]:
        """Each request's headers, names lowercased."""
        requests = []
        for head in self.heads:
            lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
            pairs = (line.partition(":") for line in lines if line)
            requests.append({name.strip().lower(): value.strip() for name, _, value in pairs})
        return requests


@pytest.fixture
def recorders() -> Iterator[tuple[Recorder, Recorder]]:
    pair = (Recorder(), Recorder())
    threads = []
    for recorder in pair:
        recorder.sock.bind(("127.0.0.1", 0))
        recorder.sock.listen(64)
        threads.append(threading.Thread(target=recorder.serve, daemon=True))
        threads[-1].start()
    yield pair
    for recorder, thread in zip(pair, threads, strict=True):
        recorder.sock.close()
        thread.join(timeout=5)


def denv(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), env={"DENV_API_KEY": KEY})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.output


def assert_no_credential(recorder: Recorder) -> None:
    assert recorder.heads, "the command sent nothing to this listener"
    for head, headers in zip(recorder.heads, recorder.headers(), strict=True):
        assert KEY.encode() not in head
        assert not set(CREDENTIAL_HEADERS) & set(headers), headers


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bench_sends_the_key_to_the_endpoint_alone(
    protocol: str, recorders: tuple[Recorder, Recorder]
) -> None:
    endpoint, replica = recorders
    denv("bench", endpoint.url, "--pool", "voice", "--protocol", protocol, "--requests", "4",
         "--concurrency", "1", "--quiet", "--direct", replica.url)  # fmt: skip
    assert endpoint.heads and all(
        h.get("authorization") == f"Bearer {KEY}" for h in endpoint.headers()
    )
    assert_no_credential(replica)


def test_status_sends_no_credential_to_a_stats_page(
    recorders: tuple[Recorder, Recorder],
) -> None:
    balancer, _ = recorders
    denv("status", "--endpoint", balancer.url)
    assert_no_credential(balancer)
