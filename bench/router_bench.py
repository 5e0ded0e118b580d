"""The router alone: the whole asyncio driver over 64 instant instances, against an asyncio floor.

The subject is the real Router (cluster/router/driver.py: its flow, fleet, KV-aware placement over
the prefix index, observer) driving 32 PREFILL + 32 GENERATION instant instances (worker/instant.py:
the real protocol and codec, no model) in this process, pinned to one CPU. Every request is
disaggregated (a 256-token prompt, max_tokens 2: each one is handed over), and the prefix index
holds 100,000 blocks in all before the run, so every placement decision walks a populated index.

The floor is a bare asyncio loop that passes, per request, as many messages as the router does
(one message = one instance call or one item of a poll batch), through one queue per instance with
the same number of requests in flight: what an asyncio process on this core costs for that traffic
before any routing.

Figures: requests/s end to end (admission to final event) and the floor's; the ratio; microseconds
per placement decision (timed around the fleet's place(), which builds the candidates and the
prefix overlap); messages per request. Targets: >= 2,000 requests/s; placement <= 100 us.

    python bench/router_bench.py [--quick] [--requests N] [--concurrency C] [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from cluster.router.api import ClientRequest, FinalEvent, Outcome  # noqa: E402
from cluster.router.config import RouterConfig  # noqa: E402
from cluster.router.driver import Router  # noqa: E402
from cluster.router.instance_client import InstantInstanceClient  # noqa: E402
from worker.instant import InstantInstance, InstantNetwork  # noqa: E402
from worker.protocol import InstanceRole, PollBatch  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402
from worker.tokenizer import ByteTokenizer  # noqa: E402

NUM_PREFILL = 32
NUM_GENERATION = 32
PROMPT_TOKENS = 256
MAX_TOKENS = 2
INDEX_BLOCKS = 100_000
VOCAB = 264
TOKENS_PER_BLOCK = 16


class CountingClient(InstantInstanceClient):
    """Counts messages as the floor passes them: each call, and each item of a polled batch."""

    messages = 0

    async def _call(self, command, expected, timeout_s=10.0):
        reply = await super()._call(command, expected, timeout_s)
        if isinstance(reply, PollBatch):
            CountingClient.messages += len(reply.outputs) + len(reply.events) + len(reply.reservations) + len(reply.push_results)
        else:
            CountingClient.messages += 1
        return reply


def prompts(count: int, rng: random.Random) -> list[tuple[int, ...]]:
    return [tuple(rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)) for _ in range(count)]


async def run_router(requests: list[tuple[int, ...]], concurrency: int, seed: int) -> dict[str, float]:
    network = InstantNetwork()
    config = RouterConfig.from_dict(
        {
            "health": {"heartbeat_interval_s": 1.0, "dead_after_s": 30.0},
            "admission": {"max_queued_requests": max(1024, concurrency * 2)},
            "placement": {"prefill_policy": {"name": "kv_aware"}, "generation_policy": {"name": "least_loaded"}, "disaggregation": "always"},
        }
    )
    router = Router(config, ByteTokenizer(), vocab_size=VOCAB, max_seq_len=4096, tokens_per_block=TOKENS_PER_BLOCK, seed=seed)
    await router.start()
    instances = [InstantInstance(f"p{i}", InstanceRole.PREFILL, network, num_blocks=1 << 20, vocab_size=VOCAB) for i in range(NUM_PREFILL)]
    instances += [InstantInstance(f"g{i}", InstanceRole.GENERATION, network, num_blocks=1 << 20, vocab_size=VOCAB) for i in range(NUM_GENERATION)]
    rng = random.Random(seed)
    per_instance = INDEX_BLOCKS // len(instances)
    for instance in instances:
        # What the instance holds in its prefix cache before the run (reported in its first poll).
        instance.remember_blocks(rng.getrandbits(64) for _ in range(per_instance))
        await router.add_instance(CountingClient(instance))
    await asyncio.sleep(0.05)  # every instance's first report is in the index
    indexed = sum(router.fleet.prefix.num_blocks(i.instance_id) for i in instances)

    place_calls = 0
    place_s = 0.0
    original_place = router.fleet.place

    def timed_place(request, exclude):
        nonlocal place_calls, place_s
        started = time.perf_counter()
        try:
            return original_place(request, exclude)
        finally:
            place_s += time.perf_counter() - started
            place_calls += 1

    router.fleet.place = timed_place
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=1, ignore_eos=True)
    queue = list(enumerate(requests))
    outcomes: list[FinalEvent] = []
    CountingClient.messages = 0

    async def worker() -> None:
        while queue:
            index, prompt = queue.pop()
            # Validated, as a front end hands requests over (the router's own cost is measured).
            request = ClientRequest(None, prompt, params, client_request_id=f"b{index}", validated=True)
            handle = await router.submit(request)
            async for event in handle.events():
                if isinstance(event, FinalEvent):
                    outcomes.append(event)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    messages = CountingClient.messages
    await router.stop()
    complete = sum(1 for o in outcomes if o.outcome is Outcome.COMPLETE)
    handed_over = sum(1 for o in outcomes if any(e.state == "TRANSMISSION" for e in o.timeline))
    return {
        "requests": len(requests),
        "complete": complete,
        "handed_over": handed_over,
        "seconds": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "placement_us_per_decision": 1e6 * place_s / max(place_calls, 1),
        "placement_decisions": place_calls,
        "messages_per_request": messages / len(requests),
        "indexed_blocks": indexed,
        "illegal_transitions": router.illegal_transitions,
    }


async def run_floor(num_requests: int, messages_per_request: float, concurrency: int, num_queues: int) -> float:
    """Requests/s of a bare asyncio loop passing the same messages: each request sends its share of
    messages through per-instance queues to consumer tasks and waits for the last one."""
    per_request = max(1, round(messages_per_request))
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(num_queues)]

    async def consumer(queue: asyncio.Queue) -> None:
        while True:
            done = await queue.get()
            if done is None:
                return
            done.set_result(None)

    consumers = [asyncio.create_task(consumer(q)) for q in queues]
    remaining = list(range(num_requests))
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        while remaining:
            index = remaining.pop()
            for m in range(per_request):
                done = loop.create_future()
                queues[(index + m) % num_queues].put_nowait(done)
                await done

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    for q in queues:
        q.put_nowait(None)
    await asyncio.gather(*consumers)
    return num_requests / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--requests", type=int, default=None, help="requests per run (default 20000; 1000 with --quick)")
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=None, help="router/floor rounds, alternating (default 3; 1 with --quick)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    num_requests = args.requests or (1000 if args.quick else 20_000)
    rounds = args.rounds or (1 if args.quick else 3)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core: the router's budget
    rng = random.Random(args.seed)
    best: dict[str, float] | None = None
    floor_best = 0.0
    for round_ in range(rounds):
        progress(f"round {round_ + 1}/{rounds}: router, {num_requests} requests over {NUM_PREFILL}P+{NUM_GENERATION}G instant instances")
        result = asyncio.run(run_router(prompts(num_requests, rng), args.concurrency, args.seed + round_))
        if result["complete"] != num_requests or result["handed_over"] != num_requests or result["illegal_transitions"]:
            progress(f"FAIL: {result}")
            return 1
        progress(f"round {round_ + 1}/{rounds}: floor, {result['messages_per_request']:.1f} messages per request")
        floor = asyncio.run(run_floor(num_requests, result["messages_per_request"], args.concurrency, NUM_PREFILL + NUM_GENERATION))
        if best is None or result["requests_per_s"] > best["requests_per_s"]:
            best = result
        floor_best = max(floor_best, floor)
    assert best is not None
    print_table(
        ["subject", "requests/s", "placement us/decision", "messages/request", "indexed blocks"],
        [
            ["router (64 instant instances)", best["requests_per_s"], best["placement_us_per_decision"], best["messages_per_request"], int(best["indexed_blocks"])],
            ["asyncio floor (same messages)", floor_best, "-", round(best["messages_per_request"]), "-"],
        ],
    )
    print(f"router / floor: {best['requests_per_s'] / floor_best:.3f} (best of {rounds} rounds each)")
    figures = {
        "requests_per_s": round(best["requests_per_s"], 1),
        "floor_requests_per_s": round(floor_best, 1),
        "router_vs_floor": round(best["requests_per_s"] / floor_best, 4),
        "placement_us_per_decision": round(best["placement_us_per_decision"], 2),
        "messages_per_request": round(best["messages_per_request"], 2),
        "indexed_blocks": int(best["indexed_blocks"]),
        "requests": num_requests,
        "instances": NUM_PREFILL + NUM_GENERATION,
    }
    targets = {
        "requests_per_s": Target(best["requests_per_s"], 2000.0, higher_is_better=True),
        "placement_us_per_decision": Target(best["placement_us_per_decision"], 100.0, higher_is_better=False),
    }
    emit_result("router", figures, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
