"""An asyncio event loop on virtual time: the real router (cluster/router/driver.py) runs on it unchanged.

The loop's `time()` is a number the loop owns. When no callback is ready, the loop moves the clock
to the next timer instead of waiting for it. So `asyncio.sleep`, `wait_for` timeouts and `call_at`
keep their meaning (the driver's poll timeouts, health bounds and watchdog interval are all timers)
and a simulated hour takes as long as its callbacks take to run.

The driver reads its clock through the `clock` it is given (`Router(clock=loop.time)`), and sleeps
only through asyncio, so nothing in it changes. Nothing here does real I/O: a simulation that waits
on a socket would wait forever, so a wait with no timer pending is an error (a deadlock in the
simulated system, reported instead of hanging).

The loop keeps its own timer queue rather than asyncio's (`_run_once` is asyncio's, less the
selector and the debug checks): a heap of (due time, scheduling order, handle) tuples, which compare
in C, where asyncio's heap of TimerHandles calls a Python `__lt__` for every comparison (about 7
million of them in a 20,000-request bench/sim_scale.py run). Timers due at the same virtual instant
run in the order they were scheduled; asyncio's heap orders them by time alone, so equal times come
out in whatever order the heap holds them.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import itertools
import selectors
from asyncio import events
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Cancelled timers are dropped from the queue once they are more than this share of it and the
# queue is longer than the minimum (asyncio's own thresholds): a router cancels a `wait_for`
# timeout every time a poll answers in time, and those would otherwise stay until they came due.
_COMPACT_MIN_TIMERS = 100
_COMPACT_CANCELLED_SHARE = 0.5


class SimulationDeadlock(RuntimeError):
    """Nothing is ready and no timer is pending: the simulated system waits on itself."""


class _NeverWaits(selectors.SelectSelector):
    """Holds the loop's self-pipe registration; the virtual loop never selects."""

    def select(self, timeout: float | None = None) -> list:
        raise AssertionError("the virtual-time loop never waits on file objects")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock is virtual and jumps to the next timer when idle."""

    def __init__(self, start_s: float = 0.0) -> None:
        super().__init__(_NeverWaits())
        self._now_s = float(start_s)
        # Timers due within the resolution run together; virtual time is exact, so it is tiny.
        self._clock_resolution = 1e-9
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._timer_order = itertools.count()
        self._cancelled_timers = 0

    def time(self) -> float:
        return self._now_s

    def call_at(self, when: float, callback: Callable[..., object], *args: object, context=None) -> asyncio.TimerHandle:
        self._check_closed()
        timer = events.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._timers, (when, next(self._timer_order), timer))
        timer._scheduled = True
        return timer

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        if handle._scheduled:
            self._cancelled_timers += 1

    def _run_once(self) -> None:
        """One pass: move the clock to the next timer if nothing is ready, move the timers now due to
        the ready queue, run what is ready (callbacks scheduled meanwhile wait for the next pass)."""
        timers = self._timers
        if self._cancelled_timers > _COMPACT_CANCELLED_SHARE * len(timers) and len(timers) > _COMPACT_MIN_TIMERS:
            kept = []
            for entry in timers:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False
                else:
                    kept.append(entry)
            heapq.heapify(kept)  # (time, order) keys are unique: the pops keep their order
            self._timers = timers = kept
            self._cancelled_timers = 0
        ready = self._ready
        if not ready and not self._stopping:
            while timers and timers[0][2]._cancelled:
                heapq.heappop(timers)[2]._scheduled = False
                self._cancelled_timers -= 1
            if not timers:
                raise SimulationDeadlock("no callback is ready and no timer is pending")
            self._now_s = max(self._now_s, timers[0][0])
        end_s = self._now_s + self._clock_resolution
        while timers and timers[0][0] < end_s:
            handle = heapq.heappop(timers)[2]
            if handle._cancelled:
                self._cancelled_timers -= 1
            handle._scheduled = False
            ready.append(handle)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()

    def close(self) -> None:
        for entry in self._timers:
            entry[2]._scheduled = False
        self._timers.clear()
        super().close()


# While a simulation runs, the cyclic garbage collector is off. A simulation makes no cyclic garbage
# to speak of: after a 10,000-request bench/sim_scale.py run with the collector off, gc.collect()
# found no unreachable object at all, and the peak memory was the same as with it on (895 MB). So
# every collection only walked live objects: a large simulated cluster holds millions (every
# instance's prefix tree, every request in flight), and at 100,000 requests the collections took
# 34 s of a 584 s run (302 young ones of 70 ms, 26 middle ones of 0.5 s; Python's thresholds raised
# to a million allocations). A restarted simulated instance unlinks its old prefix tree
# (BlockManager.close), the one cycle-bound structure a run threw away; whatever cycles a run still
# makes are freed once it ends, when the collector is switched back on.
def run_virtual(main: Coroutine[Any, Any, T], *, start_s: float = 0.0) -> T:
    """Run `main` to completion on a fresh VirtualTimeLoop (as `asyncio.run` does on a real one)."""
    loop = VirtualTimeLoop(start_s)
    collecting = gc.isenabled()
    gc.disable()
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
            if collecting:
                gc.enable()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
