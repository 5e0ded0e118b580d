"""Focused tests of the scheduler's parts: typed errors, states, pause, chunking with snapshot points."""

from __future__ import annotations

import hashlib
import struct

import pytest

from scheduler import block_hash
from scheduler.block_hash import PrefixEventKind, block_hash_chain, memoise_prompts
from scheduler.block_manager import BlockManager, BlockManagerConfig
from scheduler.capacity import MaxUtilizationScheduler
from scheduler.chunking import chunk_contexts
from scheduler.config import (
    CapacitySchedulerPolicy,
    ChunkingConfig,
    ContextChunkingPolicy,
    ReorderPolicy,
    SchedulerConfig,
)
from scheduler.errors import BlockAccountingError, IllegalStateTransition, InvalidFieldError, OutOfBlocksError
from scheduler.ordering import insert_by_priority, priority_order
from scheduler.request import LlmRequest
from scheduler.scheduler import TwoLevelScheduler
from scheduler.state import TRANSITIONS, LlmRequestState

S = LlmRequestState


# --- typed errors naming the field ------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"beam_width": 0}, "beam_width"),
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"priority": 1.5}, "priority"),
        ({"lora_task_id": -2}, "lora_task_id"),
        ({"snapshot_points": (4, 2)}, "snapshot_points"),
        ({"snapshot_points": (99,)}, "snapshot_points"),
        ({"encoder_input_len": 0}, "encoder_input_len"),
    ],
)
def test_bad_request_fields_raise_typed_errors(kwargs, field) -> None:
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(InvalidFieldError) as error:
        LlmRequest(1, [1, 2, 3, 4, 5, 6], **args)
    assert error.value.field == field


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(InvalidFieldError, match="prompt_token_ids"):
        LlmRequest(1, [], 4)


def test_negative_chunk_size_is_rejected() -> None:
    request = LlmRequest(1, [1] * 10, 4)
    with pytest.raises(InvalidFieldError, match="context_chunk_size"):
        request.set_context_chunk_size(-1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_requests": 0}, "max_num_requests"),
        ({"max_batch_size": -1}, "max_batch_size"),
        ({"max_num_tokens": 0}, "max_num_tokens"),
        ({"max_context_length": 0}, "max_context_length"),
        ({"capacity_policy": "MAX_UTILIZATION"}, "capacity_policy"),
        (
            {"chunking": ChunkingConfig(ContextChunkingPolicy.FORCE_CHUNK, 64), "max_context_length": 32},
            "max_context_length",
        ),
    ],
)
def test_bad_scheduler_config_raises_typed_errors(kwargs, field) -> None:
    args = {"max_num_requests": 4, "max_batch_size": 4, **kwargs}
    with pytest.raises(InvalidFieldError) as error:
        SchedulerConfig(**args)
    assert error.value.field == field


def test_unknown_policy_names_are_typed_errors() -> None:
    with pytest.raises(InvalidFieldError) as error:
        CapacitySchedulerPolicy.parse("FASTEST")
    assert error.value.field == "capacity_policy"
    with pytest.raises(InvalidFieldError) as error:
        ContextChunkingPolicy.parse("HALF")
    assert error.value.field == "chunking.policy"
    with pytest.raises(InvalidFieldError):
        ChunkingConfig(ContextChunkingPolicy.EQUAL_PROGRESS, 0)
    assert CapacitySchedulerPolicy.parse("max_utilization") is CapacitySchedulerPolicy.MAX_UTILIZATION


def test_chunk_unit_must_be_a_block_multiple() -> None:
    kv = BlockManager(BlockManagerConfig(tokens_per_block=16, num_blocks=8, max_attention_window=128))
    config = SchedulerConfig(4, 4, chunking=ChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, 24))
    with pytest.raises(InvalidFieldError) as error:
        TwoLevelScheduler(config, kv)
    assert error.value.field == "chunking.unit_size"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"num_blocks": -1}, "num_blocks"),
        ({"sink_token_len": -1}, "sink_token_len"),
        ({"is_cross_attention": True, "enable_block_reuse": True}, "enable_block_reuse"),
    ],
)
def test_bad_block_manager_config(kwargs, field) -> None:
    args = {"tokens_per_block": 4, "num_blocks": 8, "max_attention_window": 64, **kwargs}
    with pytest.raises(InvalidFieldError) as error:
        BlockManagerConfig(**args)
    assert error.value.field == field


# --- states ------------------------------------------------------------------------------------
def test_numeric_values_match_tensorrt_llm() -> None:
    assert S.CONTEXT_INIT == 10 and S.GENERATION_IN_PROGRESS == 13 and S.DISAGG_TRANS_ERROR == -1
    assert S.DISAGG_GENERATION_INIT == 8 and S.DISAGG_CONTEXT_TRANS_IN_PROGRESS == 21
    assert all(state in TRANSITIONS for state in S)


def test_predicates() -> None:
    assert S.CONTEXT_INIT.is_context_init and S.DISAGG_CONTEXT_INIT_AND_TRANS.is_context_init
    assert S.DISAGG_GENERATION_TRANS_COMPLETE.is_generation_in_progress
    assert S.GENERATION_TO_COMPLETE.is_generation_in_progress
    assert not S.GENERATION_COMPLETE.is_generation_in_progress
    assert S.DISAGG_CONTEXT_TRANS_IN_PROGRESS.is_finished and S.GENERATION_COMPLETE.is_finished
    assert S.DISAGG_CONTEXT_INIT_AND_TRANS.is_context_finished
    assert S.GENERATION_COMPLETE.is_terminal and S.DISAGG_TRANS_ERROR.is_terminal
    assert not S.CONTEXT_INIT.is_terminal


def test_illegal_transitions_are_refused() -> None:
    request = LlmRequest(1, [1, 2, 3], 4)
    with pytest.raises(IllegalStateTransition):
        request.set_state(S.DISAGG_GENERATION_TRANS_COMPLETE)
    request.set_state(S.GENERATION_IN_PROGRESS)
    request.set_state(S.GENERATION_COMPLETE)
    with pytest.raises(IllegalStateTransition):
        request.set_state(S.GENERATION_IN_PROGRESS)


# --- pause -------------------------------------------------------------------------------------
def test_pause_beam_width_one_turns_generated_tokens_into_prompt() -> None:
    request = LlmRequest(1, [5, 6, 7], 10)
    request.set_state(S.GENERATION_IN_PROGRESS)
    request.context_current_position = 3
    for token in (8, 9, 10, 11):
        request.add_new_token(token)
    request.pause(max_input_len=1000)
    assert request.state is S.CONTEXT_INIT
    assert request.prompt_len == 7 and request.max_new_tokens == 6
    assert request.tokens[0] == [5, 6, 7, 8, 9, 10, 11]
    assert request.context_chunk_size == 7 and request.context_current_position == 0
    # Capped by max_input_len: the rest is discarded and will be regenerated.
    request.set_state(S.GENERATION_IN_PROGRESS)
    request.add_new_token(12)
    request.pause(max_input_len=5)
    assert request.prompt_len == 5 and request.tokens[0] == [5, 6, 7, 8, 9] and request.max_new_tokens == 8


def test_pause_beam_search_discards_generated_tokens() -> None:
    request = LlmRequest(1, [5, 6, 7], 10, beam_width=3)
    request.set_state(S.GENERATION_IN_PROGRESS)
    request.add_new_tokens([1, 2, 3])
    request.add_new_tokens([4, 5, 6])
    request.pause(max_input_len=1000)
    assert request.prompt_len == 3 and request.max_new_tokens == 10
    assert request.tokens == [[5, 6, 7]] * 3


def test_pause_of_encoder_request_returns_to_encoder_init() -> None:
    request = LlmRequest(1, [1, 2], 4, encoder_input_len=6)
    assert request.state is S.ENCODER_INIT
    request.set_state(S.CONTEXT_INIT)
    request.set_state(S.GENERATION_IN_PROGRESS)
    request.pause(1000)
    assert request.state is S.ENCODER_INIT


# --- FORCE_CHUNK with snapshot points (our rule, from the newest TensorRT-LLM) ------------------
def _context(prompt_len: int, points=()) -> LlmRequest:
    return LlmRequest(1, [0] * prompt_len, 1, snapshot_points=points)


def test_force_chunk_ends_each_chunk_at_the_next_snapshot_point() -> None:
    request = _context(100, points=(30, 45, 80))
    chunks = []
    while request.context_remaining_length:
        chunk_contexts([request], ContextChunkingPolicy.FORCE_CHUNK, None, 16, None)
        chunks.append(request.context_chunk_size)
        request.move_to_next_context_chunk()
    assert chunks == [30, 15, 35, 20]  # 0->30, 30->45, 45->80, 80->end


def test_force_chunk_snapshot_chunk_capped_by_max_context_length_and_capacity() -> None:
    request = _context(100, points=(90,))
    chunk_contexts([request], ContextChunkingPolicy.FORCE_CHUNK, None, 16, 50)
    assert request.context_chunk_size == 48  # largest unit multiple within max_context_length
    request = _context(100, points=(90,))
    chunk_contexts([request], ContextChunkingPolicy.FORCE_CHUNK, 40, 16, None)
    assert request.context_chunk_size == 32  # capacity overflow rounded down to a unit multiple
    request = _context(100, points=(90,))
    chunk_contexts([request], ContextChunkingPolicy.FORCE_CHUNK, 10, 16, None)
    assert request.context_chunk_size == 0


def test_force_chunk_without_points_keeps_the_cpp_rule_next_to_snapshot_requests() -> None:
    plain = LlmRequest(2, [0] * 25, 1)
    snap = _context(40, points=(20,))
    chunk_contexts([snap, plain], ContextChunkingPolicy.FORCE_CHUNK, 25, 10, None)
    assert snap.context_chunk_size == 20
    assert plain.context_chunk_size == 0  # 20 + 10 would overflow 25: all or nothing


# --- ordering ------------------------------------------------------------------------------------
def test_priority_insertion_and_reorder_hook() -> None:
    active: list[LlmRequest] = []
    for request_id, priority in [(0, 0.5), (1, 0.9), (2, 0.5), (3, 0.1), (4, 0.9)]:
        insert_by_priority(active, LlmRequest(request_id, [1], 1, priority=priority))
    assert [r.request_id for r in active] == [1, 4, 0, 2, 3]
    by_id = {r.request_id: r for r in active}
    shuffled = [by_id[i] for i in (4, 2, 0, 3, 1)]
    # Stable: equal priorities keep their order in the list given.
    assert [r.request_id for r in priority_order(shuffled)] == [4, 1, 2, 0, 3]


def test_priority_reorder_changes_admission() -> None:
    kv = BlockManager(BlockManagerConfig(tokens_per_block=4, num_blocks=2, max_attention_window=64))
    low = LlmRequest("low", [1] * 6, 2, priority=0.1)
    high = LlmRequest("high", [2] * 6, 2, priority=0.9)
    fifo = TwoLevelScheduler(SchedulerConfig(4, 4), kv).schedule([low, high])
    assert [r.request_id for r in fifo.context] == ["low"]
    ranked = TwoLevelScheduler(SchedulerConfig(4, 4, reorder=ReorderPolicy.PRIORITY), kv).schedule([low, high])
    assert [r.request_id for r in ranked.context] == ["high"]


def test_the_schedule_counts_what_the_capacity_scheduler_admitted() -> None:
    # max_num_requests 2 of 3 prompts that all fit: two admitted; a batch of 1 runs only one of them.
    kv = BlockManager(BlockManagerConfig(tokens_per_block=4, num_blocks=16, max_attention_window=64))
    active = [LlmRequest(f"r{i}", [i + 1] * 6, 2) for i in range(3)]
    output = TwoLevelScheduler(SchedulerConfig(2, 1), kv).schedule(active)
    assert [r.request_id for r in output.context] == ["r0"] and output.num_admitted == 2
    assert TwoLevelScheduler(SchedulerConfig(8, 8), kv).schedule(active).num_admitted == 3


# --- block manager -----------------------------------------------------------------------------
def _chain_block_by_block(tokens: list[int], tpb: int, lora: int | None) -> list[int]:
    """The chain as scheduler/block_hash.py defines it, computed here without its memo."""
    parent = hashlib.blake2b(b"duet-block-v1" + (b"none" if lora is None else struct.pack("<q", lora)), digest_size=8).digest()
    hashes = []
    for start in range(0, len(tokens) - len(tokens) % tpb, tpb):
        parent = hashlib.blake2b(parent + struct.pack(f"<{tpb}q", *tokens[start : start + tpb]), digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


@pytest.fixture
def prompt_memo():
    """Prompts memoised as the simulator keeps them (a fresh memo), none again afterwards."""
    memoise_prompts(64)
    yield
    memoise_prompts(0)


@pytest.mark.parametrize("memoised", [False, True])
def test_prompt_chain_is_the_block_by_block_chain(memoised: bool) -> None:
    memoise_prompts(64 if memoised else 0)
    try:
        prompt = list(range(100, 139))
        for lora in (None, 3):
            expected = _chain_block_by_block(prompt, 4, lora)
            assert block_hash_chain(prompt, 4, lora) == expected  # first: computed
            assert block_hash_chain(tuple(prompt), 4, lora) == expected  # then: from the memo, if kept
            assert block_hash_chain(prompt[:17], 4, lora) == expected[:4]  # another prompt, its own entry
        assert block_hash_chain(prompt, 4) != block_hash_chain(prompt, 4, 3)
    finally:
        memoise_prompts(0)


def test_published_blocks_carry_the_chain_of_their_prompt_memoised_or_not() -> None:
    """A block manager's events name the blocks it publishes by the prompt's chain, whether another
    user of the memo (the router) hashed that prompt first or not."""
    prompt = list(range(200, 229))
    expected = _chain_block_by_block(prompt, 4, None)
    for hashed_first, memo_size in ((False, 0), (False, 64), (True, 64)):
        memoise_prompts(memo_size)
        if hashed_first:
            block_hash_chain(tuple(prompt), 4)
        kv = BlockManager(
            BlockManagerConfig(tokens_per_block=4, num_blocks=32, max_attention_window=64, enable_block_reuse=True, record_events=True)
        )
        shared = LlmRequest(1, prompt[:12], 4)
        kv.add_sequence(shared)
        kv.store_context_blocks(shared)
        longer = LlmRequest(2, prompt, 4)
        kv.add_sequence(longer)
        kv.store_context_blocks(longer)  # publishes only the blocks after the shared ones
        stored = [e.block_hash for e in kv.drain_events()]
        assert stored == expected[:2] + expected[2:7]
        assert sorted(kv.cached_block_hashes()) == sorted(expected[:7])
    memoise_prompts(0)


def test_prefix_reuse_events_use_the_shared_block_hashes() -> None:
    kv = BlockManager(
        BlockManagerConfig(tokens_per_block=4, num_blocks=16, max_attention_window=64, enable_block_reuse=True, record_events=True)
    )
    prompt = list(range(13))
    first = LlmRequest(1, prompt, 4, lora_task_id=None)
    kv.add_sequence(first)
    kv.store_context_blocks(first)
    events = kv.drain_events()
    assert [e.kind for e in events] == [PrefixEventKind.STORED] * 3
    assert [e.block_hash for e in events] == block_hash_chain(prompt, 4)
    second = LlmRequest(2, prompt[:9] + [99, 98, 97], 4)
    assert kv.add_sequence(second) == 8  # two full blocks shared
    assert second.context_current_position == 8
    kv.remove_sequence(1)
    kv.remove_sequence(2)
    assert kv.num_free_blocks == 16 and kv.num_cached_free_blocks == 3
    kv.check_integrity()


def test_cached_blocks_are_evicted_only_for_fresh_allocations() -> None:
    kv = BlockManager(
        BlockManagerConfig(tokens_per_block=2, num_blocks=4, max_attention_window=64, enable_block_reuse=True, record_events=True)
    )
    first = LlmRequest(1, [1, 2, 3, 4, 5], 1)
    kv.add_sequence(first)
    kv.store_context_blocks(first)
    kv.remove_sequence(1)
    kv.drain_events()
    assert kv.num_free_blocks == 4 and kv.num_cached_free_blocks == 2
    # A sequence that needs every block evicts the cached ones (and says so).
    big = LlmRequest(2, [9] * 8, 1)
    kv.add_sequence(big)
    assert kv.num_free_blocks == 0
    assert sorted(e.kind.value for e in kv.drain_events()) == ["removed", "removed"]
    with pytest.raises(OutOfBlocksError):
        kv.add_sequence(LlmRequest(3, [1], 1))
    kv.check_integrity()


def test_a_cached_walk_of_the_prefix_tree_follows_every_change_of_the_tree() -> None:
    """A waiting prompt's walk stays cached across steps; extension, eviction and a new LoRA root
    must each show in its next admission figures, exactly as a fresh walk would give them."""
    kv = BlockManager(BlockManagerConfig(tokens_per_block=2, num_blocks=6, max_attention_window=64, enable_block_reuse=True))

    def fresh(request: LlmRequest) -> tuple:
        return kv.first_chunk_admission(
            LlmRequest(request.request_id, request.tokens[0], request.max_new_tokens, lora_task_id=request.lora_task_id)
        )

    other = LlmRequest(0, [7, 7, 7], 1)  # publishes an unrelated block: the root exists
    kv.add_sequence(other)
    kv.store_context_blocks(other)
    kv.remove_sequence(0)
    waiting = LlmRequest(10, [1, 2, 3, 4, 5], 1)
    waiting_lora = LlmRequest(11, [1, 2, 3, 4, 5], 1, lora_task_id=7)
    before = kv.first_chunk_admission(waiting)
    assert kv.first_chunk_admission(waiting_lora)[1:] == (3, 0)  # 3 blocks, nothing to reuse, no root
    # Extension: another request publishes the same prefix.
    first = LlmRequest(1, [1, 2, 3, 4, 9], 1)
    kv.add_sequence(first)
    kv.store_context_blocks(first)
    extended = kv.first_chunk_admission(waiting)
    assert extended != before and extended == fresh(waiting)
    assert extended[1:] == (1, 2)  # both full blocks held by `first`: one block to allocate
    # Eviction: `first` leaves, its published blocks are cached-free, then a big prompt evicts them.
    kv.remove_sequence(1)
    assert kv.first_chunk_admission(waiting) == fresh(waiting)
    kv.add_sequence(LlmRequest(2, [9] * 12, 1))
    evicted = kv.first_chunk_admission(waiting)
    assert evicted == fresh(waiting) and evicted[1:] == (3, 0)
    # A new root: the LoRA task's first publication.
    kv.remove_sequence(2)
    lora_first = LlmRequest(3, [1, 2, 3, 4, 9], 1, lora_task_id=7)
    kv.add_sequence(lora_first)
    kv.store_context_blocks(lora_first)
    assert kv.first_chunk_admission(waiting_lora) == fresh(waiting_lora)
    assert kv.first_chunk_admission(waiting_lora)[1:] == (1, 2)


@pytest.mark.parametrize("policy", [CapacitySchedulerPolicy.MAX_UTILIZATION, CapacitySchedulerPolicy.GUARANTEED_NO_EVICT])
def test_a_duplicate_behind_a_running_chunked_prefill_waits_for_all_its_chunks(policy) -> None:
    """TensorRT-LLM's prefix-aware skipping (capacityScheduler.cpp): C holds the running chunked
    prefill's key, whichever side of the duplicate it is on in the list (MAX_UTILIZATION notes the
    ones before the duplicate and scans the rest)."""
    from scheduler.simulation import SimulatedExecutor

    kv = BlockManager(BlockManagerConfig(tokens_per_block=4, num_blocks=64, max_attention_window=64, enable_block_reuse=True))
    config = SchedulerConfig(
        max_num_requests=8,
        max_batch_size=8,
        max_num_tokens=16,
        max_context_length=8,  # leaves the duplicate budget to start with, were it not skipped
        capacity_policy=policy,
        chunking=ChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, 4),
    )
    scheduler = TwoLevelScheduler(config, kv)
    executor = SimulatedExecutor(kv)
    prompt = list(range(1, 33))  # chunks of at most 8: 4 steps of prefill
    running = LlmRequest("running", prompt, 4)
    before = LlmRequest("before", [7] * 8, 4)  # unrelated, ahead of both in the list
    active = [before, running]
    steps_with_duplicate = 0
    for step in range(10):
        if running.state is LlmRequestState.GENERATION_IN_PROGRESS:
            break
        if running.context_current_position > 0 and len(active) == 2:
            active.append(LlmRequest("duplicate", prompt, 4))
        output = scheduler.schedule(active)
        ids = [r.request_id for r in output.context]
        assert "duplicate" not in ids, f"step {step}: {ids}"
        steps_with_duplicate += len(active) == 3
        executor.prepare(output)
        executor.complete(output)
    assert running.state is LlmRequestState.GENERATION_IN_PROGRESS and steps_with_duplicate >= 2
    output = scheduler.schedule(active)
    assert "duplicate" in [r.request_id for r in output.context]
    assert active[-1].estimated_reusable_tokens == 28  # the 7 full blocks of its first 31 tokens


def test_add_sequence_failure_leaves_nothing_allocated() -> None:
    kv = BlockManager(BlockManagerConfig(tokens_per_block=4, num_blocks=2, max_attention_window=64))
    with pytest.raises(OutOfBlocksError):
        kv.add_sequence(LlmRequest(1, [1] * 12, 1))
    assert kv.num_free_blocks == 2
    kv.check_integrity()


def test_scheduling_snapshot_counts_shared_blocks_once() -> None:
    kv = BlockManager(BlockManagerConfig(tokens_per_block=2, num_blocks=8, max_attention_window=64, enable_block_reuse=True))
    base = LlmRequest(1, [1, 2, 3, 4, 5], 4)
    kv.add_sequence(base)
    kv.store_context_blocks(base)
    twin = LlmRequest(2, [1, 2, 3, 4, 6], 4)
    kv.add_sequence(twin)  # shares two blocks with `base`
    kv.start_scheduling()
    free = kv.scheduling_free_blocks
    kv.scheduling_remove_sequence(2)
    assert kv.scheduling_free_blocks == free + 1  # only its own last block
    kv.scheduling_remove_sequence(1)
    assert kv.scheduling_free_blocks == free + 4
    assert kv.num_free_blocks == free  # the real counts are untouched


def test_max_utilization_pause_loop_is_linear_in_requests() -> None:
    # Every generating request needs a block this step and none is free: the loop evicts from the
    # tail; it must finish and visit each request a bounded number of times.
    tpb = 2
    kv = BlockManager(BlockManagerConfig(tokens_per_block=tpb, num_blocks=200, max_attention_window=64))
    active = []
    for request_id in range(200):
        request = LlmRequest(request_id, [1, 2], 8)
        kv.add_sequence(request)
        request.move_to_next_context_chunk()
        request.add_new_token(0)
        request.set_state(S.GENERATION_IN_PROGRESS)
        active.append(request)
    calls = 0
    original = kv.needed_blocks_one_step

    def counting(request):
        nonlocal calls
        calls += 1
        return original(request)

    kv.needed_blocks_one_step = counting  # type: ignore[method-assign]
    output = MaxUtilizationScheduler(1000, kv).schedule(active)
    # Each admission needs the block freed by evicting one request from the tail.
    assert [r.request_id for r in output.fitting] == list(range(100))
    assert [r.request_id for r in output.paused] == list(range(199, 99, -1))
    assert calls <= 2 * len(active)


def test_guaranteed_no_evict_claims_the_decode_of_requests_receiving_kv() -> None:
    """A generation-only request whose blocks are reserved while its KV is in flight
    (DISAGG_GENERATION_TRANS_IN_PROGRESS) is not scheduled, but its decode is guaranteed: a later
    request may not take the blocks it needs once the KV commits (an engine step would then run
    out of blocks)."""
    kv = BlockManager(BlockManagerConfig(tokens_per_block=4, num_blocks=6, max_attention_window=64))
    scheduler = TwoLevelScheduler(SchedulerConfig(max_num_requests=8, max_batch_size=8, max_num_tokens=64), kv)
    receiving = LlmRequest(1, [1] * 8, 8, state=LlmRequestState.DISAGG_GENERATION_INIT)  # 2 context + 2 decode blocks
    first = scheduler.schedule([receiving])
    assert first.disagg_generation_init == [receiving]
    kv.add_sequence(receiving, reuse=False)
    receiving.set_state(LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS)
    waiting = LlmRequest(2, [2] * 8, 8, state=LlmRequestState.DISAGG_GENERATION_INIT)  # needs 4 of the 4 free
    second = scheduler.schedule([receiving, waiting])
    assert second.disagg_generation_init == [], "the 2 decode blocks of the receiving request are claimed"
    small = LlmRequest(3, [3] * 4, 4, state=LlmRequestState.DISAGG_GENERATION_INIT)  # 2 blocks: fits beside the claim
    assert scheduler.schedule([receiving, small]).disagg_generation_init == [small]


@pytest.mark.parametrize(
    ("prompt_len", "max_new", "beam_width", "window", "sink"),
    [(100, 40, 1, 4096, 0), (96, 32, 1, 4096, 0), (1, 1, 1, 4096, 0), (100, 40, 3, 4096, 0), (300, 200, 1, 256, 0), (100, 40, 2, 256, 4)],
)
def test_blocks_at_completion_is_what_a_fresh_request_still_needs(prompt_len, max_new, beam_width, window, sink) -> None:
    kv = BlockManager(
        BlockManagerConfig(tokens_per_block=16, num_blocks=64, max_attention_window=window, sink_token_len=sink, max_beam_width=3)
    )
    request = LlmRequest("r", list(range(1, prompt_len + 1)), max_new, beam_width=beam_width)
    assert kv.blocks_at_completion(request) == kv.remaining_blocks_to_completion(request)


def test_add_token_to_each_is_add_token_for_each_in_order() -> None:
    """The batched decode-step growth allocates the same blocks, in the same order, as one call per request."""
    managers = [BlockManager(BlockManagerConfig(tokens_per_block=4, num_blocks=64, max_attention_window=64)) for _ in range(2)]
    batches = []
    for kv in managers:
        requests = [LlmRequest(i, [1] * (3 + i), 16) for i in range(4)]
        for request in requests:
            kv.add_sequence(request)
        batches.append(requests)
    for _ in range(9):
        for request in batches[0]:
            managers[0].add_token(request.request_id)
        managers[1].add_token_to_each(batches[1])
    for request_id in range(4):
        assert managers[0].block_ids(request_id) == managers[1].block_ids(request_id)
        assert managers[0].num_sequence_tokens(request_id) == managers[1].num_sequence_tokens(request_id)
    with pytest.raises(BlockAccountingError):
        managers[1].add_token_to_each([LlmRequest("unknown", [1], 1)])


def test_receiving_requests_claim_the_same_blocks_on_the_hot_path() -> None:
    """GUARANTEED_NO_EVICT claims the rest of a receiving request's run (its KV in flight) inline for
    plain requests: the same admissions as the general formula, at every pool size around the edge."""
    from scheduler.capacity import CapacityScheduler, GuaranteedNoEvictScheduler

    for num_blocks in range(12, 40):
        outcomes = []
        for hot in (True, False):
            kv = BlockManager(
                BlockManagerConfig(tokens_per_block=4, num_blocks=num_blocks, max_attention_window=256, enable_block_reuse=True)
            )
            receiving = [LlmRequest(f"g{i}", [7, i] * (3 + i), 5 + 3 * i, state=S.DISAGG_GENERATION_INIT) for i in range(3)]
            for request in receiving:
                kv.add_sequence(request, reuse=False)
                request.set_state(S.DISAGG_GENERATION_TRANS_IN_PROGRESS)
            waiting = [LlmRequest(f"c{i}", [3, i, 1] * (2 + i), 4) for i in range(3)]
            CapacityScheduler.use_hot_paths = hot
            try:
                output = GuaranteedNoEvictScheduler(8, kv).schedule(receiving + waiting)
            finally:
                CapacityScheduler.use_hot_paths = True
            outcomes.append(([r.request_id for r in output.fitting], [r.estimated_reusable_tokens for r in receiving]))
        assert outcomes[0] == outcomes[1], num_blocks


def test_memoised_prompt_blocks_are_the_prompts_blocks_and_chain(prompt_memo) -> None:
    """The reuse tree's keys and in-process chain hashes of a prompt, shared between the managers that
    cut it (memoised), equal those cut block by block; a pause (a longer prompt) gets its own."""
    prompt = list(range(50, 89))  # 9 full blocks of 4 and 3 tokens
    expected_keys = [tuple(prompt[i : i + 4]) for i in range(0, 36, 4)]
    expected_digests, chain = [], 0
    for key in expected_keys:
        chain = hash((chain, key))
        expected_digests.append(chain)
    managers = [
        BlockManager(BlockManagerConfig(tokens_per_block=4, num_blocks=32, max_attention_window=64, enable_block_reuse=True, record_events=True))
        for _ in range(2)
    ]
    published = []
    for kv in managers:
        request = LlmRequest("r", prompt, 4)
        kv.add_sequence(request)
        kv.store_context_blocks(request)
        assert list(kv._keys(request)) == expected_keys and list(kv._digests(request)) == expected_digests
        published.append(kv.drain_events())
    assert published[0] == published[1] and [e.block_hash for e in published[0]] == block_hash_chain(prompt, 4)[:9]
    assert block_hash._prompt_blocks.cache_info().hits >= 1
    longer = LlmRequest("s", prompt + [1, 2, 3, 4, 5], 4)
    assert list(managers[0]._keys(longer)) == expected_keys + [(86, 87, 88, 1), (2, 3, 4, 5)]


def test_a_closed_block_manager_is_freed_without_the_cyclic_collector() -> None:
    """A simulation keeps the collector off (cluster/sim/vclock.py) and closes the manager of a
    restarted instance: its reuse tree (nodes reference parents and children) must not linger."""
    import gc

    def thrown_away(close: bool) -> None:
        kv = BlockManager(BlockManagerConfig(tokens_per_block=4, num_blocks=32, max_attention_window=64, enable_block_reuse=True))
        for request_id, prompt in enumerate(([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9])):
            request = LlmRequest(request_id, prompt, 4)
            kv.add_sequence(request)
            kv.store_context_blocks(request)
            kv.remove_sequence(request_id)
        if close:
            kv.close()

    gc.collect()
    gc.disable()
    try:
        thrown_away(close=False)
        assert gc.collect() > 0  # the tree was left for the collector
        thrown_away(close=True)
        assert gc.collect() == 0
    finally:
        gc.enable()
