"""The instant instance (worker/instant.py) under the real router: the protocol end to end with no
model, the same tokens on every route, and many requests at once."""

from __future__ import annotations

import asyncio

from cluster.router.api import ClientRequest, FinalEvent, Outcome, TokenEvent
from cluster.router.config import RouterConfig
from cluster.router.driver import Router
from cluster.router.instance_client import InstantInstanceClient
from worker.instant import InstantInstance, InstantNetwork, instant_token
from worker.protocol import InstanceRole
from worker.sampling import SamplingParams
from worker.tokenizer import ByteTokenizer


async def run(roles: dict[str, InstanceRole], requests: list[ClientRequest], **router_config):
    network = InstantNetwork()
    config = RouterConfig.from_dict({"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 5.0}, **router_config})
    router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=3)
    await router.start()
    try:
        for name, role in roles.items():
            await router.add_instance(InstantInstanceClient(InstantInstance(name, role, network)))

        async def one(request: ClientRequest):
            tokens, final = [], None
            async for event in (await router.submit(request)).events():
                if isinstance(event, TokenEvent):
                    tokens.extend(event.token_ids)
                else:
                    final = event
            return tokens, final

        results = await asyncio.gather(*(one(r) for r in requests))
        return results, router
    finally:
        await router.stop()


def request(i: int, max_tokens: int = 4) -> ClientRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=100 + i, ignore_eos=True)
    return ClientRequest(None, tuple(range(1, 40 + i)), params, client_request_id=f"req {i}")


def states(final: FinalEvent) -> list[str]:
    return [entry.state for entry in final.timeline]


def test_disaggregated_and_colocated_give_the_same_tokens() -> None:
    requests = [request(i) for i in range(6)]
    disagg, router = asyncio.run(run({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}, requests))
    colocated, _ = asyncio.run(run({"m0": InstanceRole.MIXED}, requests, placement={"disaggregation": "never"}))
    for i, ((tokens, final), (reference, _)) in enumerate(zip(disagg, colocated, strict=True)):
        assert final.outcome is Outcome.COMPLETE, final.error_message
        assert tokens == reference == [instant_token(100 + i, p, 264) for p in range(4)]
        assert states(final) == [
            "QUEUED", "CONTEXT_WAIT", "CONTEXT_IN_PROGRESS", "GENERATION_INIT", "TRANSMISSION", "GENERATING", "COMPLETE",
        ]
    assert router.illegal_transitions == 0 and router.inconsistent_reports == 0
    assert router.transfers["committed"] == 6 and not router.recovery_actions


def test_a_first_token_that_is_the_last_needs_no_hand_over() -> None:
    (result,), router = asyncio.run(run({"p0": InstanceRole.PREFILL, "g0": InstanceRole.GENERATION}, [request(0, max_tokens=1)]))
    tokens, final = result
    assert final.outcome is Outcome.COMPLETE and len(tokens) == 1
    assert states(final)[-2:] == ["CONTEXT_IN_PROGRESS", "COMPLETE"]
    assert router.transfers["started"] == 0


def test_many_requests_over_many_instances_all_complete() -> None:
    roles = {f"p{i}": InstanceRole.PREFILL for i in range(4)} | {f"g{i}": InstanceRole.GENERATION for i in range(4)}
    round_robin = {"prefill_policy": {"name": "round_robin"}, "generation_policy": {"name": "round_robin"}}
    results, router = asyncio.run(run(roles, [request(i, max_tokens=2) for i in range(200)], placement=round_robin))
    assert all(final.outcome is Outcome.COMPLETE for _, final in results)
    assert router.num_in_flight == 0 and router.illegal_transitions == 0
    used = {use.instance_id for _, final in results for use in final.instances}
    assert len(used) == 8, used  # placement spread them
