"""Scheduler cost per request per step, against a floor loop, in one run.

For 256, 1024 and 4096 active requests (about 90% generating with 1-4k tokens of context, 10% new
prompts of 1-4k tokens, chunked prefill on, prefix reuse on), with the KV pool roomy and under
pressure (so MAX_UTILIZATION pauses), it times both scheduler levels together for each capacity
policy. Between timed calls a model-free executor advances the requests (untimed), so the state
evolves as in a real engine, and keeps the mix steady: for each prompt that finished its context
in a step, the oldest generating request finishes and a new prompt arrives at the tail. So every
size is measured at N requests with about 10% new prompts at every step (left alone, 256 requests
drain their 26 prompts within a few steps and would be timed on a different mix than 4096, whose
prompts wait for hundreds of steps).

The sizes of one policy and pool run interleaved, one step each in turn, so that a change of load
on the machine hits them alike; each step then starts with the other sizes' data in the caches, as
a real engine's scheduler call starts after a forward pass. The floor is one Python loop reading
one attribute of each of 4096 requests, measured once per round under the same conditions (right
after the steps: `floor_us_per_request`, which the targets use); the same loop repeated at once,
its data hot in the caches, is reported as `floor_hot_us_per_request` (about 2.4x lower here).

Targets: at 4096 requests every policy costs at most 30x the floor per request; and the cost per
request at 4096 is within 1.3x of the cost at 256 (nothing super-linear, pause loop included).

    python bench/scheduler_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from scheduler.block_manager import BlockManager, BlockManagerConfig  # noqa: E402
from scheduler.config import (  # noqa: E402
    CapacitySchedulerPolicy,
    ChunkingConfig,
    ContextChunkingPolicy,
    SchedulerConfig,
)
from scheduler.request import LlmRequest  # noqa: E402
from scheduler.scheduler import TwoLevelScheduler  # noqa: E402
from scheduler.simulation import SimulatedExecutor  # noqa: E402
from scheduler.state import LlmRequestState  # noqa: E402

TOKENS_PER_BLOCK = 32
MAX_NUM_TOKENS = 8192
CHUNK_UNIT = 512
MAX_NEW_TOKENS = 100_000  # generating requests never finish during the run
MAX_SEQ_LEN = 4096 + MAX_NEW_TOKENS


def new_prompt(request_id: int, rng: random.Random) -> LlmRequest:
    context_len = rng.randint(1024, 4096)
    return LlmRequest(request_id, [rng.randrange(32000) for _ in range(context_len)], MAX_NEW_TOKENS)


def build(num_requests: int, pressure: bool, policy: CapacitySchedulerPolicy, seed: int, steps: int = 0):
    rng = random.Random(seed)
    num_generating = num_requests * 9 // 10
    requests = []
    blocks_held = 0
    for request_id in range(num_requests):
        requests.append(new_prompt(request_id, rng))
        if request_id < num_generating:
            blocks_held += -(-requests[-1].prompt_len // TOKENS_PER_BLOCK)
    # Roomy: everything (prompts included) fits twice over. Pressure: what the generating requests
    # hold plus a little room for their growth (a new block per request every tpb steps):
    # - MAX_UTILIZATION: two steps of it, so that within a few steps growth and new prompts force
    #   it to pause, step after step;
    # - GUARANTEED_NO_EVICT and STATIC_BATCH never pause: they run what they hold to completion,
    #   which they would only have admitted with its blocks reserved. These requests were placed
    #   without that reservation, so their pool holds the growth of every step of the run; the
    #   new prompts, which need their reservation, still find it full.
    total_prompt_blocks = sum(-(-r.prompt_len // TOKENS_PER_BLOCK) for r in requests)
    growth_blocks_per_step = -(-num_generating // TOKENS_PER_BLOCK)
    growth_steps = 2 if policy is CapacitySchedulerPolicy.MAX_UTILIZATION else steps + 1
    num_blocks = blocks_held + growth_steps * growth_blocks_per_step if pressure else 2 * total_prompt_blocks
    kv = BlockManager(
        BlockManagerConfig(
            tokens_per_block=TOKENS_PER_BLOCK,
            num_blocks=num_blocks,
            max_attention_window=MAX_SEQ_LEN,
            enable_block_reuse=True,
        )
    )
    for request in requests[:num_generating]:
        kv.add_sequence(request)
        request.move_to_next_context_chunk()
        request.add_new_token(rng.randrange(32000))
        request.set_state(LlmRequestState.GENERATION_IN_PROGRESS)
    config = SchedulerConfig(
        max_num_requests=num_requests,
        max_batch_size=num_requests,
        max_num_tokens=MAX_NUM_TOKENS,
        capacity_policy=policy,
        chunking=ChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, CHUNK_UNIT),
    )
    return requests, kv, TwoLevelScheduler(config, kv)


def floor_ns_per_request(requests: list[LlmRequest], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for request in requests:
            request.state  # noqa: B018 - the floor: one attribute read per request
        samples.append((time.perf_counter_ns() - start) / len(requests))
    return statistics.median(samples)


class Case:
    """One policy and pool at one size, stepped one scheduler call at a time (so that the sizes of a
    comparison can be interleaved step by step: a load change on the machine then hits them alike)."""

    def __init__(self, num_requests: int, pressure: bool, policy: CapacitySchedulerPolicy, steps: int) -> None:
        self.requests, self.kv, self.scheduler = build(num_requests, pressure, policy, num_requests, steps)
        self.executor = SimulatedExecutor(self.kv)
        self.rng = random.Random(num_requests + 1)
        self.next_id = num_requests
        self.samples_ns: list[float] = []
        self.pauses = 0

    def step(self) -> None:
        """One timed scheduler call, then (untimed) the executor and the steady mix."""
        requests = self.requests
        start = time.perf_counter_ns()
        output = self.scheduler.schedule(requests)
        self.samples_ns.append((time.perf_counter_ns() - start) / len(requests))
        self.pauses += len(output.paused)
        self.executor.prepare(output)
        self.executor.complete(output)
        # Steady mix: each prompt that became a generating request replaces the oldest generating
        # request, which finishes, and a new prompt arrives at the tail.
        started = {id(r) for r in output.context if r.state is LlmRequestState.GENERATION_IN_PROGRESS}
        retire = [r for r in requests if r.state is LlmRequestState.GENERATION_IN_PROGRESS and id(r) not in started]
        retire = retire[: len(started)]
        for request in retire:
            request.set_state(LlmRequestState.GENERATION_COMPLETE)
            self.kv.remove_sequence(request.request_id, request)
        retired = {id(r) for r in retire}
        self.requests = [r for r in requests if id(r) not in retired]
        for _ in retire:
            self.requests.append(new_prompt(self.next_id, self.rng))
            self.next_id += 1

    @property
    def us_per_request(self) -> float:
        # Median over steps: robust to a noisy neighbour on a shared machine.
        return statistics.median(self.samples_ns) / 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps (CI smoke)")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    sizes = [256, 1024] if args.quick else [256, 1024, 4096]
    steps = args.steps or (3 if args.quick else 12)
    policies = list(CapacitySchedulerPolicy)

    rows = []
    figures: dict[str, float] = {}
    floor_requests, _, _ = build(max(sizes), False, CapacitySchedulerPolicy.GUARANTEED_NO_EVICT, seed=0)
    floor_samples_ns: list[float] = []
    hot_floor_samples_ns: list[float] = []
    results: dict[tuple[bool, CapacitySchedulerPolicy, int], tuple[float, int]] = {}
    for pressure in (False, True):
        for policy in policies:
            pool = "pressure" if pressure else "roomy"
            progress(f"scheduler_bench: {policy.name} {pool}, sizes {sizes} interleaved, {steps} steps ...")
            cases = [Case(size, pressure, policy, steps) for size in sizes]
            gc.collect()
            gc.disable()
            try:
                for _ in range(steps):
                    for case in cases:
                        case.step()
                    # The floor under the subject's conditions: one pass right after the cases'
                    # steps (their data pushed it out of the caches, as theirs is by each other).
                    floor_samples_ns.append(floor_ns_per_request(floor_requests, repeats=1))
                    hot_floor_samples_ns.append(floor_ns_per_request(floor_requests, repeats=3))
            finally:
                gc.enable()
            for size, case in zip(sizes, cases, strict=True):
                results[(pressure, policy, size)] = (case.us_per_request, case.pauses)
            del cases
    floor_us = statistics.median(floor_samples_ns) / 1000.0
    figures["floor_us_per_request"] = round(floor_us, 4)
    hot_floor_us = statistics.median(hot_floor_samples_ns) / 1000.0
    figures["floor_hot_us_per_request"] = round(hot_floor_us, 4)
    for (pressure, policy, size), (cost_us, pauses) in results.items():
        pool = "pressure" if pressure else "roomy"
        key = f"{policy.name}_{pool}_{size}"
        figures[f"{key}_us_per_request"] = round(cost_us, 4)
        figures[f"{key}_pauses"] = pauses
        rows.append([policy.name, pool, size, cost_us, cost_us / floor_us, cost_us / hot_floor_us, pauses])

    print(f"floor {floor_us * 1000:.1f} ns/request (after the steps), {hot_floor_us * 1000:.1f} ns hot")
    print_table(["policy", "pool", "requests", "us/request/step", "x floor", "x hot floor", "pauses"], rows)
    largest, smallest = max(sizes), min(sizes)
    targets: dict[str, Target] = {}
    for pressure in ("roomy", "pressure"):
        for policy in policies:
            at_large = figures[f"{policy.name}_{pressure}_{largest}_us_per_request"]
            at_small = figures[f"{policy.name}_{pressure}_{smallest}_us_per_request"]
            targets[f"{policy.name}_{pressure}_{largest}_x_floor"] = Target(at_large / floor_us, 30.0, False)
            targets[f"{policy.name}_{pressure}_{largest}_vs_{smallest}"] = Target(at_large / at_small, 1.3, False)
    emit_result("scheduler_bench", figures, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
