"""Waits on this machine's own clock: `poll_until` (and `poll_until_or_last`) with
`time.monotonic` and `time.sleep`.

A node's reboot, HAProxy's start and the local runner's processes wait this way, and so do the
tests and the benchmarks' lab (benchmarks/lab/waiting.py). The API clients call `poll_until`
with the clock and sleep they were given, which tests replace.
"""

import time
from functools import partial

from denv_iac.core.polling import poll_until, poll_until_or_last

wait_until = partial(poll_until, clock=time.monotonic, sleep=time.sleep)
wait_until_or_last = partial(poll_until_or_last, clock=time.monotonic, sleep=time.sleep)
