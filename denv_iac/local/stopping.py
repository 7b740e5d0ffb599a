"""One `denv local up` per stack (StackLock, held by the run that supervises it), and `denv
local down`: stopping what a run's state file records, through its supervisor when one holds
the lock, and only processes that are still ours."""

import fcntl
import os
import shutil
import signal
from pathlib import Path

from denv_iac.core.stack.reader import StackError
from denv_iac.local.processes import AGENT_MARK, HAPROXY_MARK, REPLICA_MARK, ours
from denv_iac.local.run_state import STATE_FILE, RunState, read_state
from denv_iac.waits import wait_until, wait_until_or_last


class StackLock:
    """One `denv local up` per stack: an exclusive lock on `.denv/<stack>/lock`, held for the
    life of the process that took it, so a second run fails at once instead of clashing on
    ports and leaving processes that no state file records."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "lock"
        self._file: int | None = None
        self._made: Path | None = None  # the highest folder acquire made, if it made any

    def acquire(self, stack: str) -> None:
        missing = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._made = missing[-1] if missing else None
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(descriptor, 32).decode(errors="replace").strip() or "?"
            os.close(descriptor)
            raise StackError(
                [
                    f"--stack: {stack} is already starting or running locally (pid {holder}); "
                    f"`denv local down --stack {stack}` or Ctrl-C in its terminal stops it"
                ]
            ) from None
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        self._file = descriptor

    def release(self) -> None:
        if self._file is not None:
            os.close(self._file)  # closing drops the lock
            self._file = None

    def abandon(self) -> None:
        """Release a start that was refused, and remove the folders acquire made for it: a
        refused `local up` leaves nothing behind. A folder that was already there stays."""
        self.release()
        if self._made is not None:
            shutil.rmtree(self._made, ignore_errors=True)
            self._made = None

    def holder(self) -> int | None:
        """The pid of the process holding the lock (a foreground `denv local up` supervising the
        stack), or None when it is free. The lock dies with its process, so a pid read while it
        is held is never a recycled one."""
        try:
            descriptor = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(descriptor, 32).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
        finally:
            os.close(descriptor)  # closing drops a shared lock taken just to look
        return None


def _recorded_processes(state: RunState) -> list[tuple[int, str, bool]]:
    """(pid, command-line mark, whether it leads a process group) of each recorded process."""
    targets = [(state.haproxy_pid, HAPROXY_MARK, True)]
    targets += [(a.pid, AGENT_MARK, False) for a in state.agents]
    targets += [(r.pid, r.mark or REPLICA_MARK, r.group) for r in state.replicas]
    return targets


def running_recorded(directory: Path) -> bool:
    """Whether any process that `state.json` records still runs; False without a state file,
    StackError when it cannot be read (its processes may still run)."""
    state = read_state(directory)
    if state is None:
        return False
    return any(ours(pid, mark) for pid, mark, _ in _recorded_processes(state))


def _running_count(directory: Path) -> int:
    """How many processes that state.json records still run."""
    state = read_state(directory)
    if state is None:
        return 0
    return sum(ours(pid, mark) for pid, mark, _ in _recorded_processes(state))


def stop_stack(directory: Path, timeout_s: float = 30.0) -> int:
    """`denv local down`: stop a supervised stack through its supervisor, which would restart
    anything stopped under it, then whatever state.json still records (a detached stack);
    returns how many processes it stopped."""
    lock = StackLock(directory)
    supervisor = lock.holder()
    if supervisor is None:
        return stop_recorded(directory)
    supervised = _running_count(directory)
    os.kill(supervisor, signal.SIGTERM)

    def still_running(_: int | None) -> StackError:
        return StackError(
            [
                f"the supervising `denv local up` (pid {supervisor}) did not stop within "
                f"{timeout_s:.0f} s of SIGTERM; stop it with `kill -KILL {supervisor}`, "
                "then run `denv local down` again"
            ]
        )

    wait_until(
        lock.holder,
        lambda holder: holder is None,
        timeout_s=timeout_s,
        interval_s=0.05,
        timed_out=still_running,
    )
    return 1 + supervised + stop_recorded(directory)


def stop_recorded(directory: Path) -> int:
    """Stop what state.json records; returns how many processes it stopped."""
    state = read_state(directory)
    if state is None:
        return 0
    targets = _recorded_processes(state)
    stopped = 0
    for pid, marker, group in targets:
        if ours(pid, marker):
            if group:
                os.killpg(pid, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGTERM)
            stopped += 1
    # Past the wait the state file goes anyway: a process that outlives SIGTERM is no longer
    # the stack's to stop.
    wait_until_or_last(
        lambda: any(ours(p, m) for p, m, _ in targets),
        lambda alive: not alive,
        timeout_s=5,
        interval_s=0.05,
    )
    (directory / STATE_FILE).unlink(missing_ok=True)
    return stopped
