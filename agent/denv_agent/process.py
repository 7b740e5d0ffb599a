"""Start `denv-agent` as a child process and learn its ports: for the local runner, tests, tools."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TextIO

# Logged once both ports are bound; with port 0 in the config it is how a parent learns them.
READY = "ready: node {node}, agent-check {check[0]}:{check[1]}, http {http[0]}:{http[1]}"
_READY_RE = re.compile(r"ready: node (\S+), agent-check (\S+):(\d+), http (\S+):(\d+)")


def announce_ready(
    stream: TextIO, node: str, check: tuple[str, int], http: tuple[str, int]
) -> None:
    """Write the ready line in one piece. `print` writes the text and its newline separately, so
    a log line from another thread (the NVML thread's first reading) could land between them and
    run the HTTP port into its date: `http 127.0.0.1:35921` + `2026-...` parsed as port 359212026.
    """
    stream.write(f"denv-agent {READY.format(node=node, check=check, http=http)}\n")
    stream.flush()


def parse_ready(line: str) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """The (agent-check, http) addresses in the agent's ready line; None for any other line."""
    match = _READY_RE.search(line)
    if match is None:
        return None
    return (match[2], int(match[3])), (match[4], int(match[5]))


class AgentProcess:
    """`python -m denv_agent --config FILE [--simulate]`, its log kept in `lines`."""

    def __init__(
        self,
        config: Path,
        *,
        simulate: bool = False,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 20.0,
    ) -> None:
        args = [sys.executable, "-m", "denv_agent", "--config", str(config), *extra_args]
        if simulate:
            args.append("--simulate")
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.agent_check: tuple[str, int] = ("", 0)
        self.http: tuple[str, int] = ("", 0)
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else dict(env),
        )
        # Keep reading the log: a full pipe would block the agent.
        self._reader = threading.Thread(target=self._read_log, name="agent-log", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + ready_timeout_s
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = "".join(self.lines[-20:]).strip() or "(no output)"
                raise RuntimeError(f"denv-agent did not start (exit {self.proc.returncode}): {log}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def http_url(self) -> str:
        host, port = self.http
        return f"http://{host}:{port}"

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            addresses = None if self._ready.is_set() else parse_ready(line)
            if addresses is not None:
                self.agent_check, self.http = addresses
                self._ready.set()

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout_s)
        return self.proc.returncode

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
