"""An asyncio event loop on virtual time: the real router (cluster/router/driver.py) runs on it unchanged.

The loop's `time()` is a number the loop owns. When no callback is ready, asyncio's `_run_once`
asks the selector to wait until the next timer; this loop's selector does not wait, it moves the
clock to that timer instead. So `asyncio.sleep`, `wait_for` timeouts and `call_at` keep their
meaning (the driver's poll timeouts, health bounds and watchdog interval are all timers) and a
simulated hour takes as long as its callbacks take to run.

The driver reads its clock through the `clock` it is given (`Router(clock=loop.time)`), and sleeps
only through asyncio, so nothing in it changes. Nothing here does real I/O: a simulation that waits
on a socket would wait forever, so a wait with no timer pending is an error (a deadlock in the
simulated system, reported instead of hanging).
"""

from __future__ import annotations

import asyncio
import gc
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Nothing is ready and no timer is pending: the simulated system waits on itself."""


class _VirtualSelector(selectors.SelectSelector):
    """Registers file objects as usual (the loop's self-pipe) but never waits on them: a wait of
    `timeout` seconds moves the loop's virtual clock forward by that much."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list:
        assert self.loop is not None
        if timeout is None:
            raise SimulationDeadlock("no callback is ready and no timer is pending")
        if timeout > 0:
            self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock is virtual and jumps to the next timer when idle."""

    def __init__(self, start_s: float = 0.0) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now_s = float(start_s)
        # Timers due within the resolution run together; virtual time is exact, so it is tiny.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        self._now_s += seconds


# While a simulation runs, the cyclic garbage collector runs rarely: a large simulated cluster holds
# millions of long-lived objects (every instance's prefix tree, every request in flight), and each
# collection walks those of its generation. Young collections come after a million net allocations
# instead of 700 (asyncio's short-lived cycles are still collected, so memory stays bounded), full
# ones are put off. bench/sim_scale.py at 20,000 requests, 256 instances: 66.4 s of CPU with
# Python's thresholds, 57.4 s with these, 56.4 s with the collector off, the same peak memory
# (1.41 GB) and the same records digest in all three. The thresholds are restored afterwards.
YOUNG_COLLECTION_THRESHOLD = 1_000_000
DEFERRED_FULL_COLLECTION_THRESHOLD = 1_000_000


def run_virtual(main: Coroutine[Any, Any, T], *, start_s: float = 0.0) -> T:
    """Run `main` to completion on a fresh VirtualTimeLoop (as `asyncio.run` does on a real one)."""
    loop = VirtualTimeLoop(start_s)
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], YOUNG_COLLECTION_THRESHOLD), thresholds[1], DEFERRED_FULL_COLLECTION_THRESHOLD)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
            gc.set_threshold(*thresholds)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
