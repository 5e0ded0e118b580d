"""Router regressions, most found by the chaos soak, pinned without Ray: scripted instances
(tests/unit/scripted_instance.py) make the order of reports exact; two use real in-process
instances. Moved here from tests/chaos/test_soak.py with the router's restructuring."""

from __future__ import annotations

import asyncio

from scripted_instance import ScriptedInstance, until

from cluster.router.api import ClientRequest, FinalEvent, Outcome, collect
from cluster.router.config import RouterConfig
from cluster.router.driver import Router
from scheduler.state import LlmRequestState
from worker.protocol import (
    ErrorCode,
    InstanceRole,
    PushResult,
    RequestError,
    RequestOutput,
    ReservationNotice,
    StateEvent,
)
from worker.sampling import SamplingParams
from worker.stopping import FinishReason
from worker.tokenizer import ByteTokenizer


async def started_router(config: RouterConfig, *instances: ScriptedInstance) -> Router:
    """A started Router (the byte tokenizer, a seed) with the scripted instances added."""
    router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=1)
    await router.start()
    for instance in instances:
        await router.add_instance(instance)
    return router


async def to_the_push(router: Router, prefill: ScriptedInstance, generation: ScriptedInstance):
    """Submit request "r" (3 greedy tokens) and script it to its KV push: p0 computes the context,
    g0 reserves, the router asks p0 to push. Returns the request's handle."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    handle = await router.submit(ClientRequest(None, (256, 1, 2, 3), params, client_request_id="r"))
    await until(lambda: prefill.called("submit", "r.p1"))
    prefill.report(outputs=(RequestOutput("r.p1", (10,), "", context_done=True),))
    await until(lambda: generation.called("submit", "r.g1"))
    generation.report(reservations=(ReservationNotice("r.g1", "t-1", 1, 1e12),))
    await until(lambda: prefill.called("push", "r.p1"))
    return handle


async def final_event(handle) -> FinalEvent:
    async for event in handle.events():
        if isinstance(event, FinalEvent):
            return event
    raise AssertionError("the stream ended without a final event")


def test_reprefill_elsewhere_without_another_prefill_instance_falls_through_to_recompute() -> None:
    """Found by the soak (seed 12, while prefill-0 was down after a kill): a request whose transfer
    failed twice (the retry used up) was failed with UNAVAILABLE "re-placement failed: no prefill
    instance available", although RECOMPUTE_LOCAL, next in the chain, could serve it. The router
    counted REPREFILL_ELSEWHERE as applicable because the request's own prefill instance was
    healthy, and then excluded exactly that instance when re-placing. In process, no Ray: one
    PREFILL instance (so no other to re-run on) and a receiver that refuses both transfers."""
    import asyncio

    from cluster.router.api import ClientRequest, Outcome
    from cluster.router.config import RouterConfig
    from cluster.router.driver import Router
    from cluster.router.instance_client import LocalInstanceClient
    from worker.engine_types import EngineConfig
    from worker.instance import Instance, InstanceSpec
    from worker.sampling import SamplingParams
    from worker.tokenizer import ByteTokenizer

    token = "soak-regression-token-0123456789abcdef"
    refuse = {"enabled": True, "seed": 1, "rules": [{"kind": "refuse", "side": "receiver", "request_ids": ["r.g1", "r.g2"]}]}
    config = RouterConfig.from_dict(
        {
            "health": {"heartbeat_interval_s": 0.2, "dead_after_s": 1.5},
            "timeouts": {"context_s": 30.0, "reservation_s": 10.0, "transfer_s": 10.0, "generation_s": 30.0},
            "recovery": {
                "chain": [
                    {"action": "retry_transfer", "max_attempts": 1},
                    {"action": "reprefill_elsewhere", "max_attempts": 1},
                    {"action": "recompute_local", "max_attempts": 1},
                    {"action": "fail", "max_attempts": 1},
                ]
            },
        }
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = (256, *range(40, 80))

    def instance(name: str, role: InstanceRole, faults=None) -> Instance:
        engine = EngineConfig(role=role, num_blocks=64, tokens_per_block=16)
        return Instance(InstanceSpec(name, engine, dtype="float32", device="cpu", cluster_token=token, torch_threads=1, faults=faults))

    async def scenario() -> tuple[list[int], FinalEvent]:
        instances = [instance("p0", InstanceRole.PREFILL), instance("g0", InstanceRole.GENERATION, refuse)]
        router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=5)
        await router.start()
        try:
            for item in instances:
                await router.add_instance(LocalInstanceClient(item))
            return await collect(await router.submit(ClientRequest(None, prompt, params, client_request_id="r")))
        finally:
            await router.stop()
            for item in instances:
                item.shutdown()

    tokens, final = asyncio.run(scenario())
    assert final.outcome is Outcome.COMPLETE, final.error_message
    assert [(use.phase, use.instance_id) for use in final.instances][-1] == ("recompute", "g0")
    assert len(tokens) == 8


def test_a_late_push_failure_report_from_the_sender_is_consistent_with_the_retried_transfer() -> None:
    """Found by the soak (seed 11, under load): the receiver reported a corrupt transfer first; the
    router retried, the retry committed (GENERATING); then the sender's own "push failed" record,
    made in DISAGG_CONTEXT_TRANS_IN_PROGRESS (where it stays until the retried push is
    acknowledged), arrived and was counted as an inconsistent report. The sender really is in that
    state while the receiver generates; the router's check must accept it."""
    from cluster.router.state import (
        TRANSITIONS,
        GlobalState,
        RequestTimeline,
        Route,
        global_states_for_local,
    )
    from cluster.router.state import RequestType as LocalRequestType

    timeline = RequestTimeline("r", clock=lambda: 0.0)
    for state in (
        GlobalState.CONTEXT_WAIT, GlobalState.CONTEXT_IN_PROGRESS, GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION,
        GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION, GlobalState.GENERATING,
    ):
        timeline.transition(state, route=Route.DISAGGREGATED if state is GlobalState.CONTEXT_WAIT else None)
    allowed = global_states_for_local("DISAGG_CONTEXT_TRANS_IN_PROGRESS", InstanceRole.PREFILL, LocalRequestType.CONTEXT_ONLY)
    reachable = {target[0] for target in TRANSITIONS.get(timeline.node, frozenset())}
    # The flow's rule (RequestFlow._consistent).
    assert timeline.state in allowed or allowed & reachable, (timeline.state, allowed)


def test_an_exception_while_handling_a_poll_batch_does_not_stop_polling_that_instance() -> None:
    """Found by the soak (seed 11, under load, not reproduced on demand): generation-1 stopped being
    polled (its actor saw ~7 calls/s, then none for minutes while alive) and stayed HEALTHY, so
    requests kept being placed there and hung in GENERATION_INIT / GENERATING until their stage
    timeouts failed them. Router._poll_loop guards the poll call but not `_on_batch`: any exception
    while handling a batch (an IllegalTransition from a race, say) ends the poll task silently. Here
    one handling error is injected; polling must go on."""
    import asyncio

    from cluster.router.config import RouterConfig
    from cluster.router.driver import Router
    from cluster.router.instance_client import LocalInstanceClient
    from worker.engine_types import EngineConfig
    from worker.instance import Instance, InstanceSpec
    from worker.tokenizer import ByteTokenizer

    config = RouterConfig.from_dict({"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 1.0}})
    engine = EngineConfig(role=InstanceRole.MIXED, num_blocks=16, tokens_per_block=16)
    instance = Instance(InstanceSpec("m0", engine, dtype="float32", device="cpu", cluster_token="t" * 32, torch_threads=1))
    polls = 0

    class CountingClient(LocalInstanceClient):
        async def poll(self, timeout_s: float):
            nonlocal polls
            polls += 1
            return await super().poll(timeout_s)

    async def scenario() -> tuple[int, bool]:
        router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=1)
        original = router.fleet.apply_load
        failures = iter([RuntimeError("injected: a bug while handling one batch")])

        def flaky(*args, **kwargs):
            error = next(failures, None)
            if error is not None:
                raise error
            return original(*args, **kwargs)

        router.fleet.apply_load = flaky  # called for every batch that carries a load report
        await router.start()
        try:
            await router.add_instance(CountingClient(instance))
            await asyncio.sleep(0.5)
            before = polls
            await asyncio.sleep(0.5)
            return polls - before, router.instances["m0"].task.done()
        finally:
            await router.stop()

    try:
        later_polls, task_done = asyncio.run(scenario())
    finally:
        instance.shutdown()
    assert not task_done, "the poll task of m0 ended"
    assert later_polls >= 3, later_polls


def test_a_push_that_fails_after_the_receiver_committed_does_not_undo_the_hand_over() -> None:
    """Found by the soak (3 soaks at once, load ~20 on 2 cores): a sender's push lost its shared
    connection ("Channel closed!") after the receiver had committed the KV; the router, already in
    GENERATING, took the late failure for a transfer failure, aborted the healthy generation hop and
    tried GENERATING -> GENERATION_INIT (an IllegalTransition, raised into the prefill instance's
    poll loop). Scripted instances make the order of reports exact: commit first, then the failed
    push result. The hand-over must stand: no abort on the generation instance, the request
    completes there, and the sender's copy is freed."""
    config = RouterConfig.from_dict({"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 5.0}})

    async def scenario() -> tuple[FinalEvent, str, int, ScriptedInstance, ScriptedInstance]:
        prefill, generation = ScriptedInstance("p0", InstanceRole.PREFILL, port=1), ScriptedInstance("g0", InstanceRole.GENERATION, port=2)
        router = await started_router(config, prefill, generation)
        try:
            handle = await to_the_push(router, prefill, generation)
            generation.report(events=(StateEvent("r.g1", LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE, 0.0, "KV received"),))
            await until(lambda: router.get_request("r").state == "GENERATING")
            # The sender's connection broke after the commit: its push result says failed.
            prefill.report(push_results=(PushResult("r.p1", "t-1", False, "PEER_UNAVAILABLE", "Channel closed!", 0, 0.0),))
            await asyncio.sleep(0.3)
            generation.report(outputs=(RequestOutput("r.g1", (11, 12), "", finished=True, finish_reason=FinishReason.LENGTH),))
            try:
                final = await asyncio.wait_for(final_event(handle), 10.0)
            except asyncio.TimeoutError:
                raise AssertionError(
                    f"no final event: the request is stuck in {router.get_request('r').state}; "
                    f"illegal transitions {router.illegal_transitions}; calls to g0 {generation.calls}"
                ) from None
            return final, router.get_request("r").state, router.illegal_transitions, prefill, generation
        finally:
            await router.stop()

    final, state, illegal, prefill, generation = asyncio.run(scenario())
    assert illegal == 0
    assert not generation.called("abort", "r.g1"), generation.calls
    assert (final.outcome, state) == (Outcome.COMPLETE, "COMPLETE"), final.error_message
    assert [(use.phase, use.instance_id) for use in final.instances] == [("prefill", "p0"), ("generation", "g0")]
    assert prefill.called("abort", "r.p1")  # the sender's copy is freed


def test_one_failure_gets_one_recovery_even_when_the_instance_is_slow_to_answer() -> None:
    """Found by the soak (an IllegalTransition CONTEXT_IN_PROGRESS[DISAGGREGATED] ->
    GENERATING[DISAGGREGATED] under load): recovery used to await calls to instances (abort,
    release, submit) between choosing an action and making its transition, so a second recovery of
    the same request could start meanwhile. Here the generation instance is slow to answer the abort
    of a failed transfer and the TRANSMISSION stage timeout passes meanwhile; the first recovery
    (retry the transfer) has already moved the request to GENERATION_INIT, so the timeout no longer
    applies: one failure, one recovery."""
    config = RouterConfig.from_dict(
        {
            "health": {"heartbeat_interval_s": 0.05, "dead_after_s": 0.4},
            "timeouts": {"context_s": 30.0, "reservation_s": 30.0, "transfer_s": 0.5, "generation_s": 30.0},
        }
    )

    async def scenario() -> tuple[int, dict, list]:
        prefill, generation = ScriptedInstance("p0", InstanceRole.PREFILL, port=1), ScriptedInstance("g0", InstanceRole.GENERATION, port=2)
        router = await started_router(config, prefill, generation)
        try:
            await to_the_push(router, prefill, generation)
            generation.hold("abort")  # g0 is slow to answer from now on
            prefill.report(push_results=(PushResult("r.p1", "t-1", False, "CHECKSUM_MISMATCH", "chunk 0", 0, 0.0),))
            await generation.arrived("abort")  # the first recovery's abort of r.g1
            await asyncio.sleep(1.5)  # the TRANSMISSION stage timeout (0.5 s) passes meanwhile
            generation.let_go("abort")
            await asyncio.sleep(0.5)
            actions = {action.value: count for action, count in router.recovery_actions.items()}
            hops = [c for c in prefill.calls + generation.calls if c[0] == "submit"]
            return router.illegal_transitions, actions, hops
        finally:
            await router.stop()

    illegal, actions, hops = asyncio.run(scenario())
    assert illegal == 0, (actions, hops)
    assert sum(actions.values()) == 1, (actions, hops)


def test_a_failure_reported_while_a_hop_is_submitting_is_acted_on_and_the_stop_waits_for_the_submit() -> None:
    """A failure of one of the request's current hops reported by another instance while a
    recovery's new hop is still being submitted is neither dropped nor acted on twice. Here g0
    reports the KV transfer failed (recovery 1: retry the transfer, its submit to g0 slow);
    meanwhile p0 reports it lost the prefill KV: recovery 2 is decided at once (each event is
    handled to the end before the next: no two recoveries run at once), finds no KV to retry from
    and no other prefill instance, and recomputes on g0. The retried hop r.g2 is stopped, but only
    once its submit has returned (an abort beside its submit could reach the instance first).
    (Before the router became a pure flow, recovery 2 waited for recovery 1's submit instead.)"""
    config = RouterConfig.from_dict({"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 5.0}})

    async def scenario():
        prefill, generation = ScriptedInstance("p0", InstanceRole.PREFILL, port=1), ScriptedInstance("g0", InstanceRole.GENERATION, port=2)
        router = await started_router(config, prefill, generation)
        try:
            handle = await to_the_push(router, prefill, generation)
            generation.hold("submit")  # recovery 1's new hop is slow to submit
            failed = RequestError(ErrorCode.TRANSFER_FAILED, "chunk 0", "CHECKSUM_MISMATCH")
            generation.report(outputs=(RequestOutput("r.g1", (), "", finished=True, error=failed),))
            await generation.arrived("submit")  # recovery 1 (retry the transfer) submits r.g2
            lost = RequestError(ErrorCode.LEASE_EXPIRED, "the KV is gone")
            prefill.report(outputs=(RequestOutput("r.p1", (), "", finished=True, error=lost),))
            await until(lambda: sum(router.recovery_actions.values()) == 2)
            await asyncio.sleep(0.1)
            stopped_during_submit = generation.called("abort", "r.g2")
            generation.let_go("submit")
            await until(lambda: generation.called("submit", "r.c1"))
            generation.report(outputs=(RequestOutput("r.c1", (11, 12), "", finished=True, finish_reason=FinishReason.LENGTH),))
            final = await asyncio.wait_for(final_event(handle), 10.0)
            actions = {action.value: count for action, count in router.recovery_actions.items()}
            return stopped_during_submit, actions, final, router.illegal_transitions, generation.calls
        finally:
            await router.stop()

    stopped_during_submit, actions, final, illegal, calls = asyncio.run(scenario())
    assert not stopped_during_submit, "r.g2 was aborted while its submit was in flight"
    assert actions == {"retry_transfer": 1, "recompute_local": 1}
    assert illegal == 0
    assert final.outcome is Outcome.COMPLETE, final
    # The retried hop was submitted, then stopped, before the recompute went out.
    assert calls.index(("submit", "r.g2")) < calls.index(("abort", "r.g2")) < calls.index(("submit", "r.c1")), calls


def test_a_client_request_id_used_again_gets_fresh_hop_ids() -> None:
    """A client may name a new request like one that ended. The old hop may still be ending on the
    instance (its abort on the way, its last report not yet read): the new request's hops must not
    share its engine ids, or the instance refuses the new hop as a duplicate and the old hop's late
    ABORTED report is taken for the new request's (which then waits for nothing)."""
    config = RouterConfig.from_dict(
        {"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 5.0}, "placement": {"disaggregation": "never"}}
    )

    async def scenario():
        mixed = ScriptedInstance("m0", InstanceRole.MIXED)
        router = await started_router(config, mixed)
        try:
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            await router.submit(ClientRequest(None, (256, 1, 2, 3), params, client_request_id="r"))
            await until(lambda: mixed.called("submit", "r.c1"))
            await router.abort(client_request_id="r")
            handle = await router.submit(ClientRequest(None, (256, 4, 5, 6), params, client_request_id="r"))
            await until(lambda: mixed.called("submit", "r.c2"))
            # The old hop's last report arrives late, then the new hop finishes.
            aborted = RequestError(ErrorCode.ABORTED, "request ended")
            mixed.report(outputs=(RequestOutput("r.c1", (), "", finished=True, error=aborted),))
            mixed.report(outputs=(RequestOutput("r.c2", (7, 8), "", finished=True, finish_reason=FinishReason.LENGTH),))
            events = [event async for event in handle.events()]
            return events, router.illegal_transitions, mixed.calls
        finally:
            await router.stop()

    events, illegal, calls = asyncio.run(scenario())
    final = events[-1]
    assert final.outcome is Outcome.COMPLETE, final
    assert [use.attempt for use in final.instances] == [2]
    assert illegal == 0
    assert [c for c in calls if c[0] == "submit"] == [("submit", "r.c1"), ("submit", "r.c2")]
