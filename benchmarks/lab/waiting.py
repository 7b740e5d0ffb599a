"""The one wait tests and the lab poll with: until a condition holds, or fail saying what never
came.

It is the product's own wait on the real clock (denv_iac/waits.py), so a test waits the way a
node's reboot and HAProxy's start do. The skip markers every test folder shares are in the root
conftest.py.
"""

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

from denv_iac.waits import wait_until


def eventually(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
    detail: Callable[[], object] | None = None,
) -> float:
    """The seconds until `condition` holds, asked every `interval_s`.

    Past `timeout_s` an AssertionError says `not within {timeout_s} s: {what}`, followed by
    `detail()` where given: the state at that moment (a balancer's rows, the lines logged).
    """
    started = time.monotonic()

    def failed(_: bool) -> AssertionError:
        state = "" if detail is None else f"; {detail()}"
        return AssertionError(f"not within {timeout_s} s: {what}{state}")

    wait_until(condition, bool, timeout_s=timeout_s, interval_s=interval_s, timed_out=failed)
    return time.monotonic() - started


async def eventually_async(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
) -> float:
    """`eventually` inside an event loop: the pauses let the loop run (the thing waited for runs
    there too), and `condition` may be a coroutine function."""
    started = time.monotonic()

    async def holds() -> bool:
        answer = condition()
        return await answer if inspect.isawaitable(answer) else answer

    while not await holds():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(interval_s)
    return time.monotonic() - started
