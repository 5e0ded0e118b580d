"""Context chunking policies and draft-token fitting (TensorRT-LLM
cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp: MicroBatchScheduler::setCtxRequestsChunkSize,
MicroBatchScheduler::fitDraftTokens).

`capacity` is the compute-token budget left for context chunks (None = unlimited), `unit` the chunk
unit. Only a request's first chunk gets reuse credit (its estimated reusable tokens).

FORCE_CHUNK: without snapshot points it has TensorRT-LLM's C++ semantics (every request gets
min(remaining, unit), or 0 if that would overflow the capacity; no reuse credit). A request that
carries snapshot points follows the newest TensorRT-LLM instead: its chunk ends at the first
snapshot point after its current position (or at the prompt's end), capped to the largest unit
multiple within max_context_length, and when the capacity left is smaller than that, it is rounded
down to a unit multiple of what is left (possibly 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.config import ContextChunkingPolicy
from scheduler.errors import InvalidFieldError
from scheduler.request import LlmRequest
from scheduler.state import LlmRequestState

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_CONTEXT_INIT_AND_TRANS = LlmRequestState.DISAGG_CONTEXT_INIT_AND_TRANS


def reusable_tokens(request: LlmRequest) -> int:
    """Reuse credit: the estimated reusable tokens, on the first chunk only."""
    return request.estimated_reusable_tokens if request.is_first_context_chunk() else 0


def _prefix_credit_cost(chunk: int, reusable: int) -> int:
    # C++ EQUAL_PROGRESS charges only the tokens beyond the reusable prefix (microBatchScheduler.cpp,
    # setCtxRequestsChunkSize for kEQUAL_PROGRESS).
    return max(0, chunk - min(reusable, chunk))


def equal_progress(
    requests: Sequence[LlmRequest], capacity: int | None, unit: int, max_context_length: int | None
) -> None:
    used = 0
    made_progress = True
    while (capacity is None or used < capacity) and made_progress:
        made_progress = False
        for request in requests:
            past = request.context_chunk_size
            request.set_context_chunk_size(past + unit)
            actual = request.context_chunk_size
            reusable = reusable_tokens(request)
            increment = _prefix_credit_cost(actual, reusable) - _prefix_credit_cost(past, reusable)
            if (capacity is not None and used + increment > capacity) or (
                max_context_length is not None and actual > max_context_length
            ):
                request.set_context_chunk_size(past)
                continue
            used += increment
            if actual > past:
                made_progress = True


def first_come_first_served(
    requests: Sequence[LlmRequest], capacity: int | None, unit: int, max_context_length: int | None
) -> None:
    for request in requests:
        # context_remaining_length and reusable_tokens(), inline: once the budget is spent this
        # loop only passes over the requests that wait (most of them, in a busy engine).
        position = request.context_current_position
        want = request.prompt_len - position
        reusable = request.estimated_reusable_tokens if position == request.prepopulated_prompt_len else 0
        compute = want - reusable if want > reusable else 0
        if capacity is not None and compute > 0 and (capacity <= 0 or (compute > capacity and capacity < unit)):
            # Nothing to give, or less than a unit: the chunk below would be cut to at most the
            # capacity (the max_context_length cut only shortens it), then rounded down to 0. It
            # stays at the 0 the caller reset it to. What is left after the first prompts is mostly
            # less than a unit, so this is the path of nearly every waiting prompt.
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


def force_chunk(
    requests: Sequence[LlmRequest], capacity: int | None, unit: int, max_context_length: int | None
) -> None:
    if max_context_length is not None and max_context_length < unit:
        raise InvalidFieldError(
            "max_context_length", f"FORCE_CHUNK needs max_context_length >= unit {unit}, got {max_context_length}"
        )
    total = 0
    for request in requests:
        remaining = request.context_remaining_length
        if request.snapshot_points:
            point = request.next_snapshot_point()
            chunk = (point if point is not None else request.prompt_len) - request.context_current_position
            if max_context_length is not None:
                chunk = min(chunk, max_context_length // unit * unit)
            if capacity is not None and total + chunk > capacity:
                chunk = max(0, capacity - total) // unit * unit
        else:
            chunk = min(remaining, unit)
            if capacity is not None and total + chunk > capacity:
                chunk = 0
        request.set_context_chunk_size(chunk)
        total += request.context_chunk_size


_POLICIES = {
    ContextChunkingPolicy.EQUAL_PROGRESS: equal_progress,
    ContextChunkingPolicy.FIRST_COME_FIRST_SERVED: first_come_first_served,
    ContextChunkingPolicy.FORCE_CHUNK: force_chunk,
}


def fit_draft_tokens(
    requests: Sequence[LlmRequest],
    capacity: int | None,
    unit: int,
    max_context_length: int | None,
    has_draft_tokens: bool | None = None,
) -> None:
    """Trim draft tokens of last-chunk requests so they need no extra block and fit the budget.
    `has_draft_tokens`: whether any request has some, when the caller already knows."""
    if has_draft_tokens is None:
        has_draft_tokens = any(request.draft_tokens for request in requests)
    if not has_draft_tokens:
        return  # nothing to trim (the common case)
    used = 0
    for request in requests:
        chunk = request.context_chunk_size
        used += min(chunk, request.context_remaining_length - reusable_tokens(request))
    for request in requests:
        if not (request.is_last_context_chunk() and request.draft_tokens):
            continue
        chunk = request.context_chunk_size
        space = unit - chunk % unit if chunk % unit else 0
        if max_context_length is not None:
            space = min(space, max_context_length - chunk)
        if capacity is not None:
            space = min(space, capacity - used)
            used += space
        space = max(space, 0)
        excess = len(request.draft_tokens) - space
        if excess > 0:
            request.discard_draft_tokens(excess)


def chunk_contexts(
    requests: Sequence[LlmRequest],
    policy: ContextChunkingPolicy,
    capacity: int | None,
    unit: int,
    max_context_length: int | None,
    has_draft_tokens: bool | None = None,
) -> None:
    """What MicroBatchScheduler::operator() (microBatchScheduler.cpp) does when not every context fits:
    reset every chunk to 0, run the policy, then fit the draft tokens."""
    for request in requests:
        state = request.state
        if state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS:
            request.context_chunk_size = 0  # what set_context_chunk_size(0) stores in these states
        else:
            request.set_context_chunk_size(0)  # the other states it accepts, or its error
    _POLICIES[policy](requests, capacity, unit, max_context_length)
    fit_draft_tokens(requests, capacity, unit, max_context_length, has_draft_tokens)
