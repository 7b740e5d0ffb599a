"""Waits on this machine's own clock: `poll_until` with `time.monotonic` and `time.sleep`.

A node's reboot and HAProxy's start wait this way, and so do the tests and the benchmarks' lab
(benchmarks/lab/waiting.py). The API clients call `poll_until` with the clock and sleep they
were given, which tests replace.
"""

import time
from functools import partial

from denv_iac.core.polling import poll_until

wait_until = partial(poll_until, clock=time.monotonic, sleep=time.sleep)
