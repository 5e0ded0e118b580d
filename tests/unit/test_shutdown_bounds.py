"""Every wait on the way out is bounded, and a stop that hangs names what it waited for."""

from __future__ import annotations

import asyncio

import pytest
from scripted_instance import ScriptedInstance
from test_router_interleavings import make_router

from cluster.shutdown import StopTimeout, bounded, cancel_and_wait
from worker.protocol import InstanceRole, PollBatch


class SwallowsCancellation(ScriptedInstance):
    """A poll that loses the first cancellation, as asyncio.wait_for can in Python 3.11 when the
    inner call completes at the moment it is cancelled (CPython gh-86296)."""

    swallowed = 0

    async def poll(self, timeout_s: float) -> PollBatch:
        try:
            return await super().poll(timeout_s)
        except asyncio.CancelledError:
            self.swallowed += 1
            if self.swallowed > 1:
                raise
            return PollBatch(incarnation=self.info.incarnation, sequence=0)


class NeverStops(ScriptedInstance):
    """A poll that ignores every cancellation: only the bound ends the wait for it."""

    async def poll(self, timeout_s: float) -> PollBatch:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass


def test_a_poll_loop_whose_cancellation_was_lost_still_stops() -> None:
    async def scenario():
        router = make_router(["fail"])
        instance = SwallowsCancellation("p0", InstanceRole.PREFILL)
        await router.start()
        await router.add_instance(instance)
        await asyncio.sleep(0.05)
        await asyncio.wait_for(router.stop(timeout_s=5.0), 10)
        assert instance.swallowed == 1

    asyncio.run(scenario())


def test_a_router_stop_that_hangs_fails_naming_the_task() -> None:
    async def scenario():
        router = make_router(["fail"])
        await router.start()
        await router.add_instance(NeverStops("g7", InstanceRole.GENERATION))
        await asyncio.sleep(0.05)
        with pytest.raises(StopTimeout, match=r"router.stop: after 0.3 s still waiting for poll-g7"):
            await router.stop(timeout_s=0.3)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(scenario())
    finally:
        for task in asyncio.all_tasks(loop):  # the task that never stops, abandoned for the test's end
            task.cancel()
        loop.close()


def test_bounded_names_the_step() -> None:
    async def scenario():
        assert await bounded(asyncio.sleep(0, "done"), "a quick step", 1.0) == "done"
        with pytest.raises(StopTimeout, match="the front end's health service did not finish within 0.05 s"):
            await bounded(asyncio.sleep(10), "the front end's health service", 0.05)

    asyncio.run(scenario())


def test_cancel_and_wait_returns_once_tasks_end() -> None:
    async def scenario():
        tasks = [asyncio.create_task(asyncio.sleep(10), name=f"t{i}") for i in range(3)]
        await cancel_and_wait(tasks, "three sleeps", 1.0)
        assert all(task.cancelled() for task in tasks)

    asyncio.run(scenario())
