"""The global router: admission, placement, the disaggregated flow, health and recovery.

One asyncio event loop runs it (the front end's). For every instance a poll task long-polls its
mailbox: token outputs, local state events, KV reservations, push results and a load snapshot.
The router turns those into each request's global state machine (cluster/request_state.py, one
timestamp per transition, the transition table enforced) and into the client's event stream.

The disaggregated flow of a request (engine request ids carry the hop and attempt: "<id>.p1",
"<id>.g1", "<id>.c1"):

  QUEUED -> place (generation hop first, then conditional disaggregation, then prefill hop)
  CONTEXT_WAIT        submit CONTEXT_ONLY to the prefill instance
  CONTEXT_IN_PROGRESS its first chunk is scheduled ("prefill started")
  GENERATION_INIT     its first token streams to the client; submit GENERATION_ONLY (prompt +
                      first token) to the generation instance, which reserves blocks
  TRANSMISSION        the reservation's transfer id goes to the prefill instance, which pushes
  GENERATING          the generation instance committed the KV; its tokens stream to the client
  COMPLETE

Colocated requests (conditional disaggregation, or a configured fallback) run CONTEXT_AND_GENERATION
on one GENERATION/MIXED instance.

Recovery (the configured chain, bounded, RouterConfig.recovery): when a transfer fails, a stage
times out or an instance dies, the router picks the first applicable action with attempts left:
RETRY_TRANSFER (the prefill instance still holds the KV: reserve again and push again),
REPREFILL_ELSEWHERE (run the prefill hop again on another instance), RECOMPUTE_LOCAL (a generation
instance runs prompt + tokens so far itself), FAIL (a clear status). Seeds are fixed at admission and
sampling is keyed by (seed, output position), so a recovered request produces exactly the tokens of
a fault-free run, and tokens already streamed are never streamed again.

Aborts (client cancel, deadline, Abort RPC) reach every instance the request touched and free its
blocks there. Client errors never count against an instance's health: only failed or late polls and
unreachable calls do.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import itertools
import logging
import random
import time
import traceback
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cluster.router.api import (
    ClientRequest,
    ClusterView,
    ErrorKind,
    FinalEvent,
    InstanceHealthView,
    InstanceUse,
    InstanceView,
    Outcome,
    RequestEvent,
    RequestView,
    RouterError,
    TimelineEntry,
    TokenEvent,
    Usage,
)
from cluster.router.config import RecoveryAction, RouterConfig
from cluster.router.instance_client import InstanceClient, InstanceRejected, InstanceUnavailable
from cluster.router.observe import RouterMetrics, TimelineLog
from cluster.router.placement import Candidate, InstanceHealth, NoInstanceAvailable, PlacementRequest, Placer
from cluster.router.prefix_index import PrefixIndex
from cluster.router.snapshot import InstanceSnapshot
from cluster.router.state import (
    TRANSITIONS,
    GlobalState,
    IllegalTransition,
    RequestTimeline,
    Route,
    global_states_for_local,
)
from cluster.shutdown import STOP_TIMEOUT_S, cancel_and_wait
from scheduler.block_hash import block_hash_chain
from worker.kv_transfer.failures import FailureReason
from worker.protocol import (
    EVENT_PREFILL_STARTED,
    EngineLoad,
    ErrorCode,
    InstanceInfo,
    InstanceRole,
    PollBatch,
    PushResult,
    RequestOutput,
    RequestType,
    ReservationNotice,
    SubmitRequest,
)
from worker.protocol import RequestType as LocalRequestType
from worker.sampling import InvalidSamplingParams, SamplingParams
from worker.stopping import FinishReason

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.25
MAX_SEED = 2**63 - 1


class Phase(enum.Enum):
    PREFILL = "prefill"  # CONTEXT_ONLY on a PREFILL (or MIXED) instance
    GENERATION = "generation"  # GENERATION_ONLY: receives KV, then generates
    COLOCATED = "colocated"  # CONTEXT_AND_GENERATION on one instance

    @property
    def suffix(self) -> str:
        return {"prefill": "p", "generation": "g", "colocated": "c"}[self.value]


@dataclass
class _Attempt:
    """One hop of a request on one instance."""

    request: _Request
    phase: Phase
    number: int
    instance_id: str
    live: bool = True  # the instance may still hold state for it
    context_done: bool = False  # PREFILL: first token out, KV held for hand-over
    transfer_id: str | None = None
    handed_over: bool = False
    failure_handled: bool = False
    recompute: bool = False
    # While its submit call is in flight a stop is only noted here and sent once the submit has
    # returned: an abort sent beside its submit could reach the instance first and be lost.
    submitting: bool = False
    stop_detail: str | None = None

    @property
    def engine_id(self) -> str:
        return f"{self.request.request_id}.{self.phase.suffix}{self.number}"


@dataclass
class _Request:
    request_id: str
    client_request_id: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    timeline: RequestTimeline
    deadline_s: float | None
    priority: float
    block_hashes: tuple[int, ...]
    events: asyncio.Queue
    outputs: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prefill: _Attempt | None = None
    generation: _Attempt | None = None
    planned_generation: str | None = None  # generation instance chosen at placement
    attempt_numbers: Counter = field(default_factory=Counter)
    recovery: Counter = field(default_factory=Counter)
    uses: list[InstanceUse] = field(default_factory=list)
    final: FinalEvent | None = None
    error: str = ""
    admitted_s: float = 0.0
    first_token_s: float | None = None
    # The task running this request's recovery, while one runs (see Router._recover), and the
    # failures other tasks reported meanwhile, looked at again once it is done.
    recovery_task: asyncio.Task | None = None
    deferred_failures: list[tuple[_Attempt, str, bool, str | None]] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.final is not None


@dataclass
class _Instance:
    client: InstanceClient
    info: InstanceInfo
    health: InstanceHealthView = InstanceHealthView.HEALTHY
    last_ok_s: float = 0.0
    last_report_wall_s: float = 0.0
    load: EngineLoad | None = None
    poll_sequence: int = 0
    task: asyncio.Task | None = None
    dead: bool = False
    attempts: set[str] = field(default_factory=set)  # engine ids believed live there

    @property
    def instance_id(self) -> str:
        return self.info.instance_id


class _Handle:
    def __init__(self, request: _Request) -> None:
        self.request_id = request.request_id
        self._request = request

    async def events(self) -> AsyncIterator[RequestEvent]:
        while True:
            event = await self._request.events.get()
            yield event
            if isinstance(event, FinalEvent):
                return


class Router:
    """The router (implements cluster.router_types.RouterAPI)."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer,
        *,
        vocab_size: int,
        max_seq_len: int,
        tokens_per_block: int,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        seed: int | None = None,
        poll_timeout_s: float | None = None,
        metrics: RouterMetrics | None = None,
        timeline_log: TimelineLog | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.tokens_per_block = tokens_per_block
        self._clock = clock
        self._wall_offset_s = wall_clock() - clock()
        self._rng = random.Random(seed)
        self._placer = Placer(config.placement, random.Random(seed))
        self._prefix = PrefixIndex()
        self._instances: dict[str, _Instance] = {}
        self._requests: dict[str, _Request] = {}
        self._by_client_id: dict[str, str] = {}
        self._attempts: dict[str, _Attempt] = {}
        self._ended: dict[str, _Request] = {}  # recently ended, for GetRequest
        self._outcomes: Counter = Counter()
        self._id_prefix = uuid.uuid4().hex[:8]
        self._counter = itertools.count(1)
        self._poll_timeout_s = poll_timeout_s or min(1.0, config.health.heartbeat_interval_s)
        self._watchdog: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # tasks the router started itself (not its loops)
        self._stopping = False  # the loops end on it too (a cancellation can be lost: cluster/shutdown.py)
        self._accepting = True
        self.inconsistent_reports = 0  # local states that contradicted the global view (must stay 0)
        self.illegal_transitions = 0  # refused by the transition table (a router bug; must stay 0)
        # The refused transitions themselves, each with the stack that attempted it (the last few),
        # so that a test or an operator sees what happened, not only that it did.
        self.illegal_transition_reports: collections.deque[str] = collections.deque(maxlen=16)
        self.metrics = metrics
        self.timeline_log = timeline_log
        self.recovery_actions: Counter = Counter()
        self.transfers: Counter = Counter()

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="router-watchdog")

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the watchdog and every poll loop (and the ends they started); StopTimeout, naming
        the tasks, if they are still running after `timeout_s`."""
        self._stopping = True
        tasks = [t for t in [self._watchdog, *(i.task for i in self._instances.values()), *self._background] if t is not None]
        self._watchdog = None
        await cancel_and_wait(tasks, "router.stop", timeout_s)

    async def add_instance(self, client: InstanceClient) -> InstanceInfo:
        """Register an instance (or re-register a restarted one) and start polling it."""
        info = await client.get_info()
        if info.layout.tokens_per_block != self.tokens_per_block:
            raise RouterError(
                ErrorKind.INTERNAL,
                f"instance {info.instance_id} uses {info.layout.tokens_per_block} tokens per block, the cluster {self.tokens_per_block}",
            )
        existing = self._instances.get(info.instance_id)
        if existing is not None and existing.task is not None:
            existing.task.cancel()
        instance = _Instance(client, info, last_ok_s=self._clock(), last_report_wall_s=self._wall(self._clock()))
        self._instances[info.instance_id] = instance
        self._prefix.remove_instance(info.instance_id)
        instance.task = asyncio.create_task(self._poll_loop(instance), name=f"poll-{info.instance_id}")
        logger.info("registered instance %s (%s) at %s", info.instance_id, info.role.name, info.transfer_address)
        return info

    def set_accepting(self, accepting: bool) -> None:
        self._accepting = accepting

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting; wait for in-flight requests to end; fail what is left. Returns that count."""
        self._accepting = False
        deadline = self._clock() + timeout_s
        while self._requests and self._clock() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._requests.values())
        # Together, so that the instance calls of each end (bounded each) add up to one bound.
        await asyncio.gather(*(self._fail(request, ErrorKind.UNAVAILABLE, "the router is shutting down") for request in left))
        return len(left)

    # --- RouterAPI ----------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    async def submit(self, request: ClientRequest) -> _Handle:
        if not self._accepting:
            raise RouterError(ErrorKind.UNAVAILABLE, "the cluster is draining and takes no new requests")
        if len(self._requests) >= self.config.admission.max_queued_requests:
            raise RouterError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"{len(self._requests)} requests in flight; the admission limit is {self.config.admission.max_queued_requests}",
            )
        prompt = self._validated_prompt(request)
        params = request.sampling
        if params.seed is None:
            params = params.with_seed(self._rng.randrange(MAX_SEED))
        client_id = request.client_request_id
        if client_id is not None and client_id in self._by_client_id:
            raise RouterError(ErrorKind.INVALID_ARGUMENT, f"client_request_id {client_id!r} is in use", "client_request_id")
        # The client's id, when it gives one, is the request's id (so that operators and chaos
        # plans can name a request's hops: "<id>.p1", "<id>.g1").
        request_id = client_id if client_id is not None else f"{self._id_prefix}-{next(self._counter)}"
        if request_id in self._requests:
            raise RouterError(ErrorKind.INVALID_ARGUMENT, f"request id {request_id!r} is in use", "client_request_id")
        now = self._clock()
        deadline = None if request.timeout_s is None else now + request.timeout_s
        state = _Request(
            request_id=request_id,
            client_request_id=client_id,
            prompt_token_ids=prompt,
            params=params,
            timeline=RequestTimeline(request_id, clock=self._clock),
            deadline_s=deadline,
            priority=request.priority,
            block_hashes=tuple(block_hash_chain(prompt, self.tokens_per_block)),
            events=asyncio.Queue(maxsize=self.config.admission.max_buffered_events),
            admitted_s=now,
        )
        previous = self._ended.get(request_id)
        if previous is not None:
            # A client's name used again: its hops continue the previous request's attempt numbers
            # ("r.c2" after "r.c1"), so that an instance still finishing the old hop (an abort on
            # its way) neither refuses the new one as a duplicate nor has its late report taken
            # for the new request's.
            state.attempt_numbers = Counter(previous.attempt_numbers)
        self._requests[request_id] = state
        if client_id is not None:
            self._by_client_id[client_id] = request_id
        if self.metrics is not None:
            self.metrics.in_flight.set(len(self._requests))
        await self._place(state, exclude=frozenset())
        return _Handle(state)

    async def abort(self, request_id: str | None = None, client_request_id: str | None = None) -> tuple[bool, str]:
        request = self._lookup(request_id, client_request_id)
        if request.ended:
            return False, request.timeline.state.name
        # An abort the client asked for ends its stream normally, with finish reason "abort".
        await self._end(request, Outcome.ABORTED, "abort", None, None, "aborted by the client")
        return True, request.timeline.state.name

    def get_request(self, request_id: str | None = None, client_request_id: str | None = None) -> RequestView:
        request = self._lookup(request_id, client_request_id)
        return RequestView(
            request_id=request.request_id,
            client_request_id=request.client_request_id,
            state=request.timeline.state.name,
            timeline=self._timeline(request),
            instances=tuple(request.uses),
            final=request.final,
            error=request.error,
        )

    def cluster_status(self) -> ClusterView:
        instances = []
        for instance in sorted(self._instances.values(), key=lambda i: i.instance_id):
            load = instance.load
            instances.append(
                InstanceView(
                    instance_id=instance.instance_id,
                    role=instance.info.role,
                    address=instance.info.transfer_address,
                    health=instance.health,
                    free_blocks=load.free_blocks if load else 0,
                    total_blocks=load.total_blocks if load else instance.info.num_blocks,
                    cached_blocks=self._prefix.num_blocks(instance.instance_id),
                    queued_requests=load.queued_requests if load else 0,
                    running_requests=load.running_requests if load else 0,
                    active_transfers=sum(
                        1 for a in self._attempts.values() if a.instance_id == instance.instance_id and a.transfer_id and a.live
                    ),
                    last_report_s=instance.last_report_wall_s,
                )
            )
        by_state = Counter(r.timeline.state.name for r in self._requests.values())
        placement = self.config.placement
        return ClusterView(
            instances=tuple(instances),
            queue_depth=sum(1 for r in self._requests.values() if r.timeline.state is GlobalState.QUEUED),
            requests_by_state=dict(by_state),
            requests_by_outcome=dict(self._outcomes),
            fallbacks=tuple(sorted(kind.value for kind in placement.allowed_fallbacks)),
            max_recovery_attempts=sum(step.max_attempts for step in self.config.recovery.chain[:-1]),
            placement_policy=f"prefill={type(placement.prefill_policy).__name__}, "
            f"generation={type(placement.generation_policy).__name__}, disaggregation={placement.disaggregation.value}",
            timestamp_s=self._wall(self._clock()),
            extra={
                "inconsistent_reports": float(self.inconsistent_reports),
                "illegal_transitions": float(self.illegal_transitions),
                **{f"recovery_{k.value}": float(v) for k, v in self.recovery_actions.items()},
                **{f"transfers_{k}": float(v) for k, v in self.transfers.items()},
            },
        )

    # --- validation and placement ---------------------------------------------------------------------
    def _validated_prompt(self, request: ClientRequest) -> tuple[int, ...]:
        if (request.prompt_text is None) == (request.prompt_token_ids is None):
            raise RouterError(ErrorKind.INVALID_ARGUMENT, "give exactly one of text or token_ids", "prompt")
        prompt = tuple(self.tokenize(request.prompt_text)) if request.prompt_text is not None else request.prompt_token_ids
        if not prompt:
            raise RouterError(ErrorKind.INVALID_ARGUMENT, "the prompt is empty", "prompt")
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise RouterError(ErrorKind.INVALID_ARGUMENT, f"token id {token!r} is outside [0, {self.vocab_size})", "prompt.token_ids")
        if len(prompt) + request.sampling.max_tokens > self.max_seq_len:
            raise RouterError(
                ErrorKind.INVALID_ARGUMENT,
                f"prompt of {len(prompt)} tokens + max_tokens {request.sampling.max_tokens} exceeds max_seq_len {self.max_seq_len}",
                "sampling.max_tokens",
            )
        try:
            request.sampling.validate_against(self.vocab_size)
        except InvalidSamplingParams as error:
            raise RouterError(ErrorKind.INVALID_ARGUMENT, error.message, f"sampling.{error.field}") from None
        return tuple(prompt)

    def _candidates(self, exclude: frozenset[str]) -> list[Candidate]:
        candidates = []
        for instance in self._instances.values():
            health = (
                InstanceHealth.HEALTHY
                if instance.health is InstanceHealthView.HEALTHY and instance.instance_id not in exclude
                else InstanceHealth.UNHEALTHY
            )
            candidates.append(Candidate(self._snapshot(instance), health))
        return candidates

    def _snapshot(self, instance: _Instance) -> InstanceSnapshot:
        info = instance.info
        load = instance.load or EngineLoad(info.role, info.num_blocks, info.num_blocks, info.layout.tokens_per_block)
        return InstanceSnapshot(info.instance_id, load, sequence=max(instance.poll_sequence, 0))

    def _placement_request(self, request: _Request) -> PlacementRequest:
        return PlacementRequest(
            request_id=request.request_id,
            prompt_tokens=len(request.prompt_token_ids) + len(request.outputs),
            block_hashes=request.block_hashes,
            expected_decode_tokens=max(0, request.params.max_tokens - len(request.outputs)),
        )

    async def _place(self, request: _Request, exclude: frozenset[str]) -> None:
        try:
            plan = self._placer.place(
                self._placement_request(request), self._candidates(exclude), self._prefix.overlap(request.block_hashes)
            )
        except NoInstanceAvailable as error:
            await self._fail(request, ErrorKind.UNAVAILABLE, f"no instance can serve it: {error}")
            return
        detail = plan.decision.detail
        if plan.fallback is not None:
            detail = f"fallback {plan.fallback.kind.value}: {plan.fallback.reason}"
        if plan.route is Route.DISAGGREGATED:
            request.planned_generation = plan.generation.instance_id
            self._transition(request, GlobalState.CONTEXT_WAIT, plan.context.instance_id, detail, Route.DISAGGREGATED)
            await self._start(request, Phase.PREFILL, plan.context.instance_id, RequestType.CONTEXT_ONLY)
        else:
            self._transition(request, GlobalState.CONTEXT_WAIT, plan.generation.instance_id, detail, Route.COLOCATED)
            await self._start(request, Phase.COLOCATED, plan.generation.instance_id, RequestType.CONTEXT_AND_GENERATION)

    # --- attempts --------------------------------------------------------------------------------------
    async def _start(
        self, request: _Request, phase: Phase, instance_id: str, request_type: RequestType, *, recompute: bool = False
    ) -> _Attempt | None:
        """Submit one hop; on an unreachable instance, recovery takes over. Callers make the
        request's transition first, synchronously, and start no hop for an ended request."""
        if request.ended:  # pragma: no cover - the callers check; a hop for nobody would leak
            logger.error("router bug: a hop for the ended request %s", request.request_id)
            return None
        request.attempt_numbers[phase] += 1
        attempt = _Attempt(request, phase, request.attempt_numbers[phase], instance_id, recompute=recompute)
        if phase is Phase.GENERATION:
            request.generation = attempt
        elif phase is Phase.PREFILL:
            request.prefill = attempt
        else:
            request.generation = attempt
        instance = self._instances[instance_id]
        role = instance.info.role
        request.uses.append(InstanceUse(instance_id, role, phase.value if not attempt.recompute else "recompute", attempt.number))
        self._attempts[attempt.engine_id] = attempt
        instance.attempts.add(attempt.engine_id)
        # Tokens already streamed travel with the hop: the instance replays them (prompt + outputs
        # is its context) and emits only what comes after.
        submit = SubmitRequest(
            request_id=attempt.engine_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.params,
            request_type=request_type,
            output_token_ids=tuple(request.outputs),
            priority=request.priority,
        )
        attempt.submitting = True
        try:
            await instance.client.submit(submit)
        except InstanceRejected as error:
            attempt.submitting = False
            attempt.live = False
            await self._fail(request, ErrorKind.INVALID_ARGUMENT, f"{error.field}: {error.message}")
            return None
        except InstanceUnavailable as error:
            attempt.submitting = False
            if attempt.stop_detail is not None:
                # Stopped meanwhile (the request ended or moved on): nothing to recover. The submit
                # may still have landed, so the stop goes out anyway.
                await self._tell_stopped(attempt, attempt.stop_detail)
                return None
            attempt.live = False
            logger.warning("request %s: %s unavailable at submit: %s", request.request_id, instance_id, error)
            await self._recover(request, attempt, f"{instance_id} unavailable: {error}", kv_survives=False, suspect=instance_id)
            return None
        attempt.submitting = False
        if attempt.stop_detail is not None:
            await self._tell_stopped(attempt, attempt.stop_detail)
            return None
        return attempt

    async def _stop_attempt(self, attempt: _Attempt | None, detail: str) -> None:
        """Make sure an instance frees whatever it holds for this attempt (idempotent)."""
        if self._retire(attempt) is not None:
            await self._tell_stopped(attempt, detail)

    @staticmethod
    def _retire(attempt: _Attempt | None) -> _Attempt | None:
        """Mark a live attempt as no longer wanted, at once (no await): reports from it are ignored
        from here on. Returns it when its instance must still be told (`_tell_stopped`)."""
        if attempt is None or not attempt.live:
            return None
        attempt.live = False
        return attempt

    async def _tell_stopped(self, attempt: _Attempt | None, detail: str) -> None:
        """Ask the instance of a retired attempt to free what it holds for it."""
        if attempt is None:
            return
        if attempt.submitting:
            attempt.stop_detail = detail  # sent by _start once the submit returned
            return
        instance = self._instances.get(attempt.instance_id)
        if instance is None or instance.dead:
            return
        try:
            if attempt.phase is Phase.PREFILL and attempt.context_done:
                await instance.client.release(attempt.engine_id, FailureReason.CANCELLED, detail)
            await instance.client.abort(attempt.engine_id, detail)
        except InstanceUnavailable as error:
            logger.info("could not stop %s on %s: %s", attempt.engine_id, attempt.instance_id, error)

    # --- instance polling -----------------------------------------------------------------------------
    async def _poll_loop(self, instance: _Instance) -> None:
        health = self.config.health
        while not self._stopping:
            try:
                batch = await instance.client.poll(self._poll_timeout_s)
            except asyncio.CancelledError:
                raise
            except InstanceUnavailable as error:
                await self._on_silence(instance, str(error))
                await asyncio.sleep(min(0.2, health.heartbeat_interval_s))
                continue
            except Exception:  # noqa: BLE001 - a bug in decoding must not stop polling
                logger.exception("polling %s failed", instance.instance_id)
                await asyncio.sleep(0.2)
                continue
            try:
                await self._on_batch(instance, batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - nor a bug in handling one batch: the instance would look
                # healthy forever without ever being polled again.
                logger.exception("handling a batch from %s failed", instance.instance_id)

    async def _on_silence(self, instance: _Instance, reason: str) -> None:
        silent_s = self._clock() - instance.last_ok_s
        if instance.dead:
            return
        if silent_s >= self.config.health.dead_after_s:
            await self._declare_dead(instance, f"silent for {silent_s:.1f}s ({reason})")
        elif instance.health is InstanceHealthView.HEALTHY:
            instance.health = InstanceHealthView.DEGRADED
            logger.warning("instance %s degraded: %s", instance.instance_id, reason)

    async def _declare_dead(self, instance: _Instance, reason: str) -> None:
        instance.dead = True
        instance.health = InstanceHealthView.UNHEALTHY
        self._observe_instance(instance)
        self._prefix.remove_instance(instance.instance_id)
        logger.error("instance %s declared dead: %s", instance.instance_id, reason)
        for engine_id in sorted(instance.attempts):
            attempt = self._attempts.get(engine_id)
            if attempt is None or not attempt.live or attempt.request.ended:
                continue
            attempt.live = False
            request = attempt.request
            # The KV a prefill attempt holds dies with it; a generation hop loses its reservation.
            kv_survives = attempt.phase is Phase.GENERATION and request.prefill is not None and request.prefill.live and request.prefill.context_done
            await self._recover(request, attempt, f"instance {instance.instance_id} died: {reason}", kv_survives=kv_survives, suspect=instance.instance_id)
        instance.attempts.clear()

    async def _on_batch(self, instance: _Instance, batch: PollBatch) -> None:
        now = self._clock()
        restarted = batch.incarnation != instance.info.incarnation
        if restarted:
            # A new process: whatever the old one held is gone. Recover, then take it back.
            logger.warning("instance %s restarted (incarnation %s)", instance.instance_id, batch.incarnation)
            if not instance.dead:
                await self._declare_dead(instance, "restarted")
            instance.info = await instance.client.get_info()
        if instance.dead:
            # Back (SIGCONT, restart): forget the old attempts and free what it may still hold.
            instance.dead = False
            stale = [eid for eid, a in self._attempts.items() if a.instance_id == instance.instance_id and not a.live]
            for engine_id in stale:
                with contextlib.suppress(InstanceUnavailable):
                    await instance.client.abort(engine_id, "stale attempt of an instance declared dead")
            self._prefix.remove_instance(instance.instance_id)
            logger.info("instance %s re-registered", instance.instance_id)
        instance.health = InstanceHealthView.HEALTHY
        instance.last_ok_s = now
        if batch.load is not None:
            instance.load = batch.load
            self._observe_instance(instance)
            instance.last_report_wall_s = self._wall(now)
            instance.poll_sequence = batch.sequence
            self._prefix.apply(self._prefix_snapshot(instance, batch, reset=restarted))
        for event in batch.events:
            await self._on_event(instance, event.request_id, event.state, event.detail)
        for output in batch.outputs:
            await self._on_output(instance, output)
        for reservation in batch.reservations:
            await self._on_reservation(instance, reservation)
        for push in batch.push_results:
            await self._on_push(instance, push)

    def _observe_instance(self, instance: _Instance) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        labels = (instance.instance_id, instance.info.role.value)
        metrics.healthy.labels(*labels).set(1.0 if instance.health is InstanceHealthView.HEALTHY else 0.0)
        load = instance.load
        if load is not None and load.total_blocks:
            metrics.kv_utilization.labels(*labels).set(1.0 - load.free_blocks / load.total_blocks)
            metrics.queued.labels(*labels).set(load.queued_requests)
            metrics.running.labels(*labels).set(load.running_requests)
        metrics.queue_depth.set(sum(1 for r in self._requests.values() if r.timeline.state is GlobalState.QUEUED))

    def _prefix_snapshot(self, instance: _Instance, batch: PollBatch, reset: bool) -> InstanceSnapshot:
        assert batch.load is not None
        return InstanceSnapshot(instance.instance_id, batch.load, sequence=batch.sequence, reset=reset)

    # --- reports ---------------------------------------------------------------------------------------
    def _live_attempt(self, instance: _Instance, engine_id: str) -> _Attempt | None:
        attempt = self._attempts.get(engine_id)
        if attempt is None or attempt.instance_id != instance.instance_id or attempt.request.ended:
            return None
        return attempt

    async def _on_event(self, instance: _Instance, engine_id: str, state: str, detail: str) -> None:
        attempt = self._live_attempt(instance, engine_id)
        if attempt is None or not attempt.live:
            return
        request = attempt.request
        current = request.timeline.state
        if detail == EVENT_PREFILL_STARTED and current is GlobalState.CONTEXT_WAIT and attempt.phase is not Phase.GENERATION:
            self._transition(request, GlobalState.CONTEXT_IN_PROGRESS, instance.instance_id, "prefill started")
        elif state == "DISAGG_GENERATION_TRANS_COMPLETE" and attempt.phase is Phase.GENERATION:
            if current is GlobalState.TRANSMISSION:
                self.transfers["committed"] += 1
                if self.metrics is not None:
                    self.metrics.transfers.labels("committed").inc()
                self._transition(request, GlobalState.GENERATING, instance.instance_id, "KV received and verified")
        self._check_consistency(request, attempt, instance, state)

    def _check_consistency(self, request: _Request, attempt: _Attempt, instance: _Instance, state: str) -> None:
        """Count an instance's report that the global view cannot be in or move to (must stay 0)."""
        if attempt.recompute or state in ("GENERATION_COMPLETE", "DISAGG_TRANS_ERROR", "DISAGG_CONTEXT_COMPLETE"):
            return  # a recompute replays states out of the usual order; ends are judged by outputs
        kind = {
            Phase.PREFILL: LocalRequestType.CONTEXT_ONLY,
            Phase.GENERATION: LocalRequestType.GENERATION_ONLY,
            Phase.COLOCATED: LocalRequestType.CONTEXT_AND_GENERATION,
        }[attempt.phase]
        try:
            allowed = global_states_for_local(state, instance.info.role, kind)
        except ValueError:
            allowed = frozenset()
        timeline = request.timeline
        reachable = {target[0] for target in TRANSITIONS.get(timeline.node, frozenset())}
        if timeline.state in allowed or allowed & reachable:
            return
        self.inconsistent_reports += 1
        logger.warning(
            "request %s: %s reports %s while the router has it in %s",
            request.request_id, instance.instance_id, state, timeline.state.name,
        )

    async def _on_output(self, instance: _Instance, output: RequestOutput) -> None:
        attempt = self._live_attempt(instance, output.request_id)
        if attempt is None:
            return
        request = attempt.request
        if not attempt.live and not (attempt.phase is Phase.PREFILL and output.finished):
            return
        if output.new_token_ids and attempt.live:
            request.cached_tokens = max(request.cached_tokens, output.num_cached_tokens)
            if attempt.phase is Phase.COLOCATED and request.timeline.state in (GlobalState.CONTEXT_WAIT, GlobalState.CONTEXT_IN_PROGRESS):
                if request.timeline.state is GlobalState.CONTEXT_WAIT:
                    self._transition(request, GlobalState.CONTEXT_IN_PROGRESS, instance.instance_id, "prefill started")
                if not (output.finished and output.error is None):
                    self._transition(request, GlobalState.GENERATING, instance.instance_id, "first token")
            self._emit(request, TokenEvent(tuple(output.new_token_ids), output.text_delta, tuple(output.logprobs)))
            request.outputs.extend(output.new_token_ids)
        if attempt.phase is Phase.PREFILL:
            await self._on_prefill_output(instance, attempt, output)
        elif output.finished:
            await self._on_hop_finished(instance, attempt, output)

    async def _on_prefill_output(self, instance: _Instance, attempt: _Attempt, output: RequestOutput) -> None:
        request = attempt.request
        if output.context_done and attempt.live and not attempt.context_done:
            attempt.context_done = True
            if request.timeline.state is GlobalState.CONTEXT_WAIT:
                self._transition(request, GlobalState.CONTEXT_IN_PROGRESS, instance.instance_id, "prefill started")
            target = request.planned_generation
            if target is None or self._instances[target].health is not InstanceHealthView.HEALTHY:
                target = self._choose_generation(request, exclude=frozenset())
            if target is None:
                await self._recover(request, attempt, "no generation instance for the hand-over", kv_survives=True, suspect=None)
                return
            self._transition(request, GlobalState.GENERATION_INIT, target, "first token; reserving KV")
            await self._start(request, Phase.GENERATION, target, RequestType.GENERATION_ONLY)
            return
        if not output.finished:
            return
        was_live = attempt.live
        attempt.live = False
        instance.attempts.discard(attempt.engine_id)
        if output.handed_over:
            attempt.handed_over = True
            return
        if output.error is None:
            # The first token was also the last (stop token, max_tokens 1, stop string).
            await self._complete(request, output)
            return
        # An error we caused (abort, release after a decision) was already handled.
        if not was_live or output.error.code is ErrorCode.ABORTED or attempt.failure_handled or request.ended:
            return
        await self._on_transfer_failure(request, attempt, f"{output.error.code.value}: {output.error.detail}", kv_survives=False)

    async def _on_hop_finished(self, instance: _Instance, attempt: _Attempt, output: RequestOutput) -> None:
        request = attempt.request
        attempt.live = False
        instance.attempts.discard(attempt.engine_id)
        if output.error is None:
            await self._complete(request, output)
            return
        if output.error.code is ErrorCode.ABORTED or attempt.failure_handled or request.ended:
            return
        if attempt.phase is Phase.GENERATION and request.timeline.state in (GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION):
            kv_survives = request.prefill is not None and request.prefill.live and request.prefill.context_done
            await self._on_transfer_failure(
                request, attempt, f"{output.error.transfer_reason or output.error.code.value}: {output.error.detail}", kv_survives=kv_survives
            )
        else:
            await self._recover(request, attempt, f"{output.error.code.value}: {output.error.detail}", kv_survives=False, suspect=None)

    async def _on_reservation(self, instance: _Instance, notice: ReservationNotice) -> None:
        attempt = self._live_attempt(instance, notice.request_id)
        if attempt is None or not attempt.live or attempt.phase is not Phase.GENERATION:
            return
        request = attempt.request
        prefill = request.prefill
        attempt.transfer_id = notice.transfer_id
        if prefill is None or not prefill.live or not prefill.context_done:
            await self._recover(request, attempt, "reservation made but the prefill KV is gone", kv_survives=False, suspect=None)
            return
        self._transition(request, GlobalState.TRANSMISSION, instance.instance_id, f"pushing {notice.num_blocks} blocks")
        source = self._instances[prefill.instance_id]
        self.transfers["started"] += 1
        if self.metrics is not None:
            self.metrics.transfers.labels("started").inc()
        try:
            await source.client.push(
                prefill.engine_id, instance.info.transfer_address, notice.transfer_id, self.config.timeouts.transfer_s, attempt.engine_id
            )
        except InstanceUnavailable as error:
            prefill.live = False
            await self._on_transfer_failure(request, attempt, f"{prefill.instance_id} unavailable: {error}", kv_survives=False)

    async def _on_push(self, instance: _Instance, push: PushResult) -> None:
        if self.metrics is not None:
            self.metrics.transfer_bytes.inc(push.bytes_sent)
            self.metrics.transfer_seconds.observe(push.elapsed_s)
            if not push.ok:
                self.metrics.transfers.labels("failed").inc()
                self.metrics.transfer_failures.labels(push.reason or "UNKNOWN").inc()
        attempt = self._live_attempt(instance, push.request_id)
        if attempt is None or attempt.phase is not Phase.PREFILL or push.ok:
            if push.ok:
                self.transfers["pushed"] += 1
            return
        request = attempt.request
        generation = request.generation
        self.transfers[f"failed_{push.reason}"] += 1
        if generation is None or generation.transfer_id != push.transfer_id or generation.failure_handled:
            return
        if request.timeline.state not in (GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION):
            # The receiver committed this transfer before the sender saw its call fail (a
            # connection lost after the commit): the hand-over stands; free the sender's copy.
            await self._stop_attempt(attempt, "KV already committed by the receiver")
            return
        await self._on_transfer_failure(request, generation, f"{push.reason}: {push.detail}", kv_survives=attempt.live)

    # --- recovery -------------------------------------------------------------------------------------
    async def _on_transfer_failure(self, request: _Request, attempt: _Attempt, reason: str, kv_survives: bool) -> None:
        if request.ended or attempt.failure_handled:
            return
        attempt.failure_handled = True
        await self._recover(request, attempt, f"KV transfer failed: {reason}", kv_survives=kv_survives, suspect=None)

    def _choose_generation(self, request: _Request, exclude: frozenset[str]) -> str | None:
        try:
            plan = self._placer.place(self._placement_request(request), self._candidates(exclude), self._prefix.overlap(request.block_hashes))
        except NoInstanceAvailable:
            return None
        return plan.generation.instance_id

    def _has_healthy(self, roles: set[InstanceRole], exclude: frozenset[str]) -> bool:
        return any(
            i.health is InstanceHealthView.HEALTHY and i.info.role in roles and i.instance_id not in exclude
            for i in self._instances.values()
        )

    async def _recover(self, request: _Request, attempt: _Attempt, reason: str, *, kv_survives: bool, suspect: str | None) -> None:
        """Pick and run the next recovery action for `request` after `attempt` failed.

        One recovery at a time per request: an action awaits instances (abort, release, submit)
        between choosing and making its transition, and a second recovery started meanwhile (by the
        watchdog's stage timeout, another instance's report) would act on a state about to change
        and leave two live hops. A failure reported by another task while one runs is deferred and
        looked at again afterwards: acted on only if its attempt is still one of the request's
        current hops. A recovery may chain into the next one itself (its new hop's submit failed):
        same task, so it proceeds."""
        if request.ended:
            return
        current = asyncio.current_task()
        if request.recovery_task is not None and request.recovery_task is not current:
            logger.info("request %s: %s while a recovery runs; deferred", request.request_id, reason)
            request.deferred_failures.append((attempt, reason, kv_survives, suspect))
            return
        outermost = request.recovery_task is None
        request.recovery_task = current
        try:
            await self._run_recovery(request, attempt, reason, kv_survives=kv_survives, suspect=suspect)
        finally:
            if outermost:
                request.recovery_task = None
        if outermost:
            await self._recover_deferred(request)

    async def _recover_deferred(self, request: _Request) -> None:
        while request.deferred_failures and not request.ended:
            attempt, reason, kv_survives, suspect = request.deferred_failures.pop(0)
            if attempt is request.prefill or attempt is request.generation:
                await self._recover(request, attempt, reason, kv_survives=kv_survives, suspect=suspect)
        request.deferred_failures.clear()

    async def _run_recovery(self, request: _Request, attempt: _Attempt, reason: str, *, kv_survives: bool, suspect: str | None) -> None:
        attempt.failure_handled = True
        exclude = frozenset({suspect} if suspect else ())
        applicable = {RecoveryAction.FAIL}
        prefill = request.prefill
        if kv_survives and prefill is not None and prefill.live and prefill.context_done and self._has_healthy({InstanceRole.GENERATION, InstanceRole.MIXED}, exclude):
            applicable.add(RecoveryAction.RETRY_TRANSFER)
        # Re-placement below excludes the request's current prefill instance: judge applicability
        # on the same candidates, or the chain stops at a placement failure instead of moving on.
        elsewhere = exclude | ({prefill.instance_id} if prefill is not None else frozenset())
        if self._has_healthy({InstanceRole.PREFILL}, elsewhere) and self._has_healthy({InstanceRole.GENERATION, InstanceRole.MIXED}, elsewhere):
            applicable.add(RecoveryAction.REPREFILL_ELSEWHERE)
        if self._has_healthy({InstanceRole.GENERATION, InstanceRole.MIXED}, exclude):
            applicable.add(RecoveryAction.RECOMPUTE_LOCAL)
        action = self.config.recovery.next_action(dict(request.recovery), frozenset(applicable))
        request.recovery[action] += 1
        self.recovery_actions[action] += 1
        if self.metrics is not None:
            self.metrics.recovery.labels(action.value).inc()
        logger.warning("request %s: %s -> %s", request.request_id, reason, action.value)
        request.error = reason
        # Each action decides and makes its transition before its first await, then talks to the
        # instances: whatever happens meanwhile (an abort, a deadline, another report) sees the
        # request's new state, and an action whose request ended meanwhile starts nothing.
        if action is RecoveryAction.RETRY_TRANSFER:
            target = self._choose_generation(request, exclude)
            if target is None:  # pragma: no cover - checked by applicability
                await self._fail(request, ErrorKind.UNAVAILABLE, reason)
                return
            stopped = [self._retire(request.generation)]
            self._transition(request, GlobalState.GENERATION_INIT, target, f"retry transfer ({reason})")
            await self._tell_all_stopped(stopped, "transfer retried")
            if not request.ended:
                await self._start(request, Phase.GENERATION, target, RequestType.GENERATION_ONLY)
        elif action is RecoveryAction.RECOMPUTE_LOCAL:
            previous = request.generation
            target = None
            if previous is not None and previous.instance_id not in exclude and self._instances[previous.instance_id].health is InstanceHealthView.HEALTHY:
                target = previous.instance_id
            if target is None:
                target = self._choose_generation(request, exclude)
            if target is None:  # pragma: no cover - checked by applicability
                await self._fail(request, ErrorKind.UNAVAILABLE, reason)
                return
            stopped = [self._retire(request.prefill), self._retire(previous)]
            detail = f"recompute locally on {target} ({reason})"
            if request.timeline.state in (GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION):
                self._transition(request, GlobalState.GENERATING, target, detail, Route.COLOCATED)
            else:
                self._transition(request, GlobalState.CONTEXT_WAIT, target, detail, Route.COLOCATED)
            await self._tell_all_stopped(stopped, "recomputing on the generation instance")
            if not request.ended:
                await self._start(request, Phase.COLOCATED, target, RequestType.CONTEXT_AND_GENERATION, recompute=True)
        elif action is RecoveryAction.REPREFILL_ELSEWHERE:
            excluded = exclude | ({request.prefill.instance_id} if request.prefill else set())
            try:
                plan = self._placer.place(self._placement_request(request), self._candidates(frozenset(excluded)), self._prefix.overlap(request.block_hashes))
            except NoInstanceAvailable as error:
                await self._fail(request, ErrorKind.UNAVAILABLE, f"{reason}; re-placement failed: {error}")
                return
            stopped = [self._retire(request.prefill), self._retire(request.generation)]
            if plan.route is Route.DISAGGREGATED:
                request.planned_generation = plan.generation.instance_id
                self._transition(request, GlobalState.CONTEXT_WAIT, plan.context.instance_id, f"re-run prefill ({reason})", Route.DISAGGREGATED)
                phase, instance_id, request_type = Phase.PREFILL, plan.context.instance_id, RequestType.CONTEXT_ONLY
            else:
                self._transition(request, GlobalState.CONTEXT_WAIT, plan.generation.instance_id, f"re-run colocated ({reason})", Route.COLOCATED)
                phase, instance_id, request_type = Phase.COLOCATED, plan.generation.instance_id, RequestType.CONTEXT_AND_GENERATION
            await self._tell_all_stopped(stopped, "prefill re-run elsewhere")
            if not request.ended:
                await self._start(request, phase, instance_id, request_type)
        else:
            await self._fail(request, ErrorKind.UNAVAILABLE, f"{reason}; recovery exhausted")

    async def _tell_all_stopped(self, attempts: list[_Attempt | None], detail: str) -> None:
        for attempt in attempts:
            await self._tell_stopped(attempt, detail)

    # --- the end of a request -------------------------------------------------------------------------
    async def _complete(self, request: _Request, output: RequestOutput) -> None:
        reason = output.finish_reason.value if isinstance(output.finish_reason, FinishReason) else None
        await self._end(request, Outcome.COMPLETE, reason, output.stop_reason, None, "")

    async def _fail(self, request: _Request, kind: ErrorKind, message: str) -> None:
        await self._end(request, Outcome.ERROR, None, None, kind, message)

    async def _end(
        self,
        request: _Request,
        outcome: Outcome,
        finish_reason: str | None,
        stop_reason: int | str | None,
        error_kind: ErrorKind | None,
        message: str,
    ) -> None:
        if request.ended:
            return
        # Everything up to the terminal transition happens before the first await, so that a
        # second end (a deadline beside a client's abort) or a recovery running meanwhile sees
        # the request ended; the instances are told afterwards.
        state = {Outcome.COMPLETE: GlobalState.COMPLETE, Outcome.ERROR: GlobalState.ERROR, Outcome.ABORTED: GlobalState.ABORTED}[outcome]
        stopped = [
            self._retire(attempt)
            for attempt in (request.prefill, request.generation)
            if attempt is not None and not (outcome is Outcome.COMPLETE and attempt.handed_over)
        ]
        self._transition(request, state, None, message or (finish_reason or ""))
        if message:
            request.error = message
        final = FinalEvent(
            outcome=outcome,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            usage=Usage(len(request.prompt_token_ids), len(request.outputs), request.cached_tokens),
            timeline=self._timeline(request),
            instances=tuple(request.uses),
            error_kind=error_kind,
            error_message=message,
        )
        request.final = final
        self._outcomes[outcome.value if error_kind is None else f"{outcome.value}:{error_kind.value}"] += 1
        self._observe_end(request, final)
        self._requests.pop(request.request_id, None)
        if request.client_request_id is not None and self._by_client_id.get(request.client_request_id) == request.request_id:
            # A client's name is unique among its live requests only (client.proto): free it. The
            # ended request stays findable by it (its request id is that name).
            del self._by_client_id[request.client_request_id]
        self._ended[request.request_id] = request
        while len(self._ended) > 10_000:
            self._ended.pop(next(iter(self._ended)))
        await self._tell_all_stopped(stopped, message or "request ended")
        # The final event must reach the client even if its queue is full of unread tokens.
        while request.events.full():
            request.events.get_nowait()
        request.events.put_nowait(final)

    def _observe_end(self, request: _Request, final: FinalEvent) -> None:
        if self.timeline_log is not None:
            try:
                self.timeline_log.write(request.request_id, request.client_request_id, final)
            except OSError as error:
                logger.warning("timeline log: %s", error)
        metrics = self.metrics
        if metrics is None:
            return
        now = self._clock()
        metrics.requests.labels(final.outcome.value, final.error_kind.value if final.error_kind else "OK").inc()
        metrics.e2e.observe(now - request.admitted_s)
        produced = len(request.outputs)
        if request.first_token_s is not None and produced > 1:
            metrics.tpot.observe((now - request.first_token_s) / (produced - 1))
        entries = request.timeline.entries
        for entry, following in zip(entries, entries[1:], strict=False):
            metrics.state_seconds.labels(entry.state.name).observe(following.timestamp_s - entry.timestamp_s)
        metrics.in_flight.set(len(self._requests))

    def _emit(self, request: _Request, event: TokenEvent) -> None:
        if request.ended:
            return
        if request.first_token_s is None and event.token_ids:
            request.first_token_s = self._clock()
            if self.metrics is not None:
                self.metrics.ttft.observe(request.first_token_s - request.admitted_s)
        if request.events.full():
            # A task of its own (this runs inside a report's handling); referenced until done, as
            # the event loop keeps only weak references to tasks.
            task = asyncio.get_running_loop().create_task(
                self._end(request, Outcome.ABORTED, "abort", None, ErrorKind.CANCELLED, "the client stopped reading its stream")
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        request.events.put_nowait(event)

    # --- watchdog: deadlines and stage timeouts ---------------------------------------------------------
    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            try:
                await self._check_timers()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watchdog must survive a bug in one check
                logger.exception("router watchdog check failed")

    async def _check_timers(self) -> None:
        now = self._clock()
        timeouts = self.config.timeouts
        for request in list(self._requests.values()):
            if request.ended:
                continue
            if request.recovery_task is not None:
                continue  # its state is about to change; the timers restart with it
            if request.deadline_s is not None and now >= request.deadline_s:
                await self._end(request, Outcome.ABORTED, "abort", None, ErrorKind.DEADLINE_EXCEEDED, "the request's deadline passed")
                continue
            state = request.timeline.state
            spent = request.timeline.time_in_state_s()
            limit = {
                GlobalState.CONTEXT_WAIT: timeouts.context_s,
                GlobalState.CONTEXT_IN_PROGRESS: timeouts.context_s,
                GlobalState.GENERATION_INIT: timeouts.reservation_s,
                GlobalState.TRANSMISSION: timeouts.transfer_s,
                GlobalState.GENERATING: timeouts.generation_s,
            }.get(state)
            if limit is None or spent < limit:
                continue
            attempt = request.generation if state in (GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION, GlobalState.GENERATING) else request.prefill
            if attempt is None or attempt.failure_handled:
                attempt = request.generation or request.prefill
            if attempt is None:
                continue
            kv_survives = state in (GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION) and request.prefill is not None and request.prefill.live
            await self._stop_attempt(attempt, f"{state.name} exceeded {limit}s")
            await self._recover(request, attempt, f"{state.name} exceeded its {limit}s stage timeout", kv_survives=kv_survives, suspect=None)

    # --- helpers ---------------------------------------------------------------------------------------
    def _transition(self, request: _Request, state: GlobalState, instance_id: str | None, detail: str, route: Route | None = None) -> None:
        try:
            request.timeline.transition(state, instance_id=instance_id, route=route, detail=detail)
        except IllegalTransition as error:
            self.illegal_transitions += 1
            self.illegal_transition_reports.append(f"{error}\n{''.join(traceback.format_stack(limit=20))}")
            logger.exception("router bug: illegal transition for %s", request.request_id)
            raise

    def _timeline(self, request: _Request) -> tuple[TimelineEntry, ...]:
        return tuple(
            TimelineEntry(e.state.name, self._wall(e.timestamp_s), e.instance_id or "", e.detail)
            for e in request.timeline.entries
        )

    def _wall(self, monotonic_s: float) -> float:
        return monotonic_s + self._wall_offset_s

    def _lookup(self, request_id: str | None, client_request_id: str | None) -> _Request:
        if request_id is None and client_request_id is not None:
            request_id = self._by_client_id.get(client_request_id)
            if request_id is None:
                ended = self._ended.get(client_request_id)
                if ended is not None and ended.client_request_id == client_request_id:
                    return ended
        request = self._requests.get(request_id or "") or self._ended.get(request_id or "")
        if request is None:
            raise RouterError(ErrorKind.NOT_FOUND, f"no request {request_id or client_request_id!r}")
        return request

    @property
    def instances(self) -> dict[str, _Instance]:
        return self._instances

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)
