"""The router with real engines in this process (no Ray): the disaggregated flow, recovery, aborts.

Instances talk KV over real gRPC on 127.0.0.1 (bytes over gRPC streams or shared memory, both in
this process); the router drives them through LocalInstanceClient.
"""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import GREEDY, PROMPTS, SEEDED, Cluster, make_instance, router_config, run, states

from cluster.router.api import ClientRequest, ErrorKind, FinalEvent, Outcome, RouterError, TokenEvent, collect
from cluster.router.instance_client import LocalInstanceClient
from worker.protocol import InstanceRole
from worker.sampling import SamplingParams
from worker.tokenizer import ByteTokenizer

# Small chunks (two blocks): the prompts prefill in up to 3 chunks, so an early reservation is made
# and relayed while later chunks still compute, and finished chunks stream.
CHUNKED = {"max_num_tokens": 32, "chunk_unit_tokens": 32}


@pytest.mark.parametrize(
    ("params", "reserve", "engine", "data_plane"),
    [
        (GREEDY, "at_context_start", None, "grpc"),
        (SEEDED, "at_context_start", None, "grpc"),
        (GREEDY, "at_context_start", None, "shm"),
        (SEEDED, "at_context_start", None, "shm"),
        (GREEDY, "at_admission", CHUNKED, "grpc"),
        (SEEDED, "at_context_start", CHUNKED, "shm"),
        (GREEDY, "at_context_done", None, "grpc"),
    ],
    ids=["greedy", "seeded", "greedy-shm", "seeded-shm", "greedy-at_admission-chunked", "seeded-chunked-shm", "greedy-at_context_done"],
)
def test_disaggregated_equals_colocated(params, reserve, engine, data_plane) -> None:
    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}) as colocated_cluster:
            colocated = [await colocated_cluster.run(p, params) for p in PROMPTS[:8]]
        config = router_config(handover={"reserve": reserve})
        # "shm" is forced: a hand-over that could not use shared memory would fail, not fall back.
        roles = {"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}
        async with Cluster(roles, config=config, engine=engine, data_plane=data_plane) as disagg_cluster:
            results = await asyncio.gather(*(disagg_cluster.run(p, params) for p in PROMPTS[:8]))
            free = await disagg_cluster.free_blocks_settle()
            router = disagg_cluster.router
            assert router.inconsistent_reports == 0 and router.illegal_transitions == 0
            assert not router.recovery_actions, router.recovery_actions
            assert router.transfers["committed"] == 8, router.transfers
        for (ref_tokens, ref_final), (tokens, final) in zip(colocated, results, strict=True):
            assert final.outcome is Outcome.COMPLETE, final.error_message
            assert tokens == ref_tokens
            assert states(final) == [
                "QUEUED", "CONTEXT_WAIT", "CONTEXT_IN_PROGRESS", "GENERATION_INIT", "TRANSMISSION", "GENERATING", "COMPLETE",
            ]
            assert [u.phase for u in final.instances] == ["prefill", "generation"]
            (init,) = [e for e in final.timeline if e.state == "GENERATION_INIT"]
            assert ("early" in init.detail) == (reserve != "at_context_done"), init.detail
            assert states(ref_final) == ["QUEUED", "CONTEXT_WAIT", "CONTEXT_IN_PROGRESS", "GENERATING", "COMPLETE"]
        assert all(f == t for f, t in free.values()), free

    run(scenario())


def test_a_generation_pool_too_small_for_every_early_reservation_falls_back_without_deadlock() -> None:
    """16 requests at once, each reserving at admission, on a generation instance whose pool holds
    a few of them: the rest reserve as blocks free up (after their first token, as without early
    reservation), and every request completes with the colocated tokens."""
    prompts = PROMPTS[:16]

    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}) as reference:
            expected = [(await reference.run(p, GREEDY))[0] for p in prompts]
        config = router_config(handover={"reserve": "at_admission"})
        small = {"g0": {"num_blocks": 24}}
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}, config=config) as cluster:
            cluster.instances["g0"].shutdown()
            cluster.instances["g0"] = make_instance("g0", InstanceRole.GENERATION, engine=small["g0"])
            cluster.clients["g0"] = LocalInstanceClient(cluster.instances["g0"])
            await cluster.router.add_instance(cluster.clients["g0"])
            results = await asyncio.wait_for(asyncio.gather(*(cluster.run(p, GREEDY) for p in prompts)), 120)
            free = await cluster.free_blocks_settle()
            router = cluster.router
            assert router.illegal_transitions == 0 and router.inconsistent_reports == 0
        details = []
        for (tokens, final), reference_tokens in zip(results, expected, strict=True):
            assert final.outcome is Outcome.COMPLETE, final.error_message
            assert tokens == reference_tokens
            details.append(next(e.detail for e in final.timeline if e.state == "GENERATION_INIT"))
        assert all(f == t for f, t in free.values()), free
        assert any("waiting for the early reservation" in d for d in details), details

    run(scenario())


def test_an_aborted_request_frees_its_early_reservation_and_its_prefill() -> None:
    long_prompt = [(7 * i) % 250 for i in range(1500)]

    async def scenario():
        config = router_config(handover={"reserve": "at_admission"})
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}, config=config) as cluster:
            router = cluster.router
            handles = [await router.submit(ClientRequest(None, tuple(long_prompt), GREEDY)) for _ in range(3)]
            await asyncio.sleep(0.05)  # reserved on g0, prefills queued or running on p0
            for handle in handles:
                await router.abort(handle.request_id)
            finals = [(await collect(handle))[1] for handle in handles]
            free = await cluster.free_blocks_settle()
        assert all(final.outcome is Outcome.ABORTED for final in finals)
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


@pytest.mark.parametrize("victim", ["g0", "p0"])
def test_the_only_instance_of_a_role_dies_and_every_request_completes(victim: str) -> None:
    """1 PREFILL + 1 GENERATION; the only instance of one role is killed with requests in flight
    and comes back (as Ray restarts an actor) a second later. Every request completes with the
    tokens of a fault-free run, including requests sent during the outage; nothing is streamed
    twice. A dead GENERATION instance leaves the requests waiting for it (QUEUED); a dead PREFILL
    instance's requests recompute on the GENERATION instance."""
    params = SamplingParams(max_tokens=60, temperature=0.8, top_k=40, seed=11, ignore_eos=True)
    prompts = PROMPTS[:6]

    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}) as reference:
            expected = [(await reference.run(p, params))[0] for p in prompts]
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}) as cluster:
            router = cluster.router
            first = [asyncio.create_task(cluster.run(p, params)) for p in prompts[:4]]
            while sum(1 for e in router._requests.values() if len(e.flow.outputs) >= 5) < 2:
                await asyncio.sleep(0.005)
            cluster.clients[victim].killed = True
            cluster.instances[victim].shutdown()
            await asyncio.sleep(0.3)
            during = [asyncio.create_task(cluster.run(p, params)) for p in prompts[4:]]
            await asyncio.sleep(0.7)
            role = InstanceRole.GENERATION if victim == "g0" else InstanceRole.PREFILL
            cluster.instances[victim] = make_instance(victim, role)
            cluster.clients[victim] = LocalInstanceClient(cluster.instances[victim])
            await router.add_instance(cluster.clients[victim])
            results = await asyncio.wait_for(asyncio.gather(*first, *during), 60)
            free = await cluster.free_blocks_settle()
            assert router.illegal_transitions == 0
        for (tokens, final), reference_tokens in zip(results, expected, strict=True):
            assert final.outcome is Outcome.COMPLETE, final.error_message
            assert tokens == reference_tokens
        if victim == "g0":
            waited = [f for _, f in results if "QUEUED" in states(f)[1:]]
            assert waited, "some request waited for the generation instance"
            assert any("waiting up to" in e.detail for _, f in results for e in f.timeline)
        assert all(f == t for f, t in free.values()), free

    run(scenario())


LONG_PROMPT = [(11 * i + 3) % 250 for i in range(900)]
SMALL_CHUNKS = {"max_num_tokens": 64, "chunk_unit_tokens": 64}


def test_finished_chunks_are_pushed_while_later_chunks_compute() -> None:
    """A 900-token prompt in 64-token chunks; the prefill holds after its first chunk long enough for
    the early reservation to reach it, then pushes each finished chunk's blocks while the next ones
    compute, and commits once after the tail. The tokens equal a MIXED instance's."""
    hold = {"p0": {"enabled": True, "seed": 1, "rules": [
        {"kind": "hold", "state": "CONTEXT_IN_PROGRESS", "seconds": 0.5, "request_ids": ["*.p1"]},
    ]}}

    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}) as reference:
            expected, _ = await reference.run(LONG_PROMPT, GREEDY)
        config = router_config(handover={"reserve": "at_context_start"})
        async with Cluster({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}, hold, config=config, engine=SMALL_CHUNKS) as cluster:
            tokens, final = await cluster.run(LONG_PROMPT, GREEDY)
            free = await cluster.free_blocks_settle()
            router = cluster.router
            streamed = cluster.instances["p0"].engine.num_streamed_pushes
            assert not router.recovery_actions and router.transfers["committed"] == 1, (router.recovery_actions, router.transfers)
        assert final.outcome is Outcome.COMPLETE, final.error_message
        assert tokens == expected
        assert streamed == 1
        assert all(f == t for f, t in free.values()), free

    run(scenario())


def test_the_prefill_instance_killed_while_streaming_chunks_frees_the_reservation_and_recovers() -> None:
    async def scenario():
        async with Cluster({"m0": InstanceRole.MIXED}) as reference:
            expected, _ = await reference.run(LONG_PROMPT, GREEDY)
        config = router_config(handover={"reserve": "at_admission"})
        roles = {"p0": InstanceRole.PREFILL, "p1": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}
        engine = {"max_num_tokens": 32, "chunk_unit_tokens": 32}
        async with Cluster(roles, config=config, engine=engine) as cluster:
            router = cluster.router
            task = asyncio.create_task(cluster.run(LONG_PROMPT, GREEDY))
            victim = None
            while victim is None and not task.done():
                for name in ("p0", "p1"):
                    if cluster.instances[name].engine.num_streamed_pushes:
                        victim = name
                await asyncio.sleep(0.001)
            assert victim is not None, "the push never streamed"
            cluster.clients[victim].killed = True
            cluster.instances[victim].shutdown()
            tokens, final = await asyncio.wait_for(task, 60)
            survivors = {k: v for k, v in cluster.instances.items() if k != victim}
            cluster.instances = survivors
            free = await cluster.free_blocks_settle()
            assert router.illegal_transitions == 0
        assert final.outcome is Outcome.COMPLETE, final.error_message
        assert tokens == expected
        assert router.recovery_actions, "the kill was recovered"
        assert all(f == t for f, t in free.values()), free

    run(scenario())


def test_a_landed_hand_over_is_reported_with_the_token_of_its_first_decode_step() -> None:
    """The commit and the decode step that takes it up (DISAGG_GENERATION_TRANS_COMPLETE,
    GENERATION_IN_PROGRESS) reach the router in the same poll answer as that step's token, not in
    one of their own in the middle of the step the second token waits for
    (worker/instance.py _AFTER_THE_STEP)."""
    from scheduler.state import LlmRequestState as L

    async def scenario():
        roles = {"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}
        cluster = Cluster(roles, config=router_config(handover={"reserve": "at_context_start"}))
        batches = []
        client = cluster.clients["g0"]
        polled = client.poll

        async def recording(timeout_s):
            batch = await polled(timeout_s)
            batches.append(batch)
            return batch

        client.poll = recording  # before the router starts: every poll of g0 is seen
        async with cluster:
            for prompt in PROMPTS[:6]:  # one at a time: each hand-over alone on the instance
                tokens, final = await cluster.run(prompt, GREEDY)
                assert final.outcome is Outcome.COMPLETE, final.error_message
            landed = [
                (batch, event.request_id)
                for batch in batches
                for event in batch.events
                if event.state is L.DISAGG_GENERATION_TRANS_COMPLETE
            ]
            assert len(landed) == 6
            for batch, request_id in landed:
                mine = [event.state for event in batch.events if event.request_id == request_id]
                assert mine[:2] == [L.DISAGG_GENERATION_TRANS_COMPLETE, L.GENERATION_IN_PROGRESS], mine
                assert any(o.request_id == request_id and o.new_token_ids for o in batch.outputs), batch

    run(scenario())
