"""A recipe's own model server as a local replica: the program its `command` names.

The runner starts it as the simulated replica is started (on the site's host, logged to the
replica's log, restarted when it dies, stopped by `denv local down`), in a process group of its
own so that whatever the server starts goes with it. The runner picks its port and puts it, and
the site's address, in place of the command's `{port}` and `{host}` (denv_iac.core.stack.command);
`$PORT` holds the port too, as on nodes. It is ready once its health path answers 200 (a server
loading its model answers 503 until then) and, for an engine the agent knows, once its metrics
read, so the agent can weigh its queue from its first request on.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from denv_iac.child_process import ChildProcess
from denv_iac.core.stack.command import render_command
from denv_iac.waits import wait_until

# How often readiness is asked while a server loads.
READY_POLL_S = 0.1
# A server told to stop (SIGTERM) that still runs after this is killed with its process group.
STOP_GRACE_S = 5.0
# Set in the server's environment: what finds it again (see `mark`).
REPLICA_ENV = "DENV_REPLICA"
# The log lines quoted in a one-line error about a server that exited at start.
LOG_TAIL_CHARS = 300


@dataclass(frozen=True)
class CommandConfig:
    replica_id: str
    recipe: str
    command: tuple[str, ...]  # the recipe's command, placeholders not yet replaced
    host: str
    port: int  # picked by the runner: a free port of the site's host
    health_path: str
    # A path whose answer must name one of these metrics before the replica counts as ready;
    # empty: the metrics are not waited for.
    metrics_path: str = "/metrics"
    metrics_names: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # may hold tokens
    ready_timeout_s: float = 120.0
    # Where it runs, so relative paths in the command mean the same on every run: the project's
    # folder (the one holding stacks/); None: this process's own.
    workdir: str | None = None

    @property
    def argv(self) -> tuple[str, ...]:
        return render_command(self.command, port=self.port, host=self.host)

    @property
    def mark(self) -> str:
        """What the server's environment holds while it runs, whatever it execs into (a
        wrapper script, an interpreter): a recycled pid is never signalled."""
        return f"{REPLICA_ENV}={self.replica_id}"


class CommandStartError(RuntimeError):
    """A recipe's command that did not start or never became ready: one line, naming both."""


class CommandReplica(ChildProcess):
    """The recipe's server in its own process group; the same calls as ReplicaProcess."""

    def __init__(
        self,
        config: CommandConfig,
        log_path: Path | None = None,
        command_prefix: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self.log_path = log_path
        self.command_prefix = command_prefix
        self.port = config.port

    def spawn(self) -> None:
        config = self.config
        env = {**os.environ, **dict(config.env), "PORT": str(config.port)}
        env[REPLICA_ENV] = config.replica_id
        log = self.log_path.open("ab") if self.log_path is not None else None
        try:
            self._process = subprocess.Popen(
                [*self.command_prefix, *config.argv],
                env=env,
                cwd=config.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log if log is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped with all it started
            )
        except OSError as error:
            raise CommandStartError(
                f"recipe {config.recipe}: command {config.command[0]!r} cannot start "
                f"({error.strerror or error}); install it or give its full path in `command`"
            ) from None
        finally:
            if log is not None:
                log.close()

    def wait_ready(self, timeout_s: float | None = None) -> int:
        config = self.config
        process = self._process
        if process is None:
            raise RuntimeError("spawn() the replica first")
        timeout = config.ready_timeout_s if timeout_s is None else timeout_s

        def probe() -> str:
            if process.poll() is not None:
                raise CommandStartError(
                    f"recipe {config.recipe}: replica {config.replica_id}: {config.command[0]!r}"
                    f" exited with status {process.returncode} before its health path answered"
                    f"{self._log_tail()}"
                )
            return self._readiness()

        def timed_out(last: str) -> Exception:
            self.stop()
            return CommandStartError(
                f"recipe {config.recipe}: replica {config.replica_id} not ready within "
                f"{timeout:.0f} s ({last}); raise cold_start_budget_s or see {self.log_path}"
            )

        try:
            wait_until(
                probe,
                lambda answer: answer == "",
                timeout_s=timeout,
                interval_s=READY_POLL_S,
                timed_out=timed_out,
            )
        except CommandStartError:
            self.stop()
            raise
        return self.port

    def _readiness(self) -> str:
        """'' when ready, else what is still missing."""
        config = self.config
        status, _ = _get(config.host, config.port, config.health_path)
        if status != 200:
            return f"{config.health_path} answered {status}" if status else "not listening yet"
        if not config.metrics_names:
            return ""
        status, body = _get(config.host, config.port, config.metrics_path)
        if status == 200 and any(name in body for name in config.metrics_names):
            return ""
        return f"{config.metrics_path} answered {status or 'nothing'} without its engine metrics"

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_bytes()[-4096:].decode(errors="replace").strip()
        last = text.splitlines()[-1] if text else ""
        return f": {last[-LOG_TAIL_CHARS:]}" if last else ""

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL past STOP_GRACE_S."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_GRACE_S)
        # What the server started may outlive it: the group goes either way.
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def _get(host: str, port: int, path: str) -> tuple[int, str]:
    """(status, body) of a GET; (0, '') when nothing answers."""
    connection = http.client.HTTPConnection(host, port, timeout=2.0)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return 0, ""
    finally:
        connection.close()
