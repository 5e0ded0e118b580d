"""Both levels composed: the one call the engine makes every step."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.capacity import CapacityScheduler, GuaranteedNoEvictScheduler, make_capacity_scheduler
from scheduler.config import SchedulerConfig
from scheduler.microbatch import MicroBatchScheduler
from scheduler.ordering import ReorderHook, reorder_hook
from scheduler.peft import PeftBudget
from scheduler.request import LlmRequest
from scheduler.state import LlmRequestState

_GEN_IN_PROGRESS = LlmRequestState.GENERATION_IN_PROGRESS


@dataclass
class ScheduleOutput:
    """What to run this step, and what to do with the rest.

    context / generation: this step's micro-batch. disagg_generation_init: generation-only requests
    whose KV blocks may now be reserved (they cost no compute this step). paused: requests to evict
    (free their blocks, then `pause()`), recomputed later.
    """

    context: list[LlmRequest] = field(default_factory=list)
    generation: list[LlmRequest] = field(default_factory=list)
    disagg_generation_init: list[LlmRequest] = field(default_factory=list)
    paused: list[LlmRequest] = field(default_factory=list)
    num_tokens: int = 0
    # Requests the capacity scheduler admitted (may hold KV this step, disagg-init ones included):
    # at max_num_requests, that limit and not the KV pool decided who waits.
    num_admitted: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.context or self.generation or self.disagg_generation_init or self.paused)


class TwoLevelScheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: BlockManager | None,
        *,
        cross_kv: BlockManager | None = None,
        peft: PeftBudget | None = None,
        reorder: ReorderHook | None = None,
    ) -> None:
        if kv is not None:
            config.check_block_alignment(kv.tokens_per_block)
        self.config = config
        self.kv = kv
        self.reorder = reorder if reorder is not None else reorder_hook(config.reorder)
        self.capacity: CapacityScheduler = make_capacity_scheduler(
            config.capacity_policy,
            config.max_num_requests,
            kv,
            cross_kv=cross_kv,
            peft=peft,
            prefix_aware=config.enable_prefix_aware_scheduling,
            until=config.capacity_until,
            after=config.capacity_after,
        )
        self.microbatch = MicroBatchScheduler(
            chunking=config.chunking,
            max_context_length=config.max_context_length,
            until=config.microbatch_until,
            after=config.microbatch_after,
        )
        # The decode-only shortcut (`_decode_only`) where both levels would take such a list whole.
        capacity, microbatch = self.capacity, self.microbatch
        self._decode_only_possible = (
            type(capacity) is GuaranteedNoEvictScheduler
            and capacity.cross_kv is None
            and capacity.until <= _GEN_IN_PROGRESS < capacity.after
            and microbatch.until <= _GEN_IN_PROGRESS < microbatch.after
        )

    def schedule(
        self, active: Sequence[LlmRequest], inflight_ids: Collection[Hashable] = ()
    ) -> ScheduleOutput:
        ordered = self.reorder(active)
        if self._decode_only_possible and not inflight_ids and self.capacity.use_hot_paths and self.microbatch.use_hot_paths:
            decode_only = self._decode_only(ordered)
            if decode_only is not None:
                return decode_only
        admitted = self.capacity.schedule(ordered)
        batch = self.microbatch.schedule(
            admitted.fitting,
            inflight_ids,
            self.config.max_batch_size,
            self.config.max_num_tokens,
            admitted.non_plain_positions,
        )
        return ScheduleOutput(
            context=batch.context,
            generation=batch.generation,
            disagg_generation_init=admitted.disagg_generation_init,
            paused=admitted.paused,
            num_tokens=batch.num_tokens,
            num_admitted=len(admitted.fitting) + len(admitted.disagg_generation_init),
        )

    def _decode_only(self, ordered: Sequence[LlmRequest]) -> ScheduleOutput | None:
        """The schedule of a list of plain generating requests only (GENERATION_IN_PROGRESS, no LoRA
        task, one beam, no draft tokens), no more than max_num_requests and none in flight, or None
        for any other list. Most steps of a busy engine schedule such a list, and both levels would
        take it whole: GUARANTEED_NO_EVICT admits every generating request (its blocks were claimed
        when it was admitted) and the micro-batch takes the first of them up to its batch size and
        token budget (one token each). The same schedule without walking both levels' general
        machinery (tests/unit/test_scheduler_properties.py checks it step by step against them)."""
        if len(ordered) > self.capacity.max_num_requests:
            return None
        for request in ordered:
            if request.state is not _GEN_IN_PROGRESS or not request.is_plain or request.draft_tokens:
                return None
        config = self.config
        max_num_tokens = config.max_num_tokens
        taken = min(len(ordered), config.max_batch_size)
        if max_num_tokens is not None:
            taken = min(taken, max_num_tokens)
        return ScheduleOutput(generation=list(ordered[:taken]), num_tokens=taken, num_admitted=len(ordered))

