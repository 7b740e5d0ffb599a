"""A deploy of a machine just created waits, bounded, for its SSH port to answer.

Real sockets on 127.0.0.1 only: a port whose SSH server (paramiko's) starts listening after a
delay, one where nothing ever listens, and one where something answers but speaks no SSH.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import paramiko
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from denv_iac.local.processes import free_port
from denv_iac.node import deploy
from denv_iac.node.deploy import CannotConnect, Target, connect

START_AFTER_S = 1.5  # the SSH server's delay after the test starts connecting


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(deploy, "SSH_POLL_S", 0.2)
    # pyinfra records a new machine's host key in ~/.ssh/known_hosts: the test's own home.
    monkeypatch.setenv("HOME", str(tmp_path))


def _key_file(tmp_path: Path) -> Path:
    pem = Ed25519PrivateKey.generate().private_bytes(
        Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption()
    )
    path = tmp_path / "id_ed25519"
    path.write_bytes(pem)
    path.chmod(0o600)
    return path


class _AnyKey(paramiko.ServerInterface):
    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL


@pytest.fixture
def late_sshd() -> Iterator[tuple[int, list[float]]]:
    """An SSH server on a port that listens only START_AFTER_S from now; (port, the times it
    took connections at, from now)."""
    port, started, taken = free_port(), time.monotonic(), []
    host_key = paramiko.RSAKey.generate(2048)
    transports: list[paramiko.Transport] = []
    stop = threading.Event()

    def serve() -> None:
        time.sleep(START_AFTER_S)
        with socket.create_server(("127.0.0.1", port), reuse_port=False) as listener:
            listener.settimeout(0.2)
            while not stop.is_set():
                try:
                    connection, _ = listener.accept()
                except TimeoutError:
                    continue
                taken.append(time.monotonic() - started)
                transport = paramiko.Transport(connection)
                transport.add_server_key(host_key)
                transport.start_server(server=_AnyKey())
                transports.append(transport)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port, taken
    stop.set()
    thread.join(5)
    for transport in transports:
        transport.close()


def test_a_deploy_connects_once_the_machines_sshd_starts_listening(
    late_sshd: tuple[int, list[float]], tmp_path: Path
) -> None:
    port, taken = late_sshd
    target = Target(f"127.0.0.1:{port}", user="root", key=_key_file(tmp_path))
    with connect(target, ssh_wait_s=30) as session:
        assert session.host.connected
    # Refused until the server listened; the first connection it took got in.
    assert len(taken) == 1 and taken[0] >= START_AFTER_S


def test_a_port_that_never_answers_fails_after_the_wait_in_one_line_naming_it() -> None:
    port = free_port()
    started = time.monotonic()
    waiting = connect(Target(f"127.0.0.1:{port}"), ssh_wait_s=1)
    with pytest.raises(CannotConnect) as raised, waiting:
        pass
    assert time.monotonic() - started >= 1
    message = str(raised.value)
    assert message.startswith(f"cannot connect to 127.0.0.1:{port}: ")
    assert message.endswith(", after waiting 1 s for its SSH port to answer")
    assert "\n" not in message and not raised.value.answered


def test_something_that_answers_but_speaks_no_ssh_fails_at_once_whatever_the_wait() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def hang_up() -> None:
            with suppress(OSError):
                while True:
                    connection, _ = server.accept()
                    connection.close()

        threading.Thread(target=hang_up, daemon=True).start()
        started = time.monotonic()
        waiting = connect(Target(f"127.0.0.1:{port}"), ssh_wait_s=60)
        with pytest.raises(CannotConnect) as raised, waiting:
            pass
    assert time.monotonic() - started < 30
    assert raised.value.answered and "waiting" not in str(raised.value)
