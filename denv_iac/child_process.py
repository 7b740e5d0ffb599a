"""A process this one started and watches: HAProxy, a simulated or command replica (the
machines layer's lowest modules, with waits.py: the installed HAProxy and the local data plane
both use it)."""

from __future__ import annotations

import subprocess
from typing import Any


class ChildProcess:
    """Holds the `subprocess.Popen` of a started process; None before it starts."""

    _process: subprocess.Popen[Any] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the process has not exited (for HAProxy's master: it exits when its
        workers die, in master-worker mode)."""
        return self._process is not None and self._process.poll() is None
