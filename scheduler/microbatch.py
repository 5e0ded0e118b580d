"""The micro-batch scheduler: this step's batch from the admitted requests (TensorRT-LLM
cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp, MicroBatchScheduler::operator()).

Limits: max batch size (requests), max num tokens (compute tokens, None = unlimited), max context
length; context chunking with EQUAL_PROGRESS / FIRST_COME_FIRST_SERVED / FORCE_CHUNK; reuse-adjusted
compute (the first chunk of a request that will reuse a cached prefix costs only the rest); draft
tokens fitted into the budget; beam-width consistency across the generation batch; requests still
executing in another micro-batch (in flight) are skipped. Output order: contexts with chunks still
to come first, then last chunks, each sorted by LoRA task; generation sorted by LoRA task.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

from scheduler.chunking import chunk_contexts, reusable_tokens
from scheduler.config import ChunkingConfig, ContextChunkingPolicy
from scheduler.errors import InvalidFieldError
from scheduler.request import LlmRequest
from scheduler.state import LlmRequestState

S = LlmRequestState
_ENCODER_INIT = S.ENCODER_INIT
_CONTEXT_INIT = S.CONTEXT_INIT
_CONTEXT_INIT_AND_TRANS = S.DISAGG_CONTEXT_INIT_AND_TRANS
_GEN_IN_PROGRESS = S.GENERATION_IN_PROGRESS
_NO_TASK = -1


def _lora_key(request: LlmRequest) -> int:
    task = request.lora_task_id
    return _NO_TASK if task is None else task


@dataclass
class MicroBatch:
    context: list[LlmRequest] = field(default_factory=list)
    generation: list[LlmRequest] = field(default_factory=list)
    num_tokens: int = 0


class MicroBatchScheduler:
    # The inlined fast path for plain generating requests; tests switch it off to check that both
    # paths give the same batch.
    use_hot_paths = True

    def __init__(
        self,
        *,
        chunking: ChunkingConfig | None = None,
        max_context_length: int | None = None,
        until: LlmRequestState = S.CONTEXT_INIT,
        after: LlmRequestState = S.GENERATION_TO_COMPLETE,
    ) -> None:
        self.chunking = chunking
        self.max_context_length = max_context_length
        self.until = until
        self.after = after

    def schedule(
        self,
        requests: Sequence[LlmRequest],
        inflight_ids: Collection[Hashable],
        max_batch_size: int,
        max_num_tokens: int | None,
        non_plain_positions: Sequence[int] | None = None,
    ) -> MicroBatch:
        """This step's batch from `requests` (the capacity scheduler's fitting list, in order).

        `non_plain_positions`: the positions, ascending, of the requests that are not plain
        generating requests, when the caller knows them (CapacityOutput.non_plain_positions);
        every other request is then in GENERATION_IN_PROGRESS with no LoRA task, one beam and no
        draft tokens, and each run of them between two listed positions is taken with one slice
        instead of one request at a time. None: every request is looked at."""
        until, after = self.until, self.after
        chunking = self.chunking
        max_context_length = self.max_context_length
        batch_tokens = 0
        num_requests = 0
        context: list[LlmRequest] = []
        generation: list[LlmRequest] = []
        to_chunk: list[LlmRequest] = []
        tentative_chunk_tokens = 0
        all_fit = True
        beam_width = 0
        has_lora = False
        gen_in_window = until <= _GEN_IN_PROGRESS < after
        # The context hot path needs chunking on (the tentative chunk is then the remainder).
        context_hot = self.use_hot_paths and chunking is not None and until <= _CONTEXT_INIT < after
        has_draft_tokens = False  # among the contexts to chunk
        token_limit = max_num_tokens if max_num_tokens is not None else float("inf")
        end = len(requests)
        # The requests looked at one by one (then `end`, which closes the last run); in between,
        # runs of plain generating requests (empty when the positions are not known).
        if non_plain_positions is None or not self.use_hot_paths:
            one_by_one: Sequence[int] = range(end + 1)
        else:
            one_by_one = [*non_plain_positions, end]
        start = 0
        for stop in one_by_one:
            if start < stop and gen_in_window:
                # requests[start:stop]: plain generating requests (one token each), taken as the
                # general generation branch below would take them one by one: those in flight
                # are passed over; with another beam width in the batch none joins, unless the
                # budget is spent (then the first of them ends the batch).
                run = requests[start:stop]
                if inflight_ids:
                    run = [request for request in run if request.request_id not in inflight_ids]
                if run and (beam_width == 1 or not beam_width or batch_tokens >= token_limit):
                    taken = min(len(run), token_limit - batch_tokens, max_batch_size - num_requests)
                    beam_width = 1  # (if none is taken, the batch ends here)
                    generation += run[:taken]
                    batch_tokens += taken
                    num_requests += taken
                    if taken < len(run) or num_requests >= max_batch_size:
                        break  # the token budget or the batch is full
            if stop == end:
                break
            start = stop + 1
            request = requests[stop]
            state = request.state
            if state is _CONTEXT_INIT and context_hot and request.is_plain and not request.draft_tokens:
                # Hot path (a new or chunked prompt): the general chunking branch below for a
                # request with no LoRA task and no draft tokens. Tentatively its chunk is the
                # whole remainder, set directly (a context state needs no clamp).
                if inflight_ids and request.request_id in inflight_ids:
                    continue
                position = request.context_current_position
                chunk = request.prompt_len - position
                request.context_chunk_size = chunk
                if position == request.prepopulated_prompt_len:
                    chunk -= request.estimated_reusable_tokens
                cost = chunk if chunk > 0 else 0
                if max_context_length is not None and max_context_length < cost:
                    cost = max_context_length
                    all_fit = False
                to_chunk.append(request)
                tentative_chunk_tokens += cost
                num_requests += 1
                if num_requests >= max_batch_size:
                    break
                continue
            if not (until <= state < after) or (inflight_ids and request.request_id in inflight_ids):
                continue
            if request.lora_task_id is not None:
                has_lora = True
            if state is _ENCODER_INIT:
                cost = request.encoder_input_len or 0
                if max_context_length is not None and cost > max_context_length:
                    raise InvalidFieldError(
                        "encoder_input_len",
                        f"request {request.request_id!r}: {cost} exceeds max_context_length {max_context_length}",
                    )
                if max_num_tokens is not None and batch_tokens + cost > max_num_tokens:
                    break
                context.append(request)
                batch_tokens += cost
            elif state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS:
                if chunking is None:
                    reusable = reusable_tokens(request)
                    num_tokens = len(request.tokens[0])
                    cost = max(1, num_tokens - min(reusable, num_tokens) + len(request.draft_tokens))
                    if max_context_length is not None and cost > max_context_length:
                        raise InvalidFieldError(
                            "max_context_length",
                            f"request {request.request_id!r} needs {cost} context tokens without chunking, "
                            f"more than max_context_length {max_context_length}",
                        )
                    if max_num_tokens is not None and batch_tokens + cost > max_num_tokens:
                        break
                    context.append(request)
                    batch_tokens += cost
                else:
                    # Tentatively the whole remainder (the last chunk): set directly, the state
                    # is a context state and the value needs no clamp.
                    position = request.context_current_position
                    chunk = request.prompt_len - position
                    request.context_chunk_size = chunk
                    reusable = request.estimated_reusable_tokens if position == request.prepopulated_prompt_len else 0
                    cost = max(0, chunk - reusable) + len(request.draft_tokens)
                    has_draft_tokens = has_draft_tokens or bool(request.draft_tokens)
                    if max_context_length is not None and max_context_length < cost:
                        cost = max_context_length
                        all_fit = False
                    to_chunk.append(request)
                    tentative_chunk_tokens += cost
            else:
                cost = request.beam_width_by_iter + len(request.draft_tokens)
                if max_num_tokens is not None and batch_tokens + cost > max_num_tokens:
                    break
                if beam_width == 0:
                    beam_width = request.beam_width_by_iter
                elif request.beam_width_by_iter != beam_width:
                    continue  # one beam width per batch; not counted against the batch size
                generation.append(request)
                batch_tokens += cost
            num_requests += 1
            if num_requests >= max_batch_size:
                break

        chunked = False
        if to_chunk:
            if max_num_tokens is not None and tentative_chunk_tokens > max_num_tokens - batch_tokens:
                all_fit = False
            if chunking.policy is ContextChunkingPolicy.FORCE_CHUNK:
                all_fit = False
            if not all_fit:
                chunked = True
                capacity = None if max_num_tokens is None else max_num_tokens - batch_tokens
                chunk_contexts(
                    to_chunk, chunking.policy, capacity, chunking.unit_size, max_context_length, has_draft_tokens
                )
            for request in to_chunk:
                chunk = request.context_chunk_size
                if chunk > 0:
                    context.append(request)
                    cost = max(0, min(chunk, request.context_remaining_length - reusable_tokens(request)))
                    if request.is_last_context_chunk():
                        cost += len(request.draft_tokens)
                    batch_tokens += cost

        # Stable sorts by LoRA task (no task first); skipped when no request has a task, since
        # then they are the identity.
        if chunked:
            not_last = [r for r in context if not r.is_last_context_chunk()]
            last = [r for r in context if r.is_last_context_chunk()]
            if has_lora:
                not_last.sort(key=_lora_key)
                last.sort(key=_lora_key)
            context = not_last + last
        elif has_lora and len(context) > 1:
            context.sort(key=_lora_key)
        if has_lora and len(generation) > 1:
            generation.sort(key=_lora_key)
        return MicroBatch(context, generation, batch_tokens)
