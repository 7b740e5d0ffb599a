"""Run a written config with the installed HAProxy and read its state from the stats socket.

The local runner, the data-plane tests and the benchmarks start HAProxy this way: master-worker
(`-W`, so a reload keeps established streams), in the foreground, in its own process group so
that stopping it stops its workers too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

from denv_iac.child_process import ChildProcess
from denv_iac.core.balancer.stats import parse_stats_csv, parse_stats_rows
from denv_iac.waits import wait_until


class HaproxyStartError(RuntimeError):
    """HAProxy exited or never opened its stats socket; the message holds its log tail."""


class HaproxyProcess(ChildProcess):
    """One HAProxy master process (and its workers) serving one config file."""

    def __init__(
        self,
        config_path: Path,
        stats_socket: Path,
        log_path: Path,
        haproxy_bin: str = "haproxy",
        command_prefix: tuple[str, ...] = (),
    ) -> None:
        self.config_path = config_path
        self.stats_socket = stats_socket
        self.log_path = log_path
        self.haproxy_bin = haproxy_bin
        self.command_prefix = command_prefix  # e.g. `ip netns exec NAME`: where it runs
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start and wait until the worker answers on the stats socket."""
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [*self.command_prefix, self.haproxy_bin, "-W", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = self._process

        def answers() -> bool:
            if process.poll() is not None:
                raise HaproxyStartError(f"haproxy exited at start:\n{self._log_tail()}")
            try:
                stats_command(self.stats_socket, "show info")
            except OSError:
                return False
            return True

        def no_socket(_: bool) -> HaproxyStartError:
            self.stop()
            return HaproxyStartError(
                f"haproxy gave no stats socket in {timeout_s} s:\n{self._log_tail()}"
            )

        wait_until(answers, bool, timeout_s=timeout_s, interval_s=0.02, timed_out=no_socket)

    def reload(self) -> None:
        """Load the config file again; old workers finish their streams, then exit."""
        if self._process is not None and self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGUSR2)  # the master alone re-reads the config

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop master and workers: SIGTERM to the process group, SIGKILL when it lingers."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            process.wait(timeout_s)

    def _signal_group(self, signum: signal.Signals) -> None:
        if self._process is not None and self._process.poll() is None:
            # The group id is the master's pid: start_new_session made it a group leader.
            os.killpg(self._process.pid, signum)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def stats_command(socket_path: Path, command: str, timeout_s: float = 2.0) -> str:
    """Send one runtime API command on the stats socket and return HAProxy's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(socket_path))
        sock.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def server_stats(socket_path: Path) -> dict[str, dict[str, str]]:
    """`show stat` rows of every server, by server name (replica id)."""
    return parse_stats_csv(stats_command(socket_path, "show stat"))


def stats_rows(socket_path: Path) -> list[dict[str, str]]:
    """Every `show stat` row: frontends, backends and servers."""
    return parse_stats_rows(stats_command(socket_path, "show stat"))
