"""Interleavings of the router's tasks, chosen by the test (scripted instances hold calls).

The router awaits instances while it ends or recovers a request, and other tasks run meanwhile: a
client's abort, the deadline watchdog, another instance's report. These pin the interleavings that
once made it attempt an illegal transition (invariant 6 of docs: only legal transitions) or send
an abort ahead of its hop's submit. Each failed before the fix it guards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from scripted_instance import VOCAB_SIZE, ScriptedInstance, until

from cluster.router.api import ClientRequest, FinalEvent, Outcome
from cluster.router.config import RouterConfig
from cluster.router.driver import Router
from worker.protocol import InstanceRole, PushResult, RequestOutput, ReservationNotice
from worker.sampling import SamplingParams
from worker.tokenizer import ByteTokenizer

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TRANSFER_ID = "t" * 24
REQUEST_ID = "fuzz id ~ with spaces"


def make_router(chain: list[str]) -> Router:
    config = RouterConfig.from_dict(
        {
            "recovery": {"chain": [{"action": action} for action in chain]},
            "health": {"heartbeat_interval_s": 0.05, "dead_after_s": 20.0},
        }
    )
    return Router(config, ByteTokenizer(), vocab_size=VOCAB_SIZE, max_seq_len=4096, tokens_per_block=16, seed=1)


@contextlib.asynccontextmanager
async def serving(chain: list[str], *instances: ScriptedInstance) -> AsyncIterator[Router]:
    """A started router (make_router) with `instances` added, stopped on the way out."""
    router = make_router(chain)
    await router.start()
    try:
        for instance in instances:
            await router.add_instance(instance)
        yield router
    finally:
        await router.stop()


def scripted_pair() -> tuple[ScriptedInstance, ScriptedInstance]:
    return ScriptedInstance("p0", InstanceRole.PREFILL, port=1), ScriptedInstance("g0", InstanceRole.GENERATION, port=2)


async def submitted(router: Router, p0: ScriptedInstance, request_id: str = REQUEST_ID):
    """Submit a disaggregated request and wait until its prefill hop reached p0."""
    handle = await router.submit(ClientRequest(None, (1, 2, 3), GREEDY, client_request_id=request_id))
    await until(lambda: p0.called("submit", f"{request_id}.p1"))
    return handle


async def final_of(handle) -> FinalEvent:
    async for event in handle.events():
        if isinstance(event, FinalEvent):
            return event
    raise AssertionError("no final event")


async def into_transmission(router: Router, p0: ScriptedInstance, generation: ScriptedInstance, request_id: str):
    """Submit a disaggregated request and script it to TRANSMISSION (the prefill pushing)."""
    handle = await router.submit(ClientRequest(None, (1, 2, 3), GREEDY, client_request_id=request_id))
    await until(lambda: p0.called("submit", f"{request_id}.p1"))
    p0.report(outputs=(RequestOutput(f"{request_id}.p1", (5,), "x", context_done=True),))
    await until(lambda: generation.called("submit", f"{request_id}.g1"))
    generation.report(reservations=(ReservationNotice(f"{request_id}.g1", TRANSFER_ID, 1, 1e12),))
    await until(lambda: p0.called("push", f"{request_id}.p1"))
    assert router.get_request(request_id).state == "TRANSMISSION"
    return handle


# (recovery chain, the call the recovery is held in, the hop it would start next)
RECOVERIES = {
    "retry_transfer": (["retry_transfer", "fail"], ("g0", "abort"), ("g0", ".g2")),
    "recompute_local": (["recompute_local", "fail"], ("p0", "release"), ("g0", ".c1")),
    "reprefill_elsewhere": (["reprefill_elsewhere", "fail"], ("p0", "release"), ("p1", ".p1")),
}


@pytest.mark.parametrize("action", sorted(RECOVERIES))
def test_a_client_abort_during_a_recovery_ends_the_request_and_starts_no_hop(action: str) -> None:
    """A failed push starts a recovery; while it waits on an instance to free the failed hop, the
    client aborts. The abort must end the request (ABORTED, no illegal transition) and the
    recovery, once its call returns, must start no hop for the ended request."""
    chain, (held_on, held_call), (new_on, new_suffix) = RECOVERIES[action]

    async def scenario():
        instances = {
            name: ScriptedInstance(name, role, port=port)
            for port, (name, role) in enumerate(
                [("p0", InstanceRole.PREFILL), ("p1", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION)], start=1
            )
        }
        p0, g0 = instances["p0"], instances["g0"]
        # Only p0 takes the first prefill: p1 joins once the request is placed.
        async with serving(chain, p0, g0) as router:
            handle = await into_transmission(router, p0, g0, REQUEST_ID)
            await router.add_instance(instances["p1"])
            instances[held_on].hold(held_call)
            p0.report(push_results=(PushResult(f"{REQUEST_ID}.p1", TRANSFER_ID, False, "INTERNAL", "boom", 0, 0.0),))
            await instances[held_on].arrived(held_call)
            assert router.recovery_actions, "the recovery did not start"

            aborted, state = await router.abort(request_id=REQUEST_ID)
            assert (aborted, state) == (True, "ABORTED")
            instances[held_on].let_go(held_call)
            final = await asyncio.wait_for(final_of(handle), 10)
            await asyncio.sleep(0.05)  # the recovery's task runs to its end

            assert final.outcome is Outcome.ABORTED and final.finish_reason == "abort"
            assert router.illegal_transitions == 0
            assert not instances[new_on].called("submit", REQUEST_ID + new_suffix), "a hop was started for an ended request"
            # Both old hops were told to free their blocks.
            assert p0.called("abort", f"{REQUEST_ID}.p1") and g0.called("abort", f"{REQUEST_ID}.g1")

    asyncio.run(scenario())


def test_two_ends_at_once_end_the_request_once() -> None:
    """A client's abort waits on the instance to free the hop; a second end (a second abort, as a
    deadline would) arrives meanwhile. The first one ends the request; the second finds it ended."""

    async def scenario():
        p0, g0 = scripted_pair()
        async with serving(["fail"], p0, g0) as router:
            handle = await submitted(router, p0)
            p0.hold("abort")
            first = asyncio.create_task(router.abort(request_id=REQUEST_ID))
            await p0.arrived("abort")
            second = await router.abort(request_id=REQUEST_ID)
            p0.let_go("abort")
            assert await first == (True, "ABORTED")
            assert second == (False, "ABORTED")
            final = await asyncio.wait_for(final_of(handle), 10)
            assert final.outcome is Outcome.ABORTED
            assert router.illegal_transitions == 0
            assert [state.state for state in final.timeline].count("ABORTED") == 1

    asyncio.run(scenario())


def test_an_abort_never_overtakes_its_hops_submit() -> None:
    """A request ended while its hop's submit is in flight: the abort goes out after the submit has
    returned (sent beside it, it could reach the instance first and be lost, leaving the hop running
    for nobody)."""

    async def scenario():
        p0, g0 = scripted_pair()
        async with serving(["fail"], p0, g0) as router:
            p0.hold("submit")
            submitting = asyncio.create_task(router.submit(ClientRequest(None, (1, 2, 3), GREEDY, client_request_id=REQUEST_ID)))
            await p0.arrived("submit")
            assert await router.abort(request_id=REQUEST_ID) == (True, "ABORTED")
            assert not p0.called("abort"), "the abort went out while the submit was in flight"
            p0.let_go("submit")
            handle = await submitting
            final = await asyncio.wait_for(final_of(handle), 10)
            await until(lambda: p0.called("abort"))
            assert p0.calls == [("submit", f"{REQUEST_ID}.p1"), ("abort", f"{REQUEST_ID}.p1")]
            assert final.outcome is Outcome.ABORTED and router.illegal_transitions == 0

    asyncio.run(scenario())


def test_a_stop_that_could_not_reach_its_instance_is_sent_once_it_answers_again() -> None:
    """The abort of an ended request's hop fails (the instance did not answer); the instance is not
    dead, and its next poll answers: the abort goes out then, so its blocks do not wait for a lease."""

    async def scenario():
        p0, g0 = scripted_pair()
        async with serving(["fail"], p0, g0) as router:
            await submitted(router, p0)
            p0.fail("abort")
            assert await router.abort(request_id=REQUEST_ID) == (True, "ABORTED")
            assert not p0.called("abort")
            p0.heal("abort")
            p0.report()  # it answers a poll again
            await until(lambda: p0.called("abort", f"{REQUEST_ID}.p1"))
            assert router.illegal_transitions == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("error", ["rejected", "bug"])
def test_a_stop_that_raises_still_ends_the_request_for_its_client(error: str) -> None:
    """An instance call that fails otherwise than by being unreachable (the instance refuses it, or
    a bug raises) must not cost the request's other actions: the client still gets its final
    event, and the router goes on serving."""
    from cluster.router.instance_client import InstanceRejected

    async def scenario():
        p0, g0 = scripted_pair()
        async with serving(["fail"], p0, g0) as router:
            handle = await submitted(router, p0)
            p0.fail("abort", InstanceRejected("request_id", "no such request") if error == "rejected" else RuntimeError("a bug"))
            assert await router.abort(request_id=REQUEST_ID) == (True, "ABORTED")
            final = await asyncio.wait_for(final_of(handle), 5.0)
            assert final.outcome is Outcome.ABORTED
            p0.heal("abort")
            await submitted(router, p0, "after")  # and it goes on serving
            assert router.illegal_transitions == 0

    asyncio.run(scenario())
