"""One serving instance's engine: the step loop over the scheduler, the model and the sampler.

Every step: take what other threads reported (KV commits, hand-over results), expire reservations
and leases, run the two-level scheduler, evict paused requests (free their blocks; they are
recomputed later), reserve blocks for generation-only requests, allocate KV for this step, run one
forward pass over context chunks and generation tokens together, sample, advance the requests'
states, emit token deltas, and free the blocks of requests that ended.

Roles (TensorRT-LLM's disaggregated flow):
- CONTEXT_ONLY on a PREFILL (or MIXED) instance: prefill, sample the first token, then wait in
  DISAGG_CONTEXT_TRANS_IN_PROGRESS holding its blocks until the KV hand-over is acknowledged
  (DISAGG_CONTEXT_COMPLETE) or failed / its lease expired (DISAGG_TRANS_ERROR); either way the
  blocks are freed.
- GENERATION_ONLY on a GENERATION (or MIXED) instance: enters DISAGG_GENERATION_INIT with the
  prompt and the first token; the capacity scheduler reserves its blocks; the engine issues a
  `Reservation` (an unguessable transfer id); KV is written into exactly those blocks
  (DISAGG_GENERATION_TRANS_IN_PROGRESS); on commit it becomes DISAGG_GENERATION_TRANS_COMPLETE and
  generates. A failed or expired hand-over ends in DISAGG_TRANS_ERROR and frees the blocks.

The hand-over bookkeeping of both sides (reservations, leases, pinned blocks, deferred ends, the
inbox) is worker/handover.py's; this module moves the requests' states and emits their outputs.

Threading: the engine is driven by one thread. Transfer threads touch it only through the sink,
the sources and `report_push`: they write KV into reserved blocks under a per-reservation lock
and post commits and results to the hand-over inbox, which the engine thread drains at the next step.
"""

from __future__ import annotations

import hashlib
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from scheduler.block_manager import BlockManager
from scheduler.config import CapacitySchedulerPolicy
from scheduler.request import LlmRequest
from scheduler.scheduler import ScheduleOutput, TwoLevelScheduler
from scheduler.state import LlmRequestState
from worker.attention import SequenceChunk, disable_cudnn_attention
from worker.detokenizer import IncrementalDetokenizer
from worker.device import dtype_name
from worker.engine_types import EngineConfig, Reservation, hop_max_new_tokens, kv_pool_refusal
from worker.handover import (
    EndRequest,
    EndTiming,
    Expiry,
    Handover,
    KvCommitted,
    KvWriteFailed,
    PushReported,
    RequestHandover,
    TransferTarget,
    Unpinned,
)
from worker.kv_cache import PagedKvCache
from worker.kv_layout import KvLayout
from worker.kv_pool import unsized_pool_bytes
from worker.kv_transfer.failures import FailureReason, TransferFailure
from worker.model import DecoderLM
from worker.model_config import GenerationConfig
from worker.model_runner import ModelRunner
from worker.protocol import (
    EVENT_PREFILL_STARTED,
    REQUEST_TYPES_BY_ROLE,
    EngineInputError,
    EngineLoad,
    ErrorCode,
    RequestError,
    RequestOutput,
    RequestType,
    StateEvent,
    SubmitRequest,
)
from worker.sampler import Sampler, SampleRow
from worker.sampling import SamplingParams
from worker.stopping import FinishReason, StopChecker
from worker.transfer_source import EngineTransferSource

logger = logging.getLogger(__name__)

S = LlmRequestState
_MASK63 = (1 << 63) - 1

# (request_id, state name) -> seconds to hold the request in that state (fault injection).
HoldHook = Callable[[str, str], float]


class EngineError(RuntimeError):
    """An engine API misuse (unknown request, wrong state for the call)."""


@dataclass
class _Tracked:
    """The engine's view of one request, beside the scheduler's LlmRequest."""

    submit: SubmitRequest
    llm: LlmRequest
    params: SamplingParams  # with a seed
    outputs: list[int]  # every output token of the request, including those produced elsewhere
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    num_cached_tokens: int = 0
    handover: RequestHandover = field(default_factory=RequestHandover)
    held_until_s: float = 0.0
    finished: bool = False
    timeline: list[StateEvent] = field(default_factory=list)
    # CONTEXT_ONLY: a push the router relayed before the context was done (an early reservation);
    # it starts the moment the KV is final. Opaque to the engine (worker/instance.py's Push).
    pending_push: object | None = None
    # CONTEXT_ONLY: the source of a push that started while the context still computes (its
    # finished chunks' full blocks are pushed as they become final).
    stream: EngineTransferSource | None = None


def _mix_seed(engine_seed: int, request_id: str) -> int:
    """A request's seed when it came without one: stable across processes (no hash())."""
    return (zlib.crc32(request_id.encode()) << 32 | zlib.crc32(f"{engine_seed}:{request_id}".encode())) & _MASK63


class Engine:
    def __init__(
        self,
        model: DecoderLM,
        tokenizer,
        config: EngineConfig | None = None,
        *,
        generation_config: GenerationConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        hold_hook: HoldHook | None = None,
        instance_id: str = "engine",
        on_inbox: Callable[[], None] | None = None,
        before_forward: Callable[[], None] | None = None,
        runner_factory: Callable[[DecoderLM, PagedKvCache], ModelRunner] = ModelRunner,
    ) -> None:
        # runner_factory: the seam where the forward pass can be swapped (a timing wrapper in
        # worker/profiler.py; anything with ModelRunner.forward's contract).
        self.config = config or EngineConfig()
        self.instance_id = instance_id
        self.model = model
        self.tokenizer = tokenizer
        self._clock = clock
        self._hold_hook = hold_hook
        # Called once a step's batch is planned, before its forward pass: the instance publishes the
        # step's events then ("prefill started" lets the router reserve the KV target meanwhile).
        self._before_forward = before_forward
        cfg = self.config
        model_config = model.config
        self.max_seq_len = min(cfg.max_seq_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
        self.layout = KvLayout(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            tokens_per_block=cfg.tokens_per_block,
            dtype=dtype_name(model.dtype),
            model_fingerprint=model.fingerprint(),
        )
        if model.device.type == "cuda":
            disable_cudnn_attention()
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            pool_bytes = cfg.kv_cache_bytes
            if pool_bytes is None:  # the CPU default, or sized from the GPU (worker/kv_pool.py)
                pool_bytes = unsized_pool_bytes(model, self.layout, cfg, self.max_seq_len, instance_id)
            num_blocks = max(1, pool_bytes // self.layout.run_bytes(model_config.num_layers, 1))
        self.kv_cache = PagedKvCache(self.layout, num_blocks, model.device)
        self.runner = runner_factory(model, self.kv_cache)
        self.blocks = BlockManager(cfg.block_manager_config(num_blocks, self.max_seq_len))
        self.scheduler = TwoLevelScheduler(cfg.scheduler_config(), self.blocks)
        if cfg.chunking_policy is None and cfg.max_num_tokens < self.max_seq_len:
            # Unchunked, a paused request returns with prompt + generated tokens as one context.
            raise EngineInputError(
                "max_num_tokens",
                f"without chunking it must hold a whole sequence (max_seq_len {self.max_seq_len}), got {cfg.max_num_tokens}",
            )
        generation_config = generation_config or GenerationConfig()
        eos = tuple(dict.fromkeys([*getattr(tokenizer, "eos_token_ids", ()), *generation_config.eos_token_ids]))
        self.eos_token_ids = eos
        self.vocab_size = int(tokenizer.vocab_size)
        if self.vocab_size > model_config.vocab_size:
            raise EngineInputError("tokenizer", f"{self.vocab_size} tokens, more than the model's {model_config.vocab_size}")
        self.sampler = Sampler(eos_token_ids=eos)
        self._requests: dict[str, _Tracked] = {}
        self._active: list[LlmRequest] = []
        self.handover = Handover(
            self.layout,
            reservation_timeout_s=cfg.reservation_timeout_s,
            sender_lease_s=cfg.sender_lease_s,
            on_inbox=on_inbox,
            vocab_size=self.vocab_size,
        )
        self._pending_outputs: list[RequestOutput] = []
        # Received prompts to publish to the prefix cache after their next token (publish_prefixes).
        self._unpublished: list[LlmRequest] = []
        self._events: list[StateEvent] = []
        self._ready_pushes: list[tuple[object, EngineTransferSource | None]] = []
        self._finishing_streams: list[tuple[EngineTransferSource, tuple[int, ...]]] = []
        # Chunk streaming needs blocks that stay put until the push returns: no capacity policy
        # that pauses (and frees) a running context.
        self._stream_kv = cfg.stream_kv_chunks and cfg.capacity_policy is not CapacitySchedulerPolicy.MAX_UTILIZATION
        self.num_steps = 0
        self.num_finished = 0
        self.num_pauses = 0
        self.num_forward_tokens = 0
        self.num_streamed_pushes = 0  # pushes started on the finished chunks of a context still computing

    # --- submission -----------------------------------------------------------------------------
    def add_request(self, submit: SubmitRequest) -> None:
        """Validate and queue a request. Raises EngineInputError (naming the field) on bad input."""
        cfg = self.config
        if submit.request_id in self._requests:
            raise EngineInputError("request_id", f"request {submit.request_id!r} is already in this engine")
        if submit.request_type not in REQUEST_TYPES_BY_ROLE[cfg.role]:
            raise EngineInputError("request_type", f"a {cfg.role.name} instance does not take {submit.request_type.name}")
        if len(self._requests) >= cfg.max_waiting_requests:
            raise EngineInputError("queue", f"{len(self._requests)} requests already in the engine")
        for name, ids in (("prompt_token_ids", submit.prompt_token_ids), ("output_token_ids", submit.output_token_ids)):
            for token in ids:
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                    raise EngineInputError(name, f"token id {token!r} is outside the vocabulary [0, {self.vocab_size})")
        params = submit.sampling_params
        params.validate_against(self.vocab_size)
        context = submit.context_token_ids
        if len(context) >= self.max_seq_len:
            raise EngineInputError(
                "prompt_token_ids", f"{len(context)} context tokens leave no room in max_seq_len {self.max_seq_len}"
            )
        if params.seed is None:
            params = params.with_seed(_mix_seed(cfg.seed, submit.request_id))
        llm = LlmRequest(
            submit.request_id,
            context,
            hop_max_new_tokens(submit, self.max_seq_len),
            priority=submit.priority,
            state=S.DISAGG_GENERATION_INIT if submit.request_type is RequestType.GENERATION_ONLY else S.CONTEXT_INIT,
        )
        refusal = kv_pool_refusal(self.blocks, llm)
        if refusal is not None:
            raise EngineInputError("sampling_params.max_tokens", refusal)
        detokenizer = IncrementalDetokenizer(self.tokenizer, submit.prompt_token_ids, params.skip_special_tokens)
        stop = StopChecker(
            params, self.eos_token_ids, prompt_len=len(submit.prompt_token_ids), max_model_len=self.max_seq_len
        )
        for token in submit.output_token_ids:  # produced and streamed elsewhere: replay, do not emit
            stop.append(token, detokenizer.append(token))
        tracked = _Tracked(submit, llm, params, list(submit.output_token_ids), detokenizer, stop)
        self._requests[submit.request_id] = tracked
        self._active.append(llm)
        self._record(tracked, llm.state, "submitted")
        self._maybe_hold(tracked)

    # --- the step ---------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs) or self.handover.has_mail()

    def publish_prefixes(self) -> bool:
        """Publish to the prefix cache the received prompts whose publication waited (a received
        KV's, from its commit until its next token is out): the instance calls it once it has handed
        the step's outputs out, and every step starts with it, so no prompt waits longer than one
        step and every scheduling decision sees what it saw before. A request ended meanwhile
        (aborted) is not published. Whether anything was."""
        if not self._unpublished:
            return False
        waiting, self._unpublished = self._unpublished, []
        for llm in waiting:
            tracked = self._requests.get(llm.request_id)
            if tracked is not None and not tracked.finished and self.blocks.has_sequence(llm.request_id):
                self.blocks.store_context_blocks(llm)
        return True

    def step(self) -> list[RequestOutput]:
        self.publish_prefixes()
        now = self._clock()
        outputs = self._pending_outputs
        self._pending_outputs = []
        self._drain_inbox(outputs)
        self._expire(now, outputs)
        schedulable = [r for r in self._active if self._requests[r.request_id].held_until_s <= now]
        schedule = self.scheduler.schedule(schedulable)
        self._evict(schedule.paused)
        self._reserve(schedule.disagg_generation_init, now)
        if schedule.context or schedule.generation:
            self._run_forward(schedule, outputs)
        if any(self._requests[r.request_id].finished for r in self._active):
            self._active = [r for r in self._active if not self._requests[r.request_id].finished]
        for request_id in [rid for rid, t in self._requests.items() if t.finished]:
            del self._requests[request_id]
        self.num_steps += 1
        return outputs

    def _run_forward(self, schedule: ScheduleOutput, outputs: list[RequestOutput]) -> None:
        chunks: list[SequenceChunk] = []
        for llm in schedule.context:
            tracked = self._requests[llm.request_id]
            if not self.blocks.has_sequence(llm.request_id):
                reused = self.blocks.add_sequence(llm)
                tracked.num_cached_tokens = max(tracked.num_cached_tokens, reused)
                self._record(tracked, llm.state, EVENT_PREFILL_STARTED)
                self._maybe_hold(tracked, "CONTEXT_IN_PROGRESS")
            position = llm.context_current_position
            end = position + llm.context_chunk_size
            chunks.append(
                SequenceChunk(
                    token_ids=llm.tokens[0][position:end],
                    num_cached_tokens=position,
                    block_ids=self.blocks.block_ids(llm.request_id),
                    want_logits=end == llm.prompt_len,
                )
            )
        for llm in schedule.generation:
            if llm.state is S.DISAGG_GENERATION_TRANS_COMPLETE:
                self._set_state(self._requests[llm.request_id], S.GENERATION_IN_PROGRESS)
            self.blocks.add_token(llm.request_id)
            tokens = llm.tokens[0]
            chunks.append(
                SequenceChunk(
                    token_ids=tokens[-1:],
                    num_cached_tokens=len(tokens) - 1,
                    block_ids=self.blocks.block_ids(llm.request_id),
                    want_logits=True,
                )
            )
        self.num_forward_tokens += sum(len(c.token_ids) for c in chunks)
        if self._before_forward is not None:
            self._before_forward()
        logits = self.runner.forward(chunks)
        sampled = [llm for llm, chunk in zip([*schedule.context, *schedule.generation], chunks, strict=True) if chunk.want_logits]
        if logits.shape[1] > self.vocab_size:
            # Padding rows of the embedding are never tokens. The runner's logits are inference
            # tensors: written in place only inside inference mode (the instance's loop steps
            # outside it; LLM.generate steps inside, which is why only serving a padded vocabulary hit this).
            with torch.inference_mode():
                logits[:, self.vocab_size :] = float("-inf")
        rows = []
        for llm in sampled:
            tracked = self._requests[llm.request_id]
            rows.append(
                SampleRow(tracked.params, tracked.submit.prompt_token_ids, tracked.outputs, len(tracked.outputs))
            )
        result = self.sampler.sample(logits, rows)

        for llm in schedule.context:
            llm.move_to_next_context_chunk()
            if llm.context_remaining_length > 0:
                self._stream_finished_chunks(self._requests[llm.request_id], llm)
        for index, llm in enumerate(sampled):
            tracked = self._requests[llm.request_id]
            token = result.token_ids[index]
            logprobs = result.logprobs[index]
            finishing_context = llm.state is S.CONTEXT_INIT or llm.state is S.DISAGG_CONTEXT_INIT_AND_TRANS
            if finishing_context and self.config.enable_prefix_reuse:
                # Now, not after the first token: a prefill hop's push thread starts reading right after
                # it, and publishing then (hashing every block, holding the GIL) would delay it more.
                self.blocks.store_context_blocks(llm)
            llm.add_new_token(token)
            tracked.outputs.append(token)
            step = tracked.stop.append(token, tracked.detokenizer.append(token))
            text = step.text_delta
            if step.finished:
                text += tracked.stop.flush(tracked.detokenizer.finish())
                self._finish_after_stream(
                    tracked, outputs, [token], text, (logprobs,), step.finish_reason, step.stop_reason
                )
                continue
            if finishing_context and tracked.submit.request_type is RequestType.CONTEXT_ONLY:
                self._set_state(tracked, S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
                self.handover.start_lease(tracked.handover, self._clock())
                if tracked.stream is not None:
                    # Its earlier chunks are pushed or in flight: the tail goes next, then the
                    # commit (released by drain_ready_pushes, once this step's outputs are out).
                    self._finishing_streams.append((tracked.stream, tuple(tracked.outputs)))
                    tracked.stream = None
                elif tracked.pending_push is not None:
                    # The target reserved while this context ran: the push leaves before the
                    # first token is even polled (worker/instance.py starts it after this step).
                    self._ready_pushes.append((tracked.pending_push, None))
                    tracked.pending_push = None
                outputs.append(self._output(tracked, [token], text, (logprobs,), context_done=True))
                continue
            if finishing_context:
                self._set_state(tracked, S.GENERATION_IN_PROGRESS)
            outputs.append(self._output(tracked, [token], text, (logprobs,)))

    # --- eviction, reservation, expiry --------------------------------------------------------------
    def _evict(self, paused: Sequence[LlmRequest]) -> None:
        for llm in paused:
            if self.blocks.has_sequence(llm.request_id):
                self.blocks.remove_sequence(llm.request_id)
            llm.pause(self.scheduler.config.max_input_len_for_pause)
            self.num_pauses += 1
            self._record(self._requests[llm.request_id], llm.state, "paused (recomputed later)")

    def _reserve(self, requests: Sequence[LlmRequest], now: float) -> None:
        for llm in requests:
            tracked = self._requests[llm.request_id]
            self.blocks.add_sequence(llm, reuse=False)
            block_ids = list(self.blocks.block_ids(llm.request_id))
            submit = tracked.submit
            self.handover.reserve(
                tracked.handover, llm.request_id, block_ids, llm.prompt_len, now,
                known_tokens=tuple(tracked.outputs), token_with_kv=submit.token_with_kv,
            )
            self._set_state(tracked, S.DISAGG_GENERATION_TRANS_IN_PROGRESS, f"reserved {len(block_ids)} blocks")

    def drain_new_reservations(self) -> list[Reservation]:
        """Reservations made since the last call (the router hands their transfer ids to senders)."""
        return self.handover.drain_new_reservations()

    def renew(self, request_ids: Sequence[str]) -> int:
        """Extend the live reservations of these requests by their timeout; how many were renewed."""
        now = self._clock()
        renewed = 0
        for request_id in request_ids:
            tracked = self._requests.get(request_id)
            if tracked is not None and not tracked.finished and self.handover.renew(tracked.handover, now):
                renewed += 1
        return renewed

    def _expire(self, now: float, outputs: list[RequestOutput]) -> None:
        for tracked in list(self._requests.values()):
            if tracked.finished:
                continue
            expiry = self.handover.expired(
                tracked.handover, now, waiting_to_send=tracked.llm.state is S.DISAGG_CONTEXT_TRANS_IN_PROGRESS
            )
            if expiry is Expiry.RESERVATION:
                self._fail_transfer(
                    tracked, outputs, ErrorCode.RESERVATION_EXPIRED, FailureReason.RESERVATION_EXPIRED,
                    f"no KV committed within {self.config.reservation_timeout_s}s",
                )
            elif expiry is Expiry.LEASE:
                self._fail_transfer(
                    tracked, outputs, ErrorCode.LEASE_EXPIRED, None,
                    f"KV not taken within the sender lease of {self.config.sender_lease_s}s",
                )

    def _fail_transfer(
        self,
        tracked: _Tracked,
        outputs: list[RequestOutput],
        code: ErrorCode,
        reason: FailureReason | None,
        detail: str,
    ) -> None:
        error = RequestError(code, detail, None if reason is None else reason.value)
        self._finish(tracked, S.DISAGG_TRANS_ERROR, outputs, [], "", (), FinishReason.ERROR, None, error=error)

    # --- hand-over: generation side ---------------------------------------------------------------
    def reservation(self, request_id: str) -> Reservation | None:
        """The reservation of a GENERATION_ONLY request, once its blocks are reserved."""
        tracked = self._requests.get(request_id)
        return None if tracked is None else self.handover.reservation_of(tracked.handover)

    def open_transfer(self, transfer_id: str, request_id: str, peer_layout: KvLayout) -> TransferTarget:
        """TransferSink.open: the reserved blocks behind `transfer_id` (any thread)."""
        return self.handover.open(transfer_id, request_id, peer_layout, self.kv_cache.import_blocks, self.kv_cache.fill_blocks)

    def import_kv(self, transfer_id: str, request_id: str, peer_layout: KvLayout, data: bytes | memoryview) -> None:
        """The in-process hand-over: write a whole request's KV (every layer and block) and commit."""
        target = self.open_transfer(transfer_id, request_id, peer_layout)
        target.write(0, self.layout.num_layers, 0, target.num_blocks, memoryview(data))
        target.commit()
        self._drain_inbox(self._pending_outputs)

    def _on_commit(self, transfer_id: str, token_ids: tuple[int, ...], outputs: list[RequestOutput]) -> None:
        reservation = self.handover.commit(transfer_id)
        if reservation is None:
            return
        tracked = self._requests.get(reservation.request_id)
        if tracked is None or tracked.finished or not self.handover.settle(tracked.handover, reservation):
            return
        llm = tracked.llm
        if tracked.submit.token_with_kv:
            # An early reservation: the first token came with the commit (TransferTarget.commit
            # checked that it continues this request's tokens). It was streamed by the prefill
            # instance already: replay it, do not emit it.
            token = token_ids[-1]
            tracked.outputs.append(token)
            step = tracked.stop.append(token, tracked.detokenizer.append(token))
            if step.finished:  # the prefill instance would have ended the request itself
                self._finish(tracked, S.GENERATION_COMPLETE, outputs, [], "", (), step.finish_reason, step.stop_reason)
                return
        llm.set_state(S.DISAGG_GENERATION_TRANS_COMPLETE)
        llm.context_current_position = llm.prompt_len
        llm.add_new_token(tracked.outputs[-1])  # the first token, from the prefill instance
        self._record(tracked, llm.state, "KV received")
        if self.config.enable_prefix_reuse:
            # Verified KV, reusable by later prompts: published after the step that decodes its
            # next token (publishing hashes every prompt block: not between the two tokens).
            self._unpublished.append(llm)
        self._maybe_hold(tracked)

    def _on_transfer_failed(self, transfer_id: str, failure: TransferFailure, outputs: list[RequestOutput]) -> None:
        reservation = self.handover.find(transfer_id)
        if reservation is None:
            return
        tracked = self._requests.get(reservation.request_id)
        if tracked is None or tracked.finished:
            return
        self.handover.invalidate(reservation)
        self._fail_transfer(tracked, outputs, ErrorCode.TRANSFER_FAILED, failure.reason, failure.detail)

    # --- hand-over: prefill side -------------------------------------------------------------------
    def export_kv(self, request_id: str) -> tuple[KvLayout, bytes]:
        """The in-process hand-over: every layer and block of a request waiting to hand over."""
        source = self.transfer_source(request_id)
        data = source.read(0, self.layout.num_layers, 0, source.num_blocks)
        return self.layout, bytes(data)

    def transfer_source(self, request_id: str) -> EngineTransferSource:
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.llm.state is not S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            raise EngineError(f"request {request_id!r} is not waiting to hand over its KV")
        return EngineTransferSource(self.kv_cache, self.layout, list(self.blocks.block_ids(request_id)))

    def defer_push(self, request_id: str, push: object) -> bool:
        """Keep a push until the request's context is done (True), if it is still computing it;
        False when the push can start now (or cannot start at all: `begin_push` says why)."""
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.finished or tracked.submit.request_type is not RequestType.CONTEXT_ONLY:
            return False
        if tracked.llm.state not in (S.CONTEXT_INIT, S.DISAGG_CONTEXT_INIT_AND_TRANS):
            return False
        tracked.pending_push = push
        self._record(tracked, tracked.llm.state, "KV target reserved: pushing when the context is done")
        return True

    def drain_ready_pushes(self) -> list[tuple[object, EngineTransferSource | None]]:
        """Pushes to start at once: (push, None) for a request whose context completed since the
        last call (its source comes from `begin_push`), (push, source) for one streaming the
        finished chunks of a context still computing (the source is pinned already)."""
        # Called after the step's outputs were published: a streaming push may commit (and report)
        # from here on, so the router always hears of the first token before the push's result.
        for source, output_token_ids in self._finishing_streams:
            source.finish(output_token_ids)
        self._finishing_streams.clear()
        ready, self._ready_pushes = self._ready_pushes, []
        return ready

    def _stream_finished_chunks(self, tracked: _Tracked, llm: LlmRequest) -> None:
        """A context chunk finished and more follow: the full blocks computed so far are final. The
        first time, a relayed push starts on them (its source pinned, as `begin_push` pins);
        afterwards its source learns how far it may read."""
        if not self._stream_kv or (tracked.pending_push is None and tracked.stream is None):
            return
        ready = llm.context_current_position // self.config.tokens_per_block
        if tracked.stream is not None:
            tracked.stream.advance(ready)
            return
        if ready == 0:
            return
        source = EngineTransferSource(self.kv_cache, self.layout, list(self.blocks.block_ids(llm.request_id)), ready_blocks=ready)
        self.handover.pin(tracked.handover)
        self.num_streamed_pushes += 1
        tracked.stream = source
        self._ready_pushes.append((tracked.pending_push, source))
        tracked.pending_push = None
        self._record(tracked, llm.state, f"pushing the KV of finished chunks ({ready} blocks)")

    def _finish_after_stream(
        self, tracked: _Tracked, outputs: list[RequestOutput], tokens: list[int], text: str, logprobs: tuple,
        finish_reason: FinishReason | None, stop_reason: int | str | None,
    ) -> None:
        """The request's first token was its last: end it, once a push streaming its blocks (which
        can no longer complete) has returned, never under the push's reads."""
        stream = tracked.stream
        if stream is None:
            self._finish(tracked, S.GENERATION_COMPLETE, outputs, tokens, text, logprobs, finish_reason, stop_reason)
            return
        tracked.stream = None
        stream.cancel()

        def end(later: list[RequestOutput]) -> None:
            self._finish(tracked, S.GENERATION_COMPLETE, later, tokens, text, logprobs, finish_reason, stop_reason)

        self._end_when_unpinned(tracked, end)

    def begin_push(self, request_id: str) -> EngineTransferSource:
        """Pin the request's blocks for a push from another thread: its lease cannot free them until
        the push's result comes back through `report_push`."""
        source = self.transfer_source(request_id)
        tracked = self._requests[request_id]
        self.handover.pin(tracked.handover)
        source.output_token_ids = tuple(tracked.outputs)  # the commit carries them
        return source

    def report_push(self, request_id: str, failure: TransferFailure | None) -> None:
        """The result of a push (any thread). Acknowledged: the request is done here and its blocks
        are freed. Failed: the request keeps its blocks (still DISAGG_CONTEXT_TRANS_IN_PROGRESS,
        under its lease) so that the router may retry the transfer, or `release` it."""
        self.handover.post(PushReported(request_id, failure))

    def finish_handover(self, request_id: str, failure: TransferFailure | None) -> None:
        """Engine thread, in-process hand-over: acknowledged (None), or failed for good (frees)."""
        if failure is None:
            self._on_push(request_id, None, self._pending_outputs, pinned=False)
        else:
            self.release(request_id, failure)

    def release(self, request_id: str, failure: TransferFailure) -> bool:
        """Engine thread: give up a CONTEXT_ONLY request's hand-over (DISAGG_TRANS_ERROR, blocks freed)."""
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.finished or tracked.llm.state is not S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            return False

        def end(outputs: list[RequestOutput]) -> None:
            self._fail_transfer(tracked, outputs, ErrorCode.TRANSFER_FAILED, failure.reason, failure.detail)

        self._end_when_unpinned(tracked, end)
        return True

    def _end_when_unpinned(self, tracked: _Tracked, end: EndRequest) -> None:
        timing = self.handover.defer_end(tracked.handover, end)
        if timing is EndTiming.DEFERRED:
            self._record(tracked, tracked.llm.state, "ending once the push in flight returns")
        elif timing is EndTiming.NOW:
            end(self._pending_outputs)

    def _on_push(self, request_id: str, failure: TransferFailure | None, outputs: list[RequestOutput], pinned: bool) -> None:
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.finished:
            return
        if pinned and tracked.stream is not None:
            tracked.stream = None  # the push streaming its chunks returned (it failed: it had not committed)
        if pinned:
            after = self.handover.unpin(tracked.handover)
            if after is Unpinned.END:
                tracked.handover.deferred_end(outputs)
            if after is not Unpinned.REPORT:
                return
        if tracked.llm.state is not S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            return
        if failure is None:
            def end(end_outputs: list[RequestOutput]) -> None:
                self._finish(tracked, S.DISAGG_CONTEXT_COMPLETE, end_outputs, [], "", (), None, None, handed_over=True)

            # An earlier push may still read the blocks: one the router gave up as stalled and
            # retried to another receiver, which this push is. The request ends once it returns.
            timing = self.handover.defer_end(tracked.handover, end)
            if timing is EndTiming.NOW:
                end(outputs)
            elif timing is EndTiming.DEFERRED:
                self._record(tracked, tracked.llm.state, "handed over: ending once the push still in flight returns")
        else:
            self._record(tracked, tracked.llm.state, f"push failed: {failure}")

    # --- abort -------------------------------------------------------------------------------------
    def abort(self, request_id: str, detail: str = "aborted") -> bool:
        """End a request in any state and free its blocks; False if the engine does not have it."""
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.finished:
            return False
        self.handover.cancel(tracked.handover)  # waits for a write in progress
        if tracked.stream is not None:  # a push waiting for chunks that will not come: fail it now
            tracked.stream.cancel()
            tracked.stream = None
        error = RequestError(ErrorCode.ABORTED, detail)

        def end(outputs: list[RequestOutput]) -> None:
            self._finish(tracked, S.GENERATION_COMPLETE, outputs, [], "", (), FinishReason.ABORT, None, error=error)

        self._end_when_unpinned(tracked, end)
        return True

    # --- common end of a request -------------------------------------------------------------------
    def _finish(
        self,
        tracked: _Tracked,
        state: LlmRequestState,
        outputs: list[RequestOutput],
        tokens: list[int],
        text: str,
        logprobs: tuple,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        *,
        error: RequestError | None = None,
        handed_over: bool = False,
    ) -> None:
        llm = tracked.llm
        self.handover.forget(tracked.handover)
        if self.blocks.has_sequence(llm.request_id):
            self.blocks.remove_sequence(llm.request_id)
        self._set_state(tracked, state, error.detail if error else "")
        tracked.finished = True
        self.num_finished += 1
        outputs.append(
            self._output(
                tracked, tokens, text, logprobs, finished=True, finish_reason=finish_reason,
                stop_reason=stop_reason, error=error, handed_over=handed_over,
            )
        )

    def _output(self, tracked: _Tracked, tokens: list[int], text: str, logprobs: tuple, **fields) -> RequestOutput:
        return RequestOutput(
            request_id=tracked.submit.request_id,
            new_token_ids=tuple(tokens),
            text_delta=text,
            logprobs=logprobs if tracked.params.logprobs is not None else (),
            num_prompt_tokens=len(tracked.submit.prompt_token_ids),
            num_output_tokens=len(tracked.outputs),
            num_cached_tokens=tracked.num_cached_tokens,
            **fields,
        )

    # --- states, events, holds ---------------------------------------------------------------------
    def _set_state(self, tracked: _Tracked, state: LlmRequestState, detail: str = "") -> None:
        tracked.llm.set_state(state)
        self._record(tracked, state, detail)
        self._maybe_hold(tracked)

    def _record(self, tracked: _Tracked, state: LlmRequestState, detail: str) -> None:
        event = StateEvent(tracked.submit.request_id, state, self._clock(), detail)
        tracked.timeline.append(event)
        self._events.append(event)

    def _maybe_hold(self, tracked: _Tracked, state_name: str | None = None) -> None:
        if self._hold_hook is None:
            return
        seconds = self._hold_hook(tracked.submit.request_id, state_name or tracked.llm.state.name)
        if seconds > 0:
            tracked.held_until_s = self._clock() + seconds

    def drain_events(self) -> list[StateEvent]:
        events, self._events = self._events, []
        return events

    def _drain_inbox(self, outputs: list[RequestOutput]) -> None:
        for message in self.handover.inbox():
            match message:
                case KvCommitted():
                    self._on_commit(message.transfer_id, message.token_ids, outputs)
                case KvWriteFailed():
                    self._on_transfer_failed(message.transfer_id, message.failure, outputs)
                case PushReported():
                    self._on_push(message.request_id, message.failure, outputs, pinned=True)

    def kv_digest(self, request_id: str, num_tokens: int) -> str:
        """sha256 over the KV of token positions [0, num_tokens) of a request, every layer."""
        if not self.blocks.has_sequence(request_id):
            raise EngineError(f"request {request_id!r} holds no KV")
        block_ids = self.blocks.block_ids(request_id)
        tpb = self.config.tokens_per_block
        if not 0 < num_tokens <= len(block_ids) * tpb:
            raise EngineError(f"{num_tokens} tokens do not fit the request's {len(block_ids)} blocks")
        digest = hashlib.sha256()
        with torch.inference_mode():
            run = self.kv_cache.export_blocks(block_ids[: -(-num_tokens // tpb)], 0, self.layout.num_layers)
            # [layers, 2, blocks, tokens/block, heads, dim] -> [layers, 2, positions, heads, dim]
            flat = run.reshape(run.shape[0], 2, -1, *run.shape[4:])[:, :, :num_tokens]
            digest.update(flat.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    # --- introspection -----------------------------------------------------------------------------
    def state_of(self, request_id: str) -> LlmRequestState | None:
        tracked = self._requests.get(request_id)
        return None if tracked is None else tracked.llm.state

    def timeline(self, request_id: str) -> list[StateEvent]:
        tracked = self._requests.get(request_id)
        return [] if tracked is None else list(tracked.timeline)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def load(self) -> EngineLoad:
        queued = running = queued_tokens = in_flight = pending = 0
        for llm in self._active:
            state = llm.state
            if state is S.CONTEXT_INIT and not self.blocks.has_sequence(llm.request_id):
                queued += 1
                queued_tokens += llm.prompt_len
            else:
                running += 1
                in_flight += llm.num_tokens(0)
                if state is S.CONTEXT_INIT or state is S.DISAGG_CONTEXT_INIT_AND_TRANS:
                    pending += llm.context_remaining_length  # a context in progress: its chunks still to run
        return EngineLoad(
            role=self.config.role,
            total_blocks=self.blocks.num_blocks,
            free_blocks=self.blocks.num_free_blocks,
            tokens_per_block=self.config.tokens_per_block,
            queued_requests=queued,
            running_requests=running,
            queued_prompt_tokens=queued_tokens,
            tokens_in_flight=in_flight,
            num_paused=self.num_pauses,
            prefix_events=tuple(self.blocks.drain_events()),
            num_finished=self.num_finished,
            pending_context_tokens=queued_tokens + pending,
        )
