"""Background loops that keep running whatever one round does."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("denv_agent")


def start_periodic(
    name: str, interval_s: float, work: Callable[[], None], stop: threading.Event
) -> threading.Thread:
    """Run `work` now and then every `interval_s` (start to start) until `stop` is set."""

    def loop() -> None:
        last_error = ""
        while not stop.is_set():
            started = time.monotonic()
            try:
                work()
            except Exception as e:
                # A bug, not a health finding: say it once per distinct error and keep polling.
                if str(e) != last_error:
                    log.exception("%s: round failed", name)
                    last_error = str(e)
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread
