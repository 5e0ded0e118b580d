"""The capacity scheduler: which requests may hold KV memory this step (TensorRT-LLM
cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp).

Policies: MaxRequests (no KV manager), GUARANTEED_NO_EVICT (reserve to completion), STATIC_BATCH
(the same, but new work only starts when nothing is generating) and MAX_UTILIZATION (reserve one
step; pause started requests from the tail of the list and retry).

The list order is the scheduling order: these schedulers never sort (a reorder hook runs before
them, see scheduler.ordering). Requests in DISAGG_GENERATION_INIT are let through regardless of the
window (the "disagg exemption", not for MaxRequests) and returned in a separate list.

Prefix-aware skipping: a first-chunk context request whose first missing prompt block is the same
as that of a request already admitted this pass (or of a chunked prefill already running) is
skipped this step: once the earlier one stores its blocks, this one reuses them instead of
computing the same KV twice. The check is pure; a request's key is registered only once it has
been admitted (docs/architecture.md, "The local scheduler").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.config import CapacitySchedulerPolicy
from scheduler.peft import PeftBudget
from scheduler.request import LlmRequest
from scheduler.state import LlmRequestState

S = LlmRequestState
_ENCODER_INIT = S.ENCODER_INIT
_CONTEXT_INIT = S.CONTEXT_INIT
_CONTEXT_INIT_AND_TRANS = S.DISAGG_CONTEXT_INIT_AND_TRANS
_GEN_INIT = S.DISAGG_GENERATION_INIT
_GEN_RECEIVING = S.DISAGG_GENERATION_TRANS_IN_PROGRESS
_GEN_IN_PROGRESS = S.GENERATION_IN_PROGRESS
_GENERATION_STATES = frozenset({S.GENERATION_IN_PROGRESS, S.GENERATION_TO_COMPLETE, S.DISAGG_GENERATION_TRANS_COMPLETE})
_UNLIMITED_PAGES = 0x7FFFFFFF


@dataclass
class CapacityOutput:
    """fitting: the requests that may hold KV memory this step, in order (for the micro-batch).
    non_plain_positions: the positions in `fitting`, ascending, of the requests that are not
    plain generating requests (GENERATION_IN_PROGRESS, no LoRA task, one beam, no draft tokens),
    so that the micro-batch can take the runs between them whole; None if not worked out."""

    fitting: list[LlmRequest] = field(default_factory=list)
    disagg_generation_init: list[LlmRequest] = field(default_factory=list)
    paused: list[LlmRequest] = field(default_factory=list)
    non_plain_positions: list[int] | None = None


def _is_plain_generation(request: LlmRequest) -> bool:
    return request.state is _GEN_IN_PROGRESS and request.is_plain and not request.draft_tokens


def _split(
    scheduled: list[LlmRequest],
    paused: list[LlmRequest],
    any_disagg: bool = True,
    non_plain: list[int] | None = None,
) -> CapacityOutput:
    """Take the disagg-init requests out of `scheduled` (when there may be any), keeping the
    non-plain positions true of what is left."""
    if not any_disagg:
        return CapacityOutput(scheduled, [], paused, non_plain)
    fitting: list[LlmRequest] = []
    disagg: list[LlmRequest] = []
    if non_plain is None:
        for request in scheduled:
            (disagg if request.state is _GEN_INIT else fitting).append(request)
        return CapacityOutput(fitting, disagg, paused)
    # Disagg-init requests are never plain: copy the runs between them with slices.
    kept: list[int] = []
    start = 0
    for position in non_plain:
        request = scheduled[position]
        if request.state is _GEN_INIT:
            fitting += scheduled[start:position]
            disagg.append(request)
            start = position + 1
        else:
            kept.append(position - len(disagg))
    fitting += scheduled[start:]
    return CapacityOutput(fitting, disagg, paused, kept)


class _PrefixSkipper:
    """The set C of TensorRT-LLM's prefix-aware skipping (capacityScheduler.cpp; the keys are
    kvCacheManager.cpp findNewContextBlock's), built lazily: most steps never need it.

    C starts with the keys of the contexts already started (chunked prefills running) anywhere in
    the active list. Building it scans the list, as long as a step's other work on the generating
    requests; a scheduler walking the list in order can instead note the started contexts it passes
    (`note_started`) and have only the rest scanned (`registered(start)`)."""

    __slots__ = ("_kv", "_active", "_keys", "_noted")

    def __init__(self, kv: BlockManager, active: Sequence[LlmRequest]) -> None:
        self._kv = kv
        self._active = active
        self._keys: set | None = None
        self._noted: list[LlmRequest] = []

    def note_started(self, request: LlmRequest) -> None:
        """A started context before the `start` of the first `registered` call."""
        if self._keys is None:
            self._noted.append(request)

    def registered(self, start: int = 0) -> set:
        """The keys of C (started contexts and those admitted this step). On the first call, the
        started contexts before `start` must all have been noted; the list is scanned from there."""
        if self._keys is None:
            keys = set()
            kv = self._kv
            for request in self._noted:
                key = kv.find_new_context_block(request)
                if key is not None:
                    keys.add(key)
            active = self._active
            for index in range(start, len(active)):
                request = active[index]
                state = request.state
                if (state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS) and (
                    request.context_current_position != request.prepopulated_prompt_len
                ):
                    key = kv.find_new_context_block(request)
                    if key is not None:
                        keys.add(key)
            self._keys = keys
        return self._keys

    def key_if_not_skipped(self, request: LlmRequest, start: int = 0) -> tuple[bool, tuple | None]:
        """(skip?, key to register once admitted)."""
        key = self._kv.find_new_context_block(request)
        if key is None:
            return False, None
        if key in self.registered(start):
            return True, None
        return False, key

    def register(self, key: tuple | None) -> None:
        if key is not None:
            self.registered().add(key)


class CapacityScheduler:
    """Base: the window check and the shared inputs."""

    # The inlined fast paths for plain generating requests; tests switch them off to check that
    # both paths give the same schedule.
    use_hot_paths = True

    def __init__(
        self,
        max_num_requests: int,
        *,
        until: LlmRequestState = S.CONTEXT_INIT,
        after: LlmRequestState = S.GENERATION_COMPLETE,
    ) -> None:
        self.max_num_requests = max_num_requests
        self.until = until
        self.after = after

    def schedule(self, active: Sequence[LlmRequest]) -> CapacityOutput:  # pragma: no cover - abstract
        raise NotImplementedError


class MaxRequestsScheduler(CapacityScheduler):
    """No KV manager: admit up to max_num_requests schedulable requests, in order."""

    def schedule(self, active: Sequence[LlmRequest]) -> CapacityOutput:
        until, after, limit = self.until, self.after, self.max_num_requests
        scheduled: list[LlmRequest] = []
        non_plain: list[int] = []
        for request in active:
            state = request.state
            if not (until <= state < after):
                continue
            if len(scheduled) >= limit:
                break
            if (
                state is _ENCODER_INIT
                or state is _CONTEXT_INIT
                or state is _CONTEXT_INIT_AND_TRANS
                or state in _GENERATION_STATES
            ):
                if not _is_plain_generation(request):
                    non_plain.append(len(scheduled))
                scheduled.append(request)
        return _split(scheduled, [], non_plain=non_plain)


class GuaranteedNoEvictScheduler(CapacityScheduler):
    """Admit only what can run to completion without eviction; STATIC_BATCH when `static`."""

    def __init__(
        self,
        max_num_requests: int,
        kv: BlockManager,
        *,
        cross_kv: BlockManager | None = None,
        peft: PeftBudget | None = None,
        static_batch: bool = False,
        prefix_aware: bool = True,
        until: LlmRequestState = S.CONTEXT_INIT,
        after: LlmRequestState = S.GENERATION_COMPLETE,
    ) -> None:
        super().__init__(max_num_requests, until=until, after=after)
        self.kv = kv
        self.cross_kv = cross_kv
        self.peft = peft
        self.static_batch = static_batch
        self.skipping = kv.enable_block_reuse and prefix_aware and not static_batch

    def schedule(self, active: Sequence[LlmRequest]) -> CapacityOutput:
        kv, cross, peft = self.kv, self.cross_kv, self.peft
        until, after, limit = self.until, self.after, self.max_num_requests
        available = kv.num_free_blocks
        cross_available = cross.num_free_blocks if cross is not None else 0
        claimed_pages = 0
        tasks: set[int] = set()
        scheduled: list[LlmRequest] = []
        pending_disagg: list[LlmRequest] = []
        pending: list[LlmRequest] = []
        remaining = kv.remaining_blocks_to_completion
        # Hot path: a plain generating request (no cross pool, no LoRA, beam width 1, no draft
        # tokens) whose sequence has the simple remaining-blocks form; everything else takes the
        # general path, and its position in `scheduled` is noted (non_plain).
        fast = self.use_hot_paths and cross is None and until <= _GEN_IN_PROGRESS < after
        non_plain: list[int] = []
        skipper = _PrefixSkipper(kv, active) if self.skipping else None
        # C (prefix-aware skipping) from the started contexts this pass notes plus a scan of what
        # it did not reach, instead of a scan of the whole list; the general path scans it all.
        noting = skipper is not None and self.use_hot_paths

        append = scheduled.append
        num_scheduled = 0
        stopped_at = None
        for request in active:
            state = request.state
            if fast and state is _GEN_IN_PROGRESS and request.is_plain and not request.draft_tokens:
                if num_scheduled >= limit:
                    stopped_at = request
                    break
                append(request)
                num_scheduled += 1
                sequence = request.kv_sequence
                if sequence is not None and sequence.total_blocks_per_beam and not sequence.released:
                    available -= sequence.total_blocks_per_beam - len(sequence.beam_blocks[0])
                else:
                    available -= remaining(request)
                continue
            if (
                noting
                and (state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS)
                and request.context_current_position != request.prepopulated_prompt_len
            ):
                skipper.note_started(request)
            num_scheduled = len(scheduled)
            if state is _GEN_RECEIVING:
                # Reserved for KV still in flight: not scheduled this step, but it generates the
                # moment the KV commits, so the rest of its run is claimed now. Otherwise later
                # reservations take the blocks its decode needs and a step runs out of blocks.
                sequence = request.kv_sequence
                if fast and request.is_plain and sequence is not None and sequence.total_blocks_per_beam and not sequence.released:
                    # Its reservation holds the prompt's blocks: the simple form, as for a plain
                    # generating request (a generation instance walks many such every step).
                    request.estimated_reusable_tokens = 0
                    available -= sequence.total_blocks_per_beam - len(sequence.beam_blocks[0])
                else:
                    available -= remaining(request)
                continue
            if not (until <= state < after) and state is not _GEN_INIT:
                continue
            if len(scheduled) >= limit:
                stopped_at = request
                break
            if state in _GENERATION_STATES:
                non_plain.append(num_scheduled)
                scheduled.append(request)
                num_scheduled += 1
                available -= remaining(request)
                if cross is not None:
                    cross_available -= cross.remaining_blocks_to_completion(request)
                task = request.lora_task_id
                if task is not None and peft is not None and task not in tasks:
                    tasks.add(task)
                    claimed_pages += peft.determine_num_pages(request)
            elif state is _GEN_INIT:
                pending_disagg.append(request)
            else:
                pending.append(request)

        if self.static_batch and scheduled:
            return _split(scheduled, [], any_disagg=False, non_plain=non_plain)

        available_pages = (peft.max_device_pages if peft is not None else _UNLIMITED_PAGES) - claimed_pages
        if not noting:
            scan_from = 0
        elif stopped_at is None:
            scan_from = len(active)
        else:
            scan_from = active.index(stopped_at)  # (identity: requests define no equality)
        for group in (pending_disagg, pending):
            for request in group:
                state = request.state
                is_disagg = state is _GEN_INIT
                is_context = state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS
                key = None
                if skipper is not None and is_context and request.is_first_context_chunk():
                    skip, key = skipper.key_if_not_skipped(request, scan_from)
                    if skip:
                        continue
                if len(scheduled) >= limit:
                    break
                if not (is_context or is_disagg):
                    continue  # encoder-init requests need the encoder-decoder path
                need = remaining(request)
                cross_need = cross.remaining_blocks_to_completion(request) if cross is not None else 0
                task = request.lora_task_id
                pages = 0
                if task is not None and peft is not None and task not in tasks:
                    pages = peft.determine_num_pages(request)
                blocks_fit = need <= available and cross_need <= cross_available
                if blocks_fit and pages <= available_pages:
                    non_plain.append(len(scheduled))
                    scheduled.append(request)
                    available -= need
                    cross_available -= cross_need
                    available_pages -= pages
                    if task is not None:
                        tasks.add(task)
                    if skipper is not None:
                        skipper.register(key)
                elif not blocks_fit:
                    break  # strict head-of-line blocking within the group
                # else: only the PEFT budget failed; try the next request
        return _split(scheduled, [], any_disagg=bool(pending_disagg), non_plain=non_plain)


class MaxUtilizationScheduler(CapacityScheduler):
    """Admit as much as fits for the next step; pause started requests from the tail when needed."""

    def __init__(
        self,
        max_num_requests: int,
        kv: BlockManager,
        *,
        cross_kv: BlockManager | None = None,
        peft: PeftBudget | None = None,
        prefix_aware: bool = True,
        until: LlmRequestState = S.CONTEXT_INIT,
        after: LlmRequestState = S.GENERATION_COMPLETE,
    ) -> None:
        super().__init__(max_num_requests, until=until, after=after)
        self.kv = kv
        self.cross_kv = cross_kv
        self.peft = peft
        self.skipping = kv.enable_block_reuse and prefix_aware

    def _is_started(self, request: LlmRequest) -> bool:
        state = request.state
        if not (self.until <= state < self.after):
            return False
        if state in _GENERATION_STATES:
            return True
        return (state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS) and (
            request.context_current_position != request.prepopulated_prompt_len
        )

    def schedule(self, active: Sequence[LlmRequest]) -> CapacityOutput:
        kv, cross, peft = self.kv, self.cross_kv, self.peft
        until, after, limit = self.until, self.after, self.max_num_requests
        kv.start_scheduling()
        if cross is not None:
            cross.start_scheduling()
        max_pages = peft.max_device_pages if peft is not None else _UNLIMITED_PAGES
        skipper = _PrefixSkipper(kv, active) if self.skipping else None
        needed = kv.needed_blocks_one_step
        tpb = kv.tokens_per_block
        max_token_num = kv.config.max_token_num
        # Hot path: a plain generating request (no cross pool, no LoRA, beam width 1, no draft
        # tokens, one-step look-ahead) needs one block iff its KV ends on a block boundary.
        fast = (
            self.use_hot_paths and cross is None and not kv.config.two_steps_lookahead and until <= _GEN_IN_PROGRESS < after
        )
        # The new-prompt hot path also needs: prefix-aware skipping on (so reuse is on), no LoRA
        # pages to count, a self-attention pool, and CONTEXT_INIT inside the window.
        first_chunk_fast = (
            fast
            and skipper is not None
            and peft is None
            and not kv.config.is_cross_attention
            and until <= _CONTEXT_INIT < after
        )
        first_chunk_admission = kv.first_chunk_admission
        # C (prefix-aware skipping) from the started contexts noted on the way plus a scan of the
        # rest of the list, instead of a scan of all of it; the general path scans all of it.
        noting = skipper is not None and self.use_hot_paths
        free = kv.scheduling_free_blocks  # changes only when a victim is simulated away
        scheduled_blocks = 0
        cross_scheduled_blocks = 0
        scheduled_pages = 0
        tasks: set[int] = set()
        scheduled: list[LlmRequest] = []
        append = scheduled.append
        num_scheduled = 0  # len(scheduled), kept by hand: this loop runs once per active request
        non_plain: list[int] = []  # positions in `scheduled` of what the plain-generation path did not take
        paused: list[LlmRequest] = []
        any_disagg = False
        index = 0
        end = len(active)
        while index < end:
            request = active[index]
            state = request.state
            if fast and state is _GEN_IN_PROGRESS and request.is_plain and not request.draft_tokens:
                if num_scheduled < limit:
                    sequence = request.kv_sequence
                    if sequence is not None and not sequence.released:
                        current = sequence.num_tokens
                        need = (
                            1
                            if current % tpb == 0
                            and current - request.prompt_len < request.max_new_tokens
                            and current < max_token_num
                            else 0
                        )
                    else:
                        need = needed(request)
                    if free >= scheduled_blocks + need:
                        append(request)
                        num_scheduled += 1
                        scheduled_blocks += need
                        index += 1
                        continue
            elif (
                first_chunk_fast
                and state is _CONTEXT_INIT
                and request.is_plain
                and request.context_current_position == request.prepopulated_prompt_len
            ):
                # Hot path for a new prompt (about 10% of a busy engine's requests, every step):
                # the general branch below with one (cached) walk of the prefix tree, not three.
                key, need, reusable = first_chunk_admission(request)
                if key is not None:
                    registered = skipper.registered(index)
                    if key in registered:
                        index += 1
                        continue
                if num_scheduled < limit:
                    request.estimated_reusable_tokens = reusable * tpb
                    if free >= scheduled_blocks + need:
                        non_plain.append(num_scheduled)
                        append(request)
                        num_scheduled += 1
                        scheduled_blocks += need
                        if key is not None:
                            registered.add(key)
                        index += 1
                        continue
            else:
                is_context = state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS
                first_chunk = is_context and request.context_current_position == request.prepopulated_prompt_len
                if noting and is_context and not first_chunk:
                    # Every started context before the first prompt's check passes here (the
                    # fast branches take none), so C needs only the rest of the list scanned.
                    skipper.note_started(request)
                if not (until <= state < after) and state is not _GEN_INIT:
                    index += 1
                    continue
                key = None
                if skipper is not None and first_chunk:
                    skip, key = skipper.key_if_not_skipped(request, index if noting else 0)
                    if skip:
                        index += 1
                        continue
                if num_scheduled < limit:
                    need = needed(request)
                    cross_need = cross.needed_blocks_one_step(request) if cross is not None else 0
                    task = request.lora_task_id
                    pages = 0
                    if task is not None and peft is not None and task not in tasks:
                        pages = peft.determine_num_pages(request)
                    if (
                        free >= scheduled_blocks + need
                        and (cross is None or cross.scheduling_has_free_blocks(cross_scheduled_blocks + cross_need))
                        and scheduled_pages + pages <= max_pages
                    ):
                        non_plain.append(num_scheduled)
                        append(request)
                        num_scheduled += 1
                        any_disagg = any_disagg or state is _GEN_INIT
                        scheduled_blocks += need
                        cross_scheduled_blocks += cross_need
                        scheduled_pages += pages
                        if task is not None:
                            tasks.add(task)
                        if skipper is not None:
                            skipper.register(key)
                        index += 1
                        continue
            # Does not fit: evict the last started request at or after this one, then retry it.
            victim_index = -1
            for candidate in range(end - 1, index - 1, -1):
                if self._is_started(active[candidate]):
                    victim_index = candidate
                    break
            if victim_index < 0:
                break
            victim = active[victim_index]
            kv.scheduling_remove_sequence(victim.request_id)
            free = kv.scheduling_free_blocks
            if cross is not None:
                cross.scheduling_remove_sequence(victim.request_id)
            paused.append(victim)
            end = victim_index
        return _split(scheduled, paused, any_disagg, non_plain)


def make_capacity_scheduler(
    policy: CapacitySchedulerPolicy,
    max_num_requests: int,
    kv: BlockManager | None,
    *,
    cross_kv: BlockManager | None = None,
    peft: PeftBudget | None = None,
    prefix_aware: bool = True,
    until: LlmRequestState = S.CONTEXT_INIT,
    after: LlmRequestState = S.GENERATION_COMPLETE,
) -> CapacityScheduler:
    """Policy selection, as TensorRT-LLM's CapacityScheduler constructor (capacityScheduler.cpp)
    makes it: without a KV manager it is MaxRequests, whatever was asked."""
    if kv is None:
        return MaxRequestsScheduler(max_num_requests, until=until, after=after)
    if policy is CapacitySchedulerPolicy.MAX_UTILIZATION:
        return MaxUtilizationScheduler(
            max_num_requests, kv, cross_kv=cross_kv, peft=peft, prefix_aware=prefix_aware, until=until, after=after
        )
    if policy in (CapacitySchedulerPolicy.GUARANTEED_NO_EVICT, CapacitySchedulerPolicy.STATIC_BATCH):
        return GuaranteedNoEvictScheduler(
            max_num_requests,
            kv,
            cross_kv=cross_kv,
            peft=peft,
            static_batch=policy is CapacitySchedulerPolicy.STATIC_BATCH,
            prefix_aware=prefix_aware,
            until=until,
            after=after,
        )
    raise ValueError(f"unknown capacity policy {policy!r}")  # pragma: no cover - enum is closed
