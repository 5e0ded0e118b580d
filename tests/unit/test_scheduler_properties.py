"""Property tests of the scheduler and block manager over random request mixes and many steps."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler.block_manager import BlockManager, BlockManagerConfig
from scheduler.config import (
    CapacitySchedulerPolicy,
    ChunkingConfig,
    ContextChunkingPolicy,
    SchedulerConfig,
)
from scheduler.request import LlmRequest
from scheduler.scheduler import TwoLevelScheduler
from scheduler.simulation import SimulatedExecutor, synthetic_token
from scheduler.state import LlmRequestState

S = LlmRequestState


@dataclass(frozen=True)
class Spec:
    arrival_step: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    disagg: bool


@st.composite
def scenarios(draw, policies=tuple(CapacitySchedulerPolicy), tight: bool = False):
    tpb = draw(st.sampled_from([2, 4, 8]))
    policy = draw(st.sampled_from(list(policies)))
    reuse = draw(st.booleans())
    chunk_policy = draw(st.sampled_from([None, *ContextChunkingPolicy]))
    unit = tpb * draw(st.integers(1, 3))
    max_len = draw(st.integers(4, 40))  # longest prompt + output of any request
    # A pool that holds at least one maximal request (else nothing could ever run) and at most a few.
    min_blocks = -(-max_len // tpb) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks + 2 if tight else min_blocks * 4))
    prefixes = [tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=16))) for _ in range(2)]
    specs = []
    for _ in range(draw(st.integers(4 if tight else 1, 12))):
        prefix = draw(st.sampled_from(prefixes))
        tail = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=16)))
        prompt = (prefix + tail)[: max_len - 1] or (1,)
        room = max(1, max_len - len(prompt))
        max_new = draw(st.integers(max(1, room // 2) if tight else 1, room))
        disagg = policy is not CapacitySchedulerPolicy.STATIC_BATCH and draw(st.booleans()) and draw(st.booleans())
        specs.append(Spec(draw(st.integers(0, 2 if tight else 6)), prompt, max_new, disagg))
    # Unchunked, a paused request comes back with prompt + generated tokens as its context, so
    # the token budget must hold a whole sequence or it could never be scheduled again.
    unchunked_ok = max_len
    max_num_tokens = draw(st.one_of(st.none(), st.integers(max(unit, unchunked_ok) if chunk_policy is None else unit, 64)))
    config = SchedulerConfig(
        max_num_requests=draw(st.integers(1, 8)),
        max_batch_size=draw(st.integers(1, 8)),
        max_num_tokens=max_num_tokens,
        capacity_policy=policy,
        chunking=None if chunk_policy is None else ChunkingConfig(chunk_policy, unit),
    )
    kv_config = BlockManagerConfig(
        tokens_per_block=tpb, num_blocks=num_blocks, max_attention_window=max_len + tpb, enable_block_reuse=reuse
    )
    return config, kv_config, specs


def _expected_tokens(request_id: int, spec: Spec) -> list[int]:
    tokens = list(spec.prompt)
    for position in range(len(spec.prompt), len(spec.prompt) + spec.max_new_tokens):
        tokens.append(synthetic_token(request_id, position))
    return tokens


def _run(scenario) -> tuple[int, int]:
    """Run a scenario to completion, asserting the invariants; returns (pauses, reused blocks)."""
    config, kv_config, specs = scenario
    kv = BlockManager(kv_config)
    scheduler = TwoLevelScheduler(config, kv)
    executor = SimulatedExecutor(kv)
    active: list[LlmRequest] = []
    finished: dict[int, LlmRequest] = {}
    total_work = sum(len(s.prompt) + s.max_new_tokens for s in specs)
    step_bound = 10 * total_work + 50
    step = 0
    while len(finished) < len(specs):
        assert step < step_bound, f"no progress after {step} steps: {active}"
        for request_id, spec in enumerate(specs):
            if spec.arrival_step == step:
                state = S.DISAGG_GENERATION_INIT if spec.disagg else None
                active.append(LlmRequest(request_id, spec.prompt, spec.max_new_tokens, state=state))
        for request in executor.receive_all(active):
            finished[request.request_id] = request
        output = scheduler.schedule(active)
        # Admission must guarantee that this step's allocations succeed (never over-committed).
        executor.prepare(output)
        kv.check_integrity()
        assert kv.num_used_blocks <= kv.num_blocks
        if config.capacity_policy is not CapacitySchedulerPolicy.MAX_UTILIZATION:
            assert not output.paused
        assert len(output.context) + len(output.generation) <= config.max_batch_size
        for request in executor.complete(output):
            finished[request.request_id] = request
        kv.check_integrity()
        active = [r for r in active if r.state is not S.GENERATION_COMPLETE]
        step += 1

    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    assert not list(kv.iter_sequences())
    for request_id, spec in enumerate(specs):
        request = finished[request_id]
        # Paused requests are recomputed: the final tokens equal an unpaused run's.
        assert request.tokens[0] == _expected_tokens(request_id, spec)
        assert request.tokens[0][: request.orig_prompt_len] == list(spec.prompt)
    return executor.num_pauses, kv.num_reused_blocks


@settings(max_examples=150)
@given(scenarios())
def test_random_mixes_never_overcommit_leak_or_lose_tokens(scenario) -> None:
    _run(scenario)


PAUSES_SEEN: list[int] = []


@settings(max_examples=120)
@given(scenarios(policies=(CapacitySchedulerPolicy.MAX_UTILIZATION,), tight=True))
def test_max_utilization_under_pressure_terminates_and_recomputes_exactly(scenario) -> None:
    pauses, _ = _run(scenario)
    PAUSES_SEEN.append(pauses)


def test_the_pressure_scenarios_really_pause() -> None:
    # Guards the test above against silently exercising nothing: its examples must pause often.
    if not PAUSES_SEEN:
        test_max_utilization_under_pressure_terminates_and_recomputes_exactly()
    assert sum(PAUSES_SEEN) >= 50, PAUSES_SEEN
    assert sum(1 for p in PAUSES_SEEN if p) >= 20


@settings(max_examples=60)
@given(
    st.integers(2, 8),
    st.sampled_from([12, 64]),  # small pools evict published blocks (unpublishing)
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), min_size=1, max_size=20),
    st.data(),
)
def test_block_manager_random_operations_keep_integrity(tpb, num_blocks, ops, data) -> None:
    kv = BlockManager(
        BlockManagerConfig(tokens_per_block=tpb, num_blocks=num_blocks, max_attention_window=256, enable_block_reuse=True)
    )
    live: dict[int, LlmRequest] = {}
    # Prompts that never join (one random, one copy of each joining prompt, walked before that one
    # publishes): their walks of the tree stay cached on them across the operations and must always
    # equal a fresh walk (a cached walk that missed a change would mis-credit reuse).
    probes = [LlmRequest(-1, data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=30)), 8)]
    next_id = 0
    for kind, length in ops:
        length = min(length, num_blocks // 2 * tpb)  # so that small pools fill up and evict
        if kind == 0 and kv.num_free_blocks >= -(-length // tpb) + 1:
            prompt = data.draw(st.lists(st.integers(0, 2), min_size=length, max_size=length))
            request = LlmRequest(next_id, prompt, 8)
            probes.append(LlmRequest(-2 - next_id, prompt, 8))
            kv.add_sequence(request)
            live[next_id] = request
            next_id += 1
        elif kind == 1 and live:
            request = live[data.draw(st.sampled_from(sorted(live)))]
            kv.store_context_blocks(request)
        elif kind == 2 and live and kv.num_free_blocks > 0:
            kv.add_token(data.draw(st.sampled_from(sorted(live))))
        elif kind == 3 and live:
            request_id = data.draw(st.sampled_from(sorted(live)))
            kv.remove_sequence(request_id)
            del live[request_id]
        kv.check_integrity()
        kv.start_scheduling()
        assert kv.scheduling_free_blocks == kv.num_free_blocks
        for probe in probes:
            fresh = LlmRequest(probe.request_id, probe.tokens[0], 8)
            assert kv._matched(probe) == kv._matched(fresh)
            assert kv.find_new_context_block(probe) == kv.find_new_context_block(fresh)
            assert kv.first_chunk_admission(probe) == kv.first_chunk_admission(fresh)
    for request_id in list(live):
        kv.remove_sequence(request_id)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


@settings(max_examples=80)
@given(scenarios(), scenarios(policies=(CapacitySchedulerPolicy.MAX_UTILIZATION,), tight=True))
def test_hot_paths_schedule_exactly_like_the_general_path(mixed, pressured) -> None:
    """The inlined fast paths (and TwoLevelScheduler's decode-only shortcut, off with them) must be
    pure optimisations: step-by-step identical schedules."""
    from scheduler.capacity import CapacityScheduler
    from scheduler.microbatch import MicroBatchScheduler

    for scenario in (mixed, pressured):
        traces = []
        for hot in (True, False):
            CapacityScheduler.use_hot_paths = hot
            MicroBatchScheduler.use_hot_paths = hot
            try:
                traces.append(_trace(scenario))
            finally:
                CapacityScheduler.use_hot_paths = True
                MicroBatchScheduler.use_hot_paths = True
        assert traces[0] == traces[1]


def _trace(scenario) -> list[tuple]:
    config, kv_config, specs = scenario
    kv = BlockManager(kv_config)
    scheduler = TwoLevelScheduler(config, kv)
    executor = SimulatedExecutor(kv)
    active: list[LlmRequest] = []
    trace = []
    done = 0
    for step in range(10 * sum(len(s.prompt) + s.max_new_tokens for s in specs) + 50):
        if done == len(specs):
            break
        for request_id, spec in enumerate(specs):
            if spec.arrival_step == step:
                state = S.DISAGG_GENERATION_INIT if spec.disagg else None
                active.append(LlmRequest(request_id, spec.prompt, spec.max_new_tokens, state=state))
        done += len(executor.receive_all(active))
        output = scheduler.schedule(active)
        trace.append(
            (
                [(r.request_id, r.context_chunk_size) for r in output.context],
                [r.request_id for r in output.generation],
                [r.request_id for r in output.disagg_generation_init],
                [r.request_id for r in output.paused],
                output.num_tokens,
                output.num_admitted,
            )
        )
        executor.prepare(output)
        done += len(executor.complete(output))
        active = [r for r in active if r.state is not S.GENERATION_COMPLETE]
    return trace


def _first_come_first_served_reference(requests, capacity, unit, max_context_length) -> None:
    """FIRST_COME_FIRST_SERVED as TensorRT-LLM's microBatchScheduler.cpp computes it
    (setCtxRequestsChunkSize for kFIRST_COME_FIRST_SERVED), with no shortcut (the chunks start at 0)."""
    from scheduler.chunking import reusable_tokens

    for request in requests:
        want = request.context_remaining_length
        reusable = reusable_tokens(request)
        compute = max(0, want - reusable)
        if capacity is not None and capacity <= 0 and compute > 0:
            continue
        chunk = want
        if capacity is not None and compute > capacity:
            chunk = capacity
        if max_context_length is not None and max(0, chunk - reusable) > max_context_length:
            chunk = min(reusable + max_context_length, want)
        if chunk != want:
            chunk = chunk // unit * unit
        request.set_context_chunk_size(chunk)
        if capacity is not None:
            capacity -= min(request.context_chunk_size, compute)


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.integers(1, 200), st.integers(0, 199), st.booleans(), st.integers(0, 200)), min_size=1, max_size=8),
    st.one_of(st.none(), st.integers(0, 400)),  # the micro-batch never passes a negative budget
    st.sampled_from([1, 4, 16, 64]),
    st.one_of(st.none(), st.integers(1, 300)),
)
def test_first_come_first_served_skips_only_what_would_get_nothing(shapes, capacity, unit, max_context_length) -> None:
    from scheduler.chunking import first_come_first_served

    chunks = []
    for policy in (first_come_first_served, _first_come_first_served_reference):
        requests = []
        for prompt_len, position, first, reusable in shapes:
            request = LlmRequest(len(requests), [1] * prompt_len, 4)
            request.context_current_position = min(position, prompt_len - 1)
            request.prepopulated_prompt_len = request.context_current_position if first else 0
            request.estimated_reusable_tokens = min(reusable, prompt_len - 1)
            request.context_chunk_size = 0
            requests.append(request)
        policy(requests, capacity, unit, max_context_length)
        chunks.append([r.context_chunk_size for r in requests])
    assert chunks[0] == chunks[1]


@st.composite
def micro_batch_inputs(draw):
    """A fitting list of plain generating requests in runs, between other requests: generating ones
    with two beams, draft tokens or a LoRA task, and prompts; some ids in flight."""
    kinds = []
    for run, other in draw(st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["beams", "draft", "lora", "prompt"])), max_size=5)):
        kinds += ["plain"] * run + [other]
    kinds += ["plain"] * draw(st.integers(0, 6))
    inflight = frozenset()
    if kinds and draw(st.integers(0, 3)) == 0:  # (runs are taken whole only when nothing is in flight)
        inflight = frozenset(draw(st.sets(st.integers(0, len(kinds) - 1), max_size=4)))
    max_batch_size = draw(st.integers(1, 30))
    max_num_tokens = draw(st.one_of(st.none(), st.integers(1, 12), st.integers(1, 60)))
    return kinds, inflight, max_batch_size, max_num_tokens


def _micro_batch_requests(kinds) -> tuple[list[LlmRequest], list[int]]:
    requests = []
    non_plain = []
    for index, kind in enumerate(kinds):
        request = LlmRequest(
            index,
            [1 + index % 5] * (3 + index % 7),
            8,
            beam_width=2 if kind == "beams" else 1,
            num_draft_tokens=2 if kind == "draft" else 0,
            lora_task_id=index % 3 if kind == "lora" else None,
        )
        if kind != "prompt":
            request.context_current_position = request.prompt_len
            request.set_state(S.GENERATION_IN_PROGRESS)
        if kind != "plain":
            non_plain.append(index)
        requests.append(request)
    return requests, non_plain


@settings(max_examples=300)
@given(micro_batch_inputs())
# The budget spent by a batch of another beam width: the run after it ends the batch.
@example((["beams", "plain", "prompt"], frozenset(), 10, 2))
# A run wholly in flight sets no beam width: the two-beam request after it still joins.
@example((["plain", "beams"], frozenset({0}), 10, None))
def test_micro_batch_takes_runs_of_plain_generation_exactly_as_one_by_one(inputs) -> None:
    from scheduler.microbatch import MicroBatchScheduler

    kinds, inflight, max_batch_size, max_num_tokens = inputs
    micro = MicroBatchScheduler(chunking=ChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, 4))
    batches = []
    for with_positions in (True, False):
        requests, non_plain = _micro_batch_requests(kinds)
        batch = micro.schedule(
            requests, inflight, max_batch_size, max_num_tokens, non_plain if with_positions else None
        )
        batches.append(
            (
                [r.request_id for r in batch.context],
                [r.request_id for r in batch.generation],
                batch.num_tokens,
                [r.context_chunk_size for r in requests],  # the prompts the batch reached, and only those, are reset
            )
        )
    assert batches[0] == batches[1]
