"""Bounded stops: every wait on the way out has a limit, and a stop that hangs says what it waited for.

A stop that waits forever turns a clean exit (or a test's teardown) into a hang that nobody can
explain afterwards. Each step of a shutdown is bounded here; past its bound it raises StopTimeout
naming the step, and callers that stop several things go on with the rest first (a hung front end
must not keep the instances' actors alive) and then raise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")

STOP_TIMEOUT_S = 30.0


class StopTimeout(RuntimeError):
    """A step of a shutdown did not finish within its bound; the message names the step."""


async def bounded(awaitable: Awaitable[T], what: str, timeout_s: float = STOP_TIMEOUT_S) -> T:
    """Await `awaitable` for at most `timeout_s`; past that, StopTimeout naming `what`."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise StopTimeout(f"{what} did not finish within {timeout_s:g} s") from None


async def cancel_and_wait(tasks: Iterable[asyncio.Task], what: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Cancel `tasks` and wait until they have ended, for at most `timeout_s`.

    A task still running is cancelled again every half second: in Python 3.11, asyncio.wait_for
    can swallow a cancellation that arrives just as its inner call completes (CPython gh-86296), so
    one cancel() may not end a loop that awaits wait_for. Past the bound, StopTimeout names the
    tasks still running."""
    pending = {task for task in tasks if not task.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for task in pending:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            names = ", ".join(sorted(task.get_name() for task in pending))
            raise StopTimeout(f"{what}: after {timeout_s:g} s still waiting for {names}")
        _, pending = await asyncio.wait(pending, timeout=min(0.5, remaining))
