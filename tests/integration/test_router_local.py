"""The router with real engines in this process (no Ray): the disaggregated flow, recovery, aborts.

Instances talk KV over real gRPC on 127.0.0.1; the router drives them through LocalInstanceClient.
"""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import GREEDY, PROMPTS, SEEDED, Cluster, router_config, run, states

from cluster.router.api import ClientRequest, ErrorKind, FinalEvent, Outcome, RouterError, TokenEvent
from worker.protocol import InstanceRole
from worker.sampling import SamplingParams
from worker.tokenizer import ByteTokenizer


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_disaggregated_equals_colocated(params) -> None:
    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}) as colocated_cluster:
            colocated = [await colocated_cluster.run(p, params) for p in PROMPTS[:8]]
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}) as disagg_cluster:
            results = await asyncio.gather(*(disagg_cluster.run(p, params) for p in PROMPTS[:8]))
            free = await disagg_cluster.free_blocks_settle()
            assert disagg_cluster.router.inconsistent_reports == 0
        for (ref_tokens, ref_final), (tokens, final) in zip(colocated, results, strict=True):
            assert final.outcome is Outcome.COMPLETE, final.error_message
            assert tokens == ref_tokens
            assert states(final) == [
                "QUEUED", "CONTEXT_WAIT", "CONTEXT_IN_PROGRESS", "GENERATION_INIT", "TRANSMISSION", "GENERATING", "COMPLETE",
            ]
            assert [u.phase for u in final.instances] == ["prefill", "generation"]
            assert states(ref_final) == ["QUEUED", "CONTEXT_WAIT", "CONTEXT_IN_PROGRESS", "GENERATING", "COMPLETE"]
        assert all(f == t for f, t in free.values()), free

    run(scenario())


def test_client_ids_with_spaces_cross_the_kv_path_without_recovery() -> None:
    """One request-id rule (worker/kv_transfer/ids.py): an id the front end accepts, spaces and
    every printable ASCII character included, is the request's id on every hop and on the KV path."""
    ids = [" lead and trail ", "a b", "".join(map(chr, range(0x20, 0x7F)))]

    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}) as reference:
            expected = [(await reference.run(PROMPTS[i], GREEDY))[0] for i in range(len(ids))]
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}) as cluster:
            results = [await cluster.run(PROMPTS[i], GREEDY, client_request_id=cid) for i, cid in enumerate(ids)]
            router = cluster.router
            assert not router.recovery_actions and router.transfers["committed"] == len(ids), (router.recovery_actions, router.transfers)
            assert [router.get_request(client_request_id=cid).request_id for cid in ids] == ids
        for (tokens, final), reference_tokens in zip(results, expected, strict=True):
            assert final.outcome is Outcome.COMPLETE, final.error_message
            assert tokens == reference_tokens
            assert states(final) == [
                "QUEUED", "CONTEXT_WAIT", "CONTEXT_IN_PROGRESS", "GENERATION_INIT", "TRANSMISSION", "GENERATING", "COMPLETE",
            ]

    run(scenario())


def test_corrupted_transfer_is_retried_and_output_unchanged() -> None:
    faults = {"p0": {"enabled": True, "seed": 2, "rules": [{"kind": "corrupt", "chunk": 0, "max_fires": 1}]}}

    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}) as reference:
            expected, _ = await reference.run(PROMPTS[3], GREEDY)
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}, faults) as cluster:
            tokens, final = await cluster.run(PROMPTS[3], GREEDY)
            free = await cluster.free_blocks_settle()
        assert final.outcome is Outcome.COMPLETE
        assert tokens == expected
        timeline = states(final)
        assert timeline.count("TRANSMISSION") == 2 and timeline.count("GENERATION_INIT") == 2
        assert any("retry transfer" in e.detail for e in final.timeline)
        assert all(f == t for f, t in free.values()), free

    run(scenario())


def test_persistent_transfer_failure_recomputes_locally() -> None:
    faults = {"p0": {"enabled": True, "seed": 2, "rules": [{"kind": "corrupt", "chunk": 0}]}}

    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}) as reference:
            expected, _ = await reference.run(PROMPTS[4], SEEDED)
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}, faults) as cluster:
            tokens, final = await cluster.run(PROMPTS[4], SEEDED)
            free = await cluster.free_blocks_settle()
        assert final.outcome is Outcome.COMPLETE
        assert tokens == expected
        assert any("recompute locally" in e.detail for e in final.timeline)
        assert [u.phase for u in final.instances] == ["prefill", "generation", "generation", "recompute"]
        assert all(f == t for f, t in free.values()), free

    run(scenario())


def test_generation_instance_dies_mid_stream_and_another_continues() -> None:
    async def scenario():
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        async with Cluster({"m0": InstanceRole.MIXED}) as reference:
            expected, _ = await reference.run(PROMPTS[5], params)
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION, "g1": InstanceRole.GENERATION}) as cluster:
            handle = await cluster.router.submit(ClientRequest(None, tuple(PROMPTS[5]), params))
            tokens: list[int] = []
            final = None
            victim = None
            async for event in handle.events():
                if isinstance(event, TokenEvent):
                    tokens.extend(event.token_ids)
                    if victim is None and len(tokens) >= 20:
                        victim = cluster.router.get_request(handle.request_id).instances[-1].instance_id
                        cluster.clients[victim].killed = True
                        cluster.instances[victim].shutdown()
                else:
                    final = event
            free = await cluster.free_blocks_settle()
        assert final.outcome is Outcome.COMPLETE, final.error_message
        assert tokens == expected  # no token lost, none repeated
        assert victim is not None and any("died" in e.detail for e in final.timeline)
        assert all(f == t for f, t in free.values()), free

    run(scenario())


def test_abort_and_deadline_free_every_block() -> None:
    async def scenario():
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}) as cluster:
            long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
            handle = await cluster.router.submit(ClientRequest(None, tuple(PROMPTS[6]), long))
            seen = 0
            abort_sent = False
            async for event in handle.events():
                if isinstance(event, TokenEvent):
                    seen += len(event.token_ids)
                    # Once: tokens already queued before the abort still arrive after it.
                    if seen >= 5 and not abort_sent:
                        abort_sent = True
                        aborted, _ = await cluster.router.abort(handle.request_id)
                        assert aborted
                else:
                    assert event.outcome is Outcome.ABORTED and event.finish_reason == "abort" and event.error_kind is None
            tokens, final = await cluster.run(PROMPTS[7], long, timeout_s=0.8)
            assert final.outcome is Outcome.ABORTED and final.error_kind is ErrorKind.DEADLINE_EXCEEDED
            free = await cluster.free_blocks_settle()
        assert all(f == t for f, t in free.values()), free

    run(scenario())


def test_admission_and_validation_errors() -> None:
    async def scenario():
        config = router_config(admission={"max_queued_requests": 2}, placement={"disaggregation": "never"})
        async with Cluster({"m0": InstanceRole.MIXED}, config=config) as cluster:
            router = cluster.router
            long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
            first = await router.submit(ClientRequest(None, tuple(PROMPTS[0]), long))
            second = await router.submit(ClientRequest(None, tuple(PROMPTS[1]), long))
            with pytest.raises(RouterError) as full:
                await router.submit(ClientRequest(None, tuple(PROMPTS[2]), long))
            assert full.value.kind is ErrorKind.RESOURCE_EXHAUSTED
            for handle in (first, second):
                await router.abort(handle.request_id)
            with pytest.raises(RouterError) as bad:
                await router.submit(ClientRequest(None, (1, 2, 999), GREEDY))
            assert bad.value.kind is ErrorKind.INVALID_ARGUMENT and bad.value.field == "prompt.token_ids"
            with pytest.raises(RouterError) as too_long:
                await router.submit(ClientRequest(None, (1,) * 4000, SamplingParams(max_tokens=200)))
            assert too_long.value.field == "sampling.max_tokens"
            with pytest.raises(RouterError) as missing:
                router.get_request("nope")
            assert missing.value.kind is ErrorKind.NOT_FOUND
            handle = await router.submit(ClientRequest("héllo", None, GREEDY))
            async for event in handle.events():
                if isinstance(event, FinalEvent):
                    assert event.outcome is Outcome.COMPLETE
                    assert event.usage.prompt_tokens == len(ByteTokenizer().encode("héllo"))
            await cluster.free_blocks_settle()

    run(scenario())


def test_a_client_request_id_in_use_is_already_exists() -> None:
    async def scenario():
        config = router_config(placement={"disaggregation": "never"})
        async with Cluster({"m0": InstanceRole.MIXED}, config=config) as cluster:
            router = cluster.router
            long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
            first = await router.submit(ClientRequest(None, tuple(PROMPTS[0]), long, client_request_id="dup"))
            with pytest.raises(RouterError) as again:
                await router.submit(ClientRequest(None, tuple(PROMPTS[1]), GREEDY, client_request_id="dup"))
            assert again.value.kind is ErrorKind.ALREADY_EXISTS and again.value.field == "client_request_id"
            # Within one batch too, and then nothing of the batch runs.
            with pytest.raises(RouterError) as batch:
                await router.submit_all(
                    [ClientRequest(None, tuple(PROMPTS[1]), GREEDY, client_request_id=cid) for cid in ("twin", "twin")]
                )
            assert batch.value.kind is ErrorKind.ALREADY_EXISTS and batch.value.field == "client_request_id"
            with pytest.raises(RouterError):
                router.get_request(client_request_id="twin")
            await router.abort(first.request_id)
            await cluster.free_blocks_settle()

    run(scenario())


def test_a_client_that_stops_reading_is_cut_off_and_its_blocks_freed() -> None:
    async def scenario():
        config = router_config(admission={"max_buffered_events": 8}, placement={"disaggregation": "never"})
        async with Cluster({"m0": InstanceRole.MIXED}, config=config) as cluster:
            long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
            handle = await cluster.router.submit(ClientRequest(None, tuple(PROMPTS[2]), long))
            # Never read the stream: once 8 events wait unread, the router gives up on the client.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while cluster.router.get_request(handle.request_id).final is None and loop.time() < deadline:
                await asyncio.sleep(0.05)
            view = cluster.router.get_request(handle.request_id)
            assert view.state == "ABORTED" and "stopped reading" in view.error
            free = await cluster.free_blocks_settle()
        assert all(f == t for f, t in free.values()), free

    run(scenario())
