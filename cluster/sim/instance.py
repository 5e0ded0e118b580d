"""A simulated instance: the engine's step loop over the real scheduler, with model time instead of a model.

It runs what worker/engine.py runs each step, in the same order, on the same objects: the two-level
scheduler (scheduler/scheduler.py) over LlmRequests, the block manager with prefix reuse, eviction
of paused requests (recomputed later), reservations for generation-only requests, chunked context,
the roles and the hand-over states of both sides, reservation and lease expiry, and the same local
state events. What it does not run is the forward pass and the sampler: a step takes the profile's
time for its batch (cluster/sim/profile.py) on the event loop's (virtual) clock, and tokens are a
pure function of (seed, position) as worker/instant.py's.

Why not the Engine itself with a swapped runner (worker/engine.py has that seam, `runner_factory`):
the Engine holds torch tensors (the paged cache, the sampler's logits), so `cluster/` could not
import it (tests/unit/test_layering.py), and its per-step torch work would cost more than the
whole simulated step budget at 256 instances. The parity this module owes the engine is held by
tests/unit/test_sim_instance.py, which runs both on one workload.

It is its own InstanceClient (cluster/router/instance_client.py): the router calls it directly on
its event loop. Each call costs `rpc_latency_s` of virtual time (a Ray actor call's round trip);
a poll waits for mail as the real long poll does. A killed instance answers every call with
InstanceUnavailable, as a dead Ray actor does.

A profile with a spread (StepProfile.step_time_ratios, and context_step_time_ratios for the steps
that run context) makes each step take its model time times a factor drawn from it (the instance's
own generator, seeded by the simulation: a rerun is identical).
A profile with contention (instances sharing one host's cores) also makes it take
`StepProfile.contended` of the number of the simulation's other instances mid-step as it starts.

KV transfers take the link model's time (cluster/sim/link.py) plus the profile's control-path cost;
transfer faults come from the deployment's fault plan (worker/kv_transfer/faults.py), drawn per
transfer and chunk as the real sender and receiver draw them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.router.instance_client import InstanceRejected, InstanceUnavailable
from cluster.sim.capacity import pool_blocks
from cluster.sim.handover import HandoverSide, SimRequest
from cluster.sim.link import Network
from cluster.sim.profile import StepProfile, context_pairs
from scheduler.block_manager import BlockManager
from scheduler.request import LlmRequest
from scheduler.scheduler import ScheduleOutput, TwoLevelScheduler
from scheduler.state import LlmRequestState
from worker.engine_types import EngineConfig, hop_max_new_tokens, kv_pool_refusal
from worker.instant import instant_token
from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason
from worker.kv_transfer.faults import FaultInjector
from worker.protocol import (
    EVENT_PREFILL_STARTED,
    REQUEST_TYPES_BY_ROLE,
    EngineLoad,
    ErrorCode,
    InstanceInfo,
    PollBatch,
    PushResult,
    RequestError,
    RequestOutput,
    RequestType,
    ReservationNotice,
    StateEvent,
    SubmitRequest,
)
from worker.stopping import FinishReason

S = LlmRequestState
_CONTEXT_INIT = S.CONTEXT_INIT
_CONTEXT_INIT_AND_TRANS = S.DISAGG_CONTEXT_INIT_AND_TRANS


class _HeldTokens:
    """A request's token output held for the stream interval: the tokens of consecutive steps are
    appended here (not a new output per merged token) and become one RequestOutput when it goes out."""

    __slots__ = ("request_id", "first_s", "tokens", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens")

    def __init__(
        self, request_id: str, first_s: float, tokens: list[int], num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int
    ) -> None:
        self.request_id = request_id
        self.first_s = first_s  # when its first token was held: it is due an interval later
        self.tokens = tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        self.num_cached_tokens = num_cached_tokens

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id, tuple(self.tokens), "", num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens, num_cached_tokens=self.num_cached_tokens,
        )


@dataclass
class InstanceStats:
    busy_s: float = 0.0
    steps: int = 0
    context_tokens: int = 0
    generated_tokens: int = 0
    pauses: int = 0
    transfers_sent: int = 0
    transfers_failed: int = 0
    bytes_sent: int = 0
    finished: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    # Steps the engine's request limits bound: it admitted max_num_requests while it held more, or
    # ran max_batch_size while it admitted more (those limits, not the KV pool or the step time,
    # kept the rest waiting).
    request_limited_steps: int = 0


class SimNetwork:
    """Every simulated instance of one simulation, by transfer address, and the NIC queues."""

    def __init__(self, network: Network, faults: FaultInjector | None = None) -> None:
        self.network = network
        self.faults = faults if faults is not None and faults.enabled else None
        self.by_address: dict[str, SimInstance] = {}
        self.mid_step = 0  # instances whose step has started and not completed (StepProfile.contention)


class SimInstance(HandoverSide):
    """One simulated instance; also its own InstanceClient."""

    def __init__(
        self,
        instance_id: str,
        config: EngineConfig,
        profile: StepProfile,
        network: SimNetwork,
        *,
        vocab_size: int = 32000,
        max_seq_len: int = 4096,
        rpc_latency_s: float = 0.5e-3,
        stream_interval_s: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.config = config
        self.role = config.role
        self.profile = profile
        self.net = network
        self.vocab_size = vocab_size
        self.max_seq_len = min(config.max_seq_len or max_seq_len, max_seq_len)
        self.rpc_latency_s = rpc_latency_s
        # 0: every step's tokens are reported at once (duet's engine). > 0: a request's tokens of
        # consecutive steps are merged into one output, reported at most this long after the first
        # of them (vLLM's and trtllm-serve's stream_interval). First tokens, ends, errors, state
        # events, reservations and push results are never held, so TTFT, TPOT and e2e are exact;
        # ITL is seen in chunks. It cuts the router's per-token work for very large simulations.
        # A poll takes the held outputs that are due and those of requests with other mail in it;
        # the others stay held. Polls come when they would if every held output went with each
        # (a flush timer armed at a request's first held token since the last poll, a poll at the
        # flush if anything was added since the last), so loads, events and every decision are
        # those of that scheme, and a held output goes out with the first poll once it is due
        # (within about two intervals of its first token when nothing else polls).
        self.stream_interval_s = stream_interval_s
        # Draws each step's spread (StepProfile.step_time_ratios); seeded per instance by the cluster.
        self._rng = rng if rng is not None else random.Random(instance_id)
        tpb = config.tokens_per_block
        self.num_blocks = pool_blocks(config, profile)
        self.address = f"sim:{instance_id}"
        network.by_address[self.address] = self
        self.layout = KvLayout(
            num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=tpb, dtype="float32", model_fingerprint=profile.model
        )
        self.stats = InstanceStats()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        # (context tokens, context pairs, generation requests, their context tokens, cached tokens the
        # context chunks attend) per step, when a list: the engine parity test compares it with the
        # Engine's (tests/unit/test_sim_instance.py).
        self.step_log: list[tuple[int, int, int, int, int]] | None = None
        self._generation = 0  # incarnation counter: timers of a killed incarnation do nothing
        self._mid_step = False  # counted in network.mid_step
        self.dead = False
        self._reset()

    def _reset(self) -> None:
        cfg = self.config
        self.blocks = BlockManager(cfg.block_manager_config(self.num_blocks, self.max_seq_len))
        self.scheduler = TwoLevelScheduler(cfg.scheduler_config(), self.blocks)
        self._requests: dict[str, SimRequest] = {}
        self._active: list[LlmRequest] = []
        self._outputs: list[RequestOutput | _HeldTokens] = []
        self._merge: dict[str, _HeldTokens] = {}  # request id -> its held token output (in _outputs)
        self._merged_since_poll: set[str] = set()  # requests with a held token since the last poll
        self._added_since_poll = False  # an output was added since the last poll
        self._urgent = False  # _outputs holds something that is not held (stream_interval_s)
        self._flush_at: float | None = None
        self._events: list[StateEvent] = []
        # A landed hand-over's events by request (its commit, then the decode step taking it up),
        # held as worker/instance.py holds them (`_AFTER_THE_STEP`): they go out with that step's
        # token, or before its pass when the step's planning publishes other mail; never alone in
        # the middle of the step. Any other event of the request takes them out first (order kept).
        self._held_events: dict[str, list[StateEvent]] = {}
        self._reservations: list[ReservationNotice] = []
        self._pushes: list[PushResult] = []
        self._sequence = 0
        self._stepping = False
        self._waiter: asyncio.Future | None = None  # the poll waiting for mail
        self._generation += 1
        self.incarnation = f"sim-{self.instance_id}-{self._generation}"
        self.draining = False

    # --- clock and timers ---------------------------------------------------------------------------
    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = self._event_loop
        if loop is None:  # the loop that runs the simulation: the first call's (one per run)
            loop = self._event_loop = asyncio.get_running_loop()
        return loop

    def _now(self) -> float:
        return self._loop.time()

    def _at(self, when_s: float, callback: Callable[..., None], *args: object) -> asyncio.TimerHandle:
        generation = self._generation

        def fire() -> None:
            if self._generation == generation and not self.dead:
                callback(*args)

        return self._loop.call_at(when_s, fire)

    async def _rpc(self) -> None:
        if self.rpc_latency_s:
            await asyncio.sleep(self.rpc_latency_s)
        if self.dead:
            raise InstanceUnavailable(f"{self.instance_id}: killed")

    # --- faults: the process dies, or comes back ------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL: everything it held is gone; every call fails until `restart`."""
        self.dead = True
        self._generation += 1
        self._end_step()  # its step's completion will never fire
        self._wake()  # a poll waiting for mail answers (with InstanceUnavailable)

    def restart(self) -> None:
        """A new process under the same id (a new incarnation, empty)."""
        self.dead = False
        self.blocks.close()  # what the old process cached is gone, and freed now (no cyclic collection runs)
        self._reset()

    # --- InstanceClient ----------------------------------------------------------------------------------
    async def get_info(self) -> InstanceInfo:
        await self._rpc()
        return InstanceInfo(
            self.instance_id, self.role, self.incarnation, self.address, self.layout, self.num_blocks,
            self.vocab_size, self.max_seq_len, 0, f"sim:{self.profile.device}", architecture=self.profile.model,
        )

    async def ping(self) -> str:
        await self._rpc()
        return self.incarnation

    async def submit(self, request: SubmitRequest) -> None:
        await self._rpc()
        if self.draining:
            raise InstanceUnavailable(f"{self.instance_id}: draining")
        rid = request.request_id
        if rid in self._requests:
            raise InstanceRejected("request_id", f"request {rid!r} is already in this engine")
        if request.request_type not in REQUEST_TYPES_BY_ROLE[self.role]:
            raise InstanceRejected("request_type", f"a {self.role.name} instance does not take {request.request_type.name}")
        context = request.context_token_ids
        if len(context) >= self.max_seq_len:
            raise InstanceRejected("prompt_token_ids", f"{len(context)} context tokens leave no room in max_seq_len {self.max_seq_len}")
        params = request.sampling_params
        produced = len(request.output_token_ids)
        generation_only = request.request_type is RequestType.GENERATION_ONLY
        state = S.DISAGG_GENERATION_INIT if generation_only else S.CONTEXT_INIT
        llm = LlmRequest(rid, context, hop_max_new_tokens(request, self.max_seq_len), priority=request.priority, state=state)
        refusal = kv_pool_refusal(self.blocks, llm)
        if refusal is not None:  # as worker/engine.py add_request refuses it
            raise InstanceRejected("sampling_params.max_tokens", refusal)
        self._requests[rid] = SimRequest(request, llm, params.seed or 0, produced, params.max_tokens)
        self._active.append(llm)
        self._event(rid, state, "submitted")
        self._kick()

    async def abort(self, request_id: str, detail: str) -> None:
        await self._rpc()
        request = self._requests.get(request_id)
        if request is None or request.finished:
            return

        self._cancel_push(request, f"the request was aborted: {detail}")
        self._finish(request, S.GENERATION_COMPLETE, 0, FinishReason.ABORT, error=RequestError(ErrorCode.ABORTED, detail))
        self._after_change()

    async def release(self, request_id: str, reason: FailureReason, detail: str) -> None:
        await self._rpc()
        request = self._requests.get(request_id)
        if request is None or request.finished or request.llm.state is not S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            return

        self._cancel_push(request, f"the hand-over was released: {detail}")
        error = RequestError(ErrorCode.TRANSFER_FAILED, detail, reason.value)
        self._finish(request, S.DISAGG_TRANS_ERROR, 0, FinishReason.ERROR, error=error)
        self._after_change()

    async def push(self, request_id: str, target: str, transfer_id: str, deadline_s: float, target_request_id: str) -> None:
        await self._rpc()
        request = self._requests.get(request_id)
        if (
            request is not None
            and not request.finished
            and request.submit.request_type is RequestType.CONTEXT_ONLY
            and request.llm.state in (S.CONTEXT_INIT, S.DISAGG_CONTEXT_INIT_AND_TRANS)
        ):
            request.pending_push = (target, transfer_id, deadline_s, target_request_id or request_id)
            return
        if request is None or request.finished or request.llm.state is not S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            detail = f"request {request_id!r} is not waiting to hand over its KV"
            self._pushes.append(PushResult(request_id, transfer_id, False, FailureReason.UNKNOWN_TRANSFER.value, detail, 0, 0.0))
            self._wake()
            return
        # The router pushes a request again only once it gave the earlier push up (worker/instance.py).
        self._cancel_push(request, f"superseded by transfer {transfer_id}")
        self._transfer(request, target, transfer_id, deadline_s, target_request_id or request_id)

    async def renew(self, request_ids: tuple[str, ...]) -> None:
        """Push the expiry of these early reservations out by their timeout (worker/handover.py renew)."""
        await self._rpc()
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None or request.finished or request.llm.state is not S.DISAGG_GENERATION_TRANS_IN_PROGRESS:
                continue
            if request.expiry is not None:
                request.expiry.cancel()
            transfer_id = request.transfer_id
            request.expiry = self._at(self._now() + self.config.reservation_timeout_s, self._reservation_expired, request, transfer_id)

    async def poll(self, timeout_s: float) -> PollBatch:
        if self.dead:
            await self._rpc()
        if not self._has_mail():
            # A bare future and one timer (not wait_for on an Event, which costs a task per poll):
            # this runs once per engine step of every instance.
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _resolve, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        await self._rpc()  # the answer's trip; what arrives meanwhile travels with it
        return self._take_mail()

    async def drain(self, timeout_s: float) -> int:
        await self._rpc()
        self.draining = True
        return len(self._requests)

    # --- mail -----------------------------------------------------------------------------------------
    def _has_mail(self) -> bool:
        """Mail to answer a poll with now (held token outputs wait for their flush)."""
        return bool(self._urgent or self._events or self._reservations or self._pushes)

    def _wake(self) -> None:
        """A poll waiting for mail answers (only when there is some: an empty answer is a wasted trip)."""
        waiter = self._waiter
        if waiter is not None and (self.dead or self._has_mail()):
            _resolve(waiter)

    def _flush(self) -> None:
        self._flush_at = None
        if self._added_since_poll:
            self._urgent = True
            self._wake()

    def _take_mail(self) -> PollBatch:
        outputs, self._outputs = self._outputs, []
        if self._merge:
            outputs = self._take_outputs(outputs)
        self._merged_since_poll.clear()
        self._added_since_poll = False
        self._urgent = False
        events, self._events = self._events, []
        reservations, self._reservations = self._reservations, []
        pushes, self._pushes = self._pushes, []
        self._sequence += 1
        return PollBatch(self.incarnation, self._sequence, tuple(outputs), tuple(events), tuple(reservations), tuple(pushes), self.load())

    def _take_outputs(self, outputs: list[RequestOutput | _HeldTokens]) -> list[RequestOutput]:
        """What a poll takes of the outputs (in order): every one not held, the held ones that are due,
        and those of requests with other mail in this poll (they go before it, in order); the rest
        stay held."""
        due_s = self._now() - self.stream_interval_s
        with_mail = {output.request_id for output in outputs if type(output) is not _HeldTokens}
        with_mail.update(event.request_id for event in self._events)
        taken: list[RequestOutput] = []
        for output in outputs:
            if type(output) is not _HeldTokens:
                taken.append(output)
            elif output.first_s <= due_s or output.request_id in with_mail:
                taken.append(output.output())
                del self._merge[output.request_id]
            else:
                self._outputs.append(output)
        return taken

    def load(self) -> EngineLoad:
        """worker/engine.py Engine.load, computed the same way."""
        queued = queued_tokens = in_flight = pending = 0
        blocks = self.blocks
        sequences = blocks.sequences  # has_sequence, without a call per request (every poll walks them all)
        active = self._active
        for llm in active:
            state = llm.state
            if state is _CONTEXT_INIT and llm.request_id not in sequences:
                queued += 1
                queued_tokens += llm.prompt_len
            else:
                in_flight += len(llm.tokens[0])
                if state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS:
                    pending += llm.context_remaining_length
        running = len(active) - queued
        return EngineLoad(
            role=self.role,
            total_blocks=blocks.num_blocks,
            free_blocks=blocks.num_free_blocks,
            tokens_per_block=self.config.tokens_per_block,
            queued_requests=queued,
            running_requests=running,
            queued_prompt_tokens=queued_tokens,
            tokens_in_flight=in_flight,
            num_paused=self.stats.pauses,
            prefix_events=tuple(blocks.drain_events()),
            num_finished=self.stats.finished,
            pending_context_tokens=queued_tokens + pending,
        )

    def _event(self, request_id: str, state: LlmRequestState, detail: str = "") -> None:
        if self._held_events and request_id in self._held_events:
            self._events.extend(self._held_events.pop(request_id))
        self._events.append(StateEvent(request_id, state, self._now(), detail))

    def _hold_event(self, request_id: str, state: LlmRequestState, detail: str = "") -> None:
        """An event of a landed hand-over (`_held_events`)."""
        self._held_events.setdefault(request_id, []).append(StateEvent(request_id, state, self._now(), detail))

    def _release_held(self, request_ids: list[str]) -> None:
        held = self._held_events
        for request_id in request_ids:
            events = held.pop(request_id, None)
            if events:
                self._events.extend(events)

    def _set_state(self, request: SimRequest, state: LlmRequestState, detail: str = "") -> None:
        request.llm.set_state(state)
        self._event(request.submit.request_id, state, detail)

    def _output(self, request: SimRequest, tokens: tuple[int, ...], **fields: object) -> None:
        if self.stream_interval_s and not fields:
            self._hold(request, tokens)
            return
        rid = request.submit.request_id
        self._urgent = True
        self._added_since_poll = True
        self._outputs.append(
            RequestOutput(
                rid, tokens, "",
                num_prompt_tokens=len(request.submit.prompt_token_ids),
                num_output_tokens=request.num_outputs,
                num_cached_tokens=request.num_cached_tokens,
                **fields,
            )
        )

    def _hold(self, request: SimRequest, tokens: tuple[int, ...]) -> None:
        """`_output` of plain tokens with a stream interval: held, merged into the request's held output."""
        rid = request.submit.request_id
        held = self._merge.get(rid)
        if held is not None:  # merge into the held output of this request
            held.tokens.extend(tokens)
            held.num_output_tokens = request.num_outputs
        else:
            self._merge[rid] = held = _HeldTokens(
                rid, self._now(), list(tokens), len(request.submit.prompt_token_ids), request.num_outputs,
                request.num_cached_tokens,
            )
            self._outputs.append(held)
        self._added_since_poll = True
        if rid not in self._merged_since_poll:
            self._merged_since_poll.add(rid)
            if self._flush_at is None:
                self._flush_at = self._now() + self.stream_interval_s
                self._at(self._flush_at, self._flush)

    # --- the step loop (worker/engine.py Engine.step, forward pass replaced by model time) ------------------
    def _kick(self) -> None:
        if not self._stepping and self._active:
            self._stepping = True
            self._loop.call_soon(self._step, self._generation)

    def _after_change(self) -> None:
        """Blocks were freed or mail was posted outside a step."""
        self._wake()
        self._kick()

    def _step(self, generation: int) -> None:
        if generation != self._generation or self.dead:
            return
        now = self._now()
        mail_before = len(self._events) + len(self._reservations)
        schedule = self.scheduler.schedule(self._active)
        self._evict(schedule.paused)
        self._reserve(schedule.disagg_generation_init, now)
        if not (schedule.context or schedule.generation):
            self._stepping = False
            self._wake()
            return
        engine, admitted = self.config, schedule.num_admitted
        if (admitted >= engine.max_num_requests and len(self._active) > admitted) or (
            len(schedule.context) + len(schedule.generation) >= engine.max_batch_size and admitted > engine.max_batch_size
        ):
            self.stats.request_limited_steps += 1
        context_tokens = pairs = decode_context = cached = 0
        for llm in schedule.context:
            request = self._requests[llm.request_id]
            if not self.blocks.has_sequence(llm.request_id):
                reused = self.blocks.add_sequence(llm)
                request.num_cached_tokens = max(request.num_cached_tokens, reused)
                self._event(llm.request_id, llm.state, EVENT_PREFILL_STARTED)
            chunk, position = llm.context_chunk_size, llm.context_current_position
            context_tokens += chunk
            pairs += context_pairs(position, chunk)
            cached += position
        trans_complete = S.DISAGG_GENERATION_TRANS_COMPLETE
        landed: list[str] = []
        for llm in schedule.generation:
            if llm.state is trans_complete:
                llm.set_state(S.GENERATION_IN_PROGRESS)
                self._hold_event(llm.request_id, S.GENERATION_IN_PROGRESS)
                landed.append(llm.request_id)
            decode_context += len(llm.tokens[0])
        if landed and len(self._events) + len(self._reservations) > mail_before:
            self._release_held(landed)  # the planning publishes before the pass: they go with it
            landed = []
        self.blocks.add_token_to_each(schedule.generation)
        step_s = self.profile.step_s(context_tokens, pairs, len(schedule.generation), decode_context, cached)
        if self.profile.step_time_ratios:
            step_s *= self.profile.step_factor(self._rng.random(), context_tokens > 0)
        net = self.net
        if self.profile.contention:
            step_s *= self.profile.contended(net.mid_step)
        net.mid_step += 1
        self._mid_step = True
        if self.step_log is not None:
            self.step_log.append((context_tokens, pairs, len(schedule.generation), decode_context, cached))
        stats = self.stats
        stats.busy_s += step_s
        stats.steps += 1
        stats.context_tokens += context_tokens
        self._wake()  # events of this step's start (prefill started) go out now
        self._at(now + step_s, self._complete, schedule, landed)

    def _end_step(self) -> None:
        if self._mid_step:
            self._mid_step = False
            self.net.mid_step -= 1

    def _complete(self, schedule: ScheduleOutput, landed: list[str]) -> None:
        """The step's end: its tokens, and the events held for the hand-overs it took up (`landed`:
        the requests whose held events did not go out before the pass)."""
        self._end_step()
        reuse = self.config.enable_prefix_reuse
        requests = self._requests
        vocab = self.vocab_size
        max_seq_len = self.max_seq_len
        done: set[str] = set()
        for llm in schedule.context:
            llm.move_to_next_context_chunk()
        sampled = [llm for llm in schedule.context if llm.context_remaining_length == 0]
        sampled.extend(schedule.generation)
        self.stats.generated_tokens += len(sampled)
        # Held outputs to merge this step's tokens into (stream_interval_s): the common case of a
        # generating request's token, taken here without building a tuple and a call per token.
        merge = self._merge if self.stream_interval_s else None
        merged_since_poll = self._merged_since_poll
        for llm in sampled:
            rid = llm.request_id
            request = requests.get(rid)
            if request is None or request.finished:
                continue  # aborted during the step: its blocks are gone already
            state = llm.state
            finishing_context = state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS
            if finishing_context and reuse:
                self.blocks.store_context_blocks(llm)
            num_outputs = request.num_outputs
            token = instant_token(request.seed, num_outputs, vocab)
            tokens = llm.tokens[0]
            tokens.append(token)  # llm.add_new_token(token)
            request.num_outputs = num_outputs = num_outputs + 1
            if num_outputs >= request.max_tokens or len(tokens) >= max_seq_len:
                self._finish(request, S.GENERATION_COMPLETE, token, FinishReason.LENGTH)
                done.add(llm.request_id)
                continue
            if finishing_context and request.submit.request_type is RequestType.CONTEXT_ONLY:
                self._set_state(request, S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
                request.expiry = self._at(self._now() + self.config.sender_lease_s, self._lease_expired, request)
                self._output(request, (token,), context_done=True)
                if request.pending_push is not None:
                    target, transfer_id, deadline_s, target_request_id = request.pending_push
                    request.pending_push = None
                    self._transfer(request, target, transfer_id, deadline_s, target_request_id)
                continue
            if finishing_context:
                self._set_state(request, S.GENERATION_IN_PROGRESS)
            elif merge is not None:
                if rid in merged_since_poll:  # as _hold merges it
                    held = merge[rid]
                    held.tokens.append(token)
                    held.num_output_tokens = num_outputs
                else:
                    self._hold(request, (token,))
                continue
            self._output(request, (token,))
        if done:
            self._active = [llm for llm in self._active if llm.request_id not in done]
        if landed:
            self._release_held(landed)
        self._wake()
        self._stepping = False
        self._kick()

    def _evict(self, paused: list[LlmRequest]) -> None:
        for llm in paused:
            if self.blocks.has_sequence(llm.request_id):
                self.blocks.remove_sequence(llm.request_id)
            llm.pause(self.scheduler.config.max_input_len_for_pause)
            self.stats.pauses += 1
            self._event(llm.request_id, llm.state, "paused (recomputed later)")

    def _finish(
        self,
        request: SimRequest,
        state: LlmRequestState,
        token: int | None,
        reason: FinishReason | None,
        *,
        error: RequestError | None = None,
        handed_over: bool = False,
    ) -> None:
        llm = request.llm
        if request.expiry is not None:
            request.expiry.cancel()  # 100,000 requests would otherwise leave as many dead timers queued
        if self.blocks.has_sequence(llm.request_id):
            self.blocks.remove_sequence(llm.request_id)
        self._set_state(request, state, error.detail if error else "")
        request.finished = True
        self.stats.finished += 1
        tokens = (token,) if reason is FinishReason.LENGTH and token is not None else ()
        self._output(request, tokens, finished=True, finish_reason=reason, error=error, handed_over=handed_over)
        del self._requests[llm.request_id]
        if reason is not FinishReason.LENGTH:  # a step's finishers leave the active list in _complete
            self._active = [r for r in self._active if r is not llm]

    # --- read by the simulation's report -------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def check_integrity(self) -> None:
        self.blocks.check_integrity()


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
