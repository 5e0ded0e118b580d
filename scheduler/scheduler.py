"""Both levels composed: the one call the engine makes every step."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.capacity import CapacityScheduler, make_capacity_scheduler
from scheduler.config import SchedulerConfig
from scheduler.microbatch import MicroBatchScheduler
from scheduler.ordering import ReorderHook, reorder_hook
from scheduler.peft import PeftBudget
from scheduler.request import LlmRequest


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

    def schedule(
        self, active: Sequence[LlmRequest], inflight_ids: Collection[Hashable] = ()
    ) -> ScheduleOutput:
        ordered = self.reorder(active)
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
