"""Placements an instance has not reported yet (cluster/router/fleet.py `Member.unreported`): the
fleet adds them to the instance's last load report, as the instance will report them, until a report
of that instance mentions the request, the request ends or the instance is taken for dead. Without
them, every arrival between two reports of an instance was placed on the older report alone and a
burst went to whichever instance looked freest."""

from __future__ import annotations

import random

from cluster.router.config import RouterConfig
from cluster.router.fleet import Fleet
from cluster.router.placement import PlacementRequest
from worker.kv_layout import KvLayout
from worker.protocol import EngineLoad, InstanceInfo, InstanceRole, PollBatch

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32", model_fingerprint="unreported")


def _fleet(disaggregation: str, instances: dict[str, InstanceRole]) -> Fleet:
    config = RouterConfig.from_dict({
        "placement": {
            "prefill_policy": {"name": "kv_aware"},
            "generation_policy": {"name": "least_loaded"},
            "disaggregation": disaggregation,
        },
    })
    fleet = Fleet(config.placement, random.Random(0), dead_after_s=5.0)
    for name, role in instances.items():
        fleet.register(None, InstanceInfo(name, role, "inc", "127.0.0.1:1", LAYOUT, 256, 264, 4096, 0, "cpu"), 0.0, 0.0)  # type: ignore[arg-type]
    return fleet


def _report(fleet: Fleet, name: str, sequence: int, **load: int) -> None:
    member = fleet.members[name]
    fleet.answered(member, float(sequence))
    fleet.apply_load(member, PollBatch("inc", sequence, load=EngineLoad(member.info.role, 256, load.pop("free", 256), 16, **load)), 0.0, reset=False)


def _request(name: str, prompt_tokens: int = 160) -> PlacementRequest:
    return PlacementRequest(name, prompt_tokens, tuple(range(1, prompt_tokens // 16 + 1)), 32)


def test_a_burst_between_two_reports_is_spread_not_sent_to_the_freest_looking_instance() -> None:
    fleet = _fleet("never", {"m0": InstanceRole.MIXED, "m1": InstanceRole.MIXED, "m2": InstanceRole.MIXED})
    for sequence, name in enumerate(("m0", "m1", "m2"), start=1):
        _report(fleet, name, sequence, free=200, running_requests=2)
    # Three arrivals before any instance reports again: the old way all three went to m0 (ties to
    # the smallest id, and nothing told placement that m0 had taken one).
    picks = [fleet.place(_request(f"r{i}"), frozenset()).generation.instance_id for i in range(3)]
    assert picks == ["m0", "m1", "m2"]
    # m0's candidate is its report with r0 on it, as m0 will report it: queued, its prompt pending.
    load = fleet.load_snapshot(fleet.members["m0"]).load
    assert (load.queued_requests, load.queued_prompt_tokens, load.pending_context_tokens, load.running_requests) == (1, 160, 160, 2)


def test_a_disaggregated_placement_counts_a_context_on_the_prefill_instance_and_a_running_request_on_the_generation_one() -> None:
    fleet = _fleet("always", {"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION})
    plan = fleet.place(_request("r"), frozenset())
    assert (plan.context.instance_id, plan.generation.instance_id) == ("p0", "g0")
    prefill = fleet.load_snapshot(fleet.members["p0"]).load
    generation = fleet.load_snapshot(fleet.members["g0"]).load
    assert (prefill.queued_requests, prefill.queued_prompt_tokens, prefill.pending_context_tokens, prefill.running_requests) == (1, 160, 160, 0)
    assert (generation.queued_requests, generation.running_requests, generation.tokens_in_flight) == (0, 1, 160)


def test_a_report_that_mentions_the_request_replaces_the_count() -> None:
    fleet = _fleet("never", {"m0": InstanceRole.MIXED})
    fleet.place(_request("r0"), frozenset())
    fleet.place(_request("r1"), frozenset())
    # A report from before the requests arrived (it mentions neither): both still counted on it.
    _report(fleet, "m0", 1, running_requests=3)
    assert fleet.load_snapshot(fleet.members["m0"]).load.queued_requests == 2
    # The report with r0's "submitted" event counts r0 itself: only r1 is added.
    _report(fleet, "m0", 2, queued_requests=1, queued_prompt_tokens=160, pending_context_tokens=160, running_requests=3)
    fleet.reported(fleet.members["m0"], "r0")
    load = fleet.load_snapshot(fleet.members["m0"]).load
    assert (load.queued_requests, load.queued_prompt_tokens, load.pending_context_tokens) == (2, 320, 320)
    fleet.reported(fleet.members["m0"], "r1")
    assert fleet.load_snapshot(fleet.members["m0"]).load == fleet.members["m0"].load


def test_an_ended_request_or_a_dead_instance_is_counted_no_more() -> None:
    fleet = _fleet("always", {"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION})
    fleet.place(_request("r0"), frozenset())
    fleet.place(_request("r1"), frozenset())
    fleet.forget("r0")  # ended before either instance reported it: off both
    assert fleet.load_snapshot(fleet.members["p0"]).load.queued_requests == 1
    assert fleet.load_snapshot(fleet.members["g0"]).load.running_requests == 1
    fleet.mark_dead(fleet.members["g0"], "killed")  # what it held is gone (its flows place it again)
    assert fleet.load_snapshot(fleet.members["g0"]).load.running_requests == 0
    assert fleet.load_snapshot(fleet.members["p0"]).load.queued_requests == 1
    fleet.forget("r1")
    assert fleet.load_snapshot(fleet.members["p0"]).load.queued_requests == 0


def test_a_generation_hop_placed_alone_is_counted_too() -> None:
    fleet = _fleet("always", {"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION, "g1": InstanceRole.GENERATION})
    _report(fleet, "g0", 1, running_requests=1)
    _report(fleet, "g1", 2, running_requests=1)
    # A retried transfer picks a generation instance for the hop alone: twice in a row, not the same.
    first = fleet.choose_generation(_request("r0"), frozenset(), receives_kv=True)
    second = fleet.choose_generation(_request("r1"), frozenset(), receives_kv=True)
    assert {first, second} == {"g0", "g1"}


def test_a_failed_submit_is_counted_no_more_where_it_failed() -> None:
    fleet = _fleet("never", {"m0": InstanceRole.MIXED, "m1": InstanceRole.MIXED})
    assert fleet.place(_request("r0"), frozenset()).generation.instance_id == "m0"
    fleet.submit_failed("m0", "r0")  # m0 will never report r0
    assert fleet.load_snapshot(fleet.members["m0"]).load.queued_requests == 0
    fleet.submit_failed("gone", "r0")  # an instance removed meanwhile: nothing to uncount
    # Placed again, on m0 once more (it looks free): counted there again, and the end of the
    # request uncounts it.
    assert fleet.place(_request("r0"), frozenset()).generation.instance_id == "m0"
    assert fleet.load_snapshot(fleet.members["m0"]).load.queued_requests == 1
    fleet.forget("r0")
    assert fleet.load_snapshot(fleet.members["m0"]).load.queued_requests == 0


def test_the_router_uncounts_a_submit_that_could_not_reach_its_instance() -> None:
    import asyncio

    from scripted_instance import ScriptedInstance, until

    from cluster.router.api import ClientRequest
    from cluster.router.driver import Router
    from worker.sampling import SamplingParams
    from worker.tokenizer import ByteTokenizer

    async def run() -> None:
        config = RouterConfig.from_dict({"health": {"dead_after_s": 25.0}, "placement": {"disaggregation": "never"}})
        router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=1)
        await router.start()
        m0, m1 = ScriptedInstance("m0", InstanceRole.MIXED), ScriptedInstance("m1", InstanceRole.MIXED)
        try:
            for instance in (m0, m1):
                await router.add_instance(instance)
            m0.fail("submit")  # m0 looks freest (it sorts first), and cannot be reached
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            handle = await router.submit(ClientRequest(None, tuple(range(40)), params, client_request_id="r"))
            await until(lambda: m1.called("submit"))
            members = router.fleet.members
            assert list(members["m1"].unreported) == [handle.request_id]
            assert members["m0"].unreported == {}  # before the fix: counted on m0 until the request ended
        finally:
            await router.stop()

    asyncio.run(run())
