"""The asyncio router: admission, the instances' poll loops, the watchdog, and the execution of what
each request's flow decides (cluster/router/flow.py).

One event loop runs it (the front end's). For every instance a poll task long-polls its mailbox:
token outputs, local state events, KV reservations, push results and a load snapshot. Each report
goes to its request's flow, a pure state machine that changes the request's global state at once
and returns actions (cluster/router/actions.py); the driver executes them in their order through
the instances' InstanceClients, the request's event stream and the observer
(cluster/router/observe.py). The fleet (cluster/router/fleet.py) holds the instances' health and
load and answers placement.

The driver orders the I/O the flow cannot see: a hop is never submitted once its flow retired it,
and a hop's stop waits until its submit has returned (an abort sent beside its submit could reach
the instance first and be lost).

Aborts (client cancel, deadline, Abort RPC) reach every instance the request touched and free its
blocks there. Client errors never count against an instance's health: only failed or late polls
and unreachable calls do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from cluster.router.actions import (
    Action,
    EmitTokens,
    Finish,
    NoteInconsistent,
    NoteRecovery,
    NoteTransfer,
    Push,
    RenewReservation,
    StartHop,
    StopHop,
)
from cluster.router.api import (
    ClientRequest,
    ClusterView,
    ErrorKind,
    FinalEvent,
    InstanceView,
    ModelInfo,
    RequestEvent,
    RequestView,
    RouterError,
)
from cluster.router.config import RouterConfig, placement_summary, recovery_step_summary
from cluster.router.fleet import Fleet, Member
from cluster.router.flow import Attempt, RequestFlow
from cluster.router.instance_client import InstanceClient, InstanceRejected, InstanceUnavailable
from cluster.router.observe import RouterMetrics, RouterObserver, TimelineLog
from cluster.router.state import GlobalState
from cluster.shutdown import STOP_TIMEOUT_S, cancel_and_wait
from scheduler.block_hash import block_hash_chain
from worker.kv_transfer.failures import FailureReason
from worker.protocol import InstanceInfo, PollBatch, SubmitRequest
from worker.sampling import InvalidSamplingParams

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.25
MAX_SEED = 2**63 - 1
ENDED_REQUESTS_KEPT = 10_000  # ended requests GetRequest can still find


@dataclass
class _Entry:
    """A request in the router: its flow, the client's event stream, and its hops' engine ids."""

    flow: RequestFlow
    events: asyncio.Queue
    engine_ids: list[str] = field(default_factory=list)
    # When its last tokens went to the client (router clock): the start of the next ITL gap.
    last_token_s: float | None = None


@dataclass(frozen=True)
class _Ended:
    """What the router keeps of an ended request: its view for GetRequest, and its hop numbers (a
    client's name used again continues them). Plain values: a few objects per request, not its
    flow and stream (the router keeps thousands of these)."""

    view: RequestView
    attempt_numbers: tuple[tuple[object, int], ...]


class _Handle:
    def __init__(self, entry: _Entry) -> None:
        self.request_id = entry.flow.request_id
        self._events = entry.events

    async def events(self) -> AsyncIterator[RequestEvent]:
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, FinalEvent):
                return


class Router:
    """The router (implements cluster.router.api.RouterAPI)."""

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
        model_info: ModelInfo | None = None,
        request_id_prefix: str | None = None,
    ) -> None:
        self.config = config
        self.model_info = model_info  # what is served, for ClusterStatus
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.tokens_per_block = tokens_per_block
        self._clock = clock
        self._wall_offset_s = wall_clock() - clock()
        self._rng = random.Random(seed)
        self.fleet = Fleet(config.placement, random.Random(seed), config.health.dead_after_s)
        self.observer = RouterObserver(metrics, timeline_log)
        self.metrics = metrics
        self.timeline_log = timeline_log
        self._requests: dict[str, _Entry] = {}
        self._by_client_id: dict[str, str] = {}
        self._ended: dict[str, _Ended] = {}  # recently ended, for GetRequest
        self._hops: dict[str, tuple[_Entry, Attempt]] = {}  # engine id -> its request and hop
        # A hop's submit and stop never race on the instance: a stop of a hop whose submit has not
        # gone out is dropped (the submit will not go out either), a stop of a hop whose submit is
        # in flight is sent once the submit has returned.
        self._unsubmitted: set[str] = set()  # engine ids decided, submit not yet sent
        self._submitting: dict[str, StopHop | None] = {}  # engine id -> the stop waiting for its submit
        # The ids of requests that come without one are this prefix and a count. Random by default: a
        # router restarted against instances that still hold its predecessor's requests must not reuse
        # their ids. A simulation passes a fixed one, so that what is drawn from a request's id (the
        # fault plan's draws, worker/kv_transfer/faults.py) is the same in every run of it.
        self._id_prefix = request_id_prefix if request_id_prefix is not None else uuid.uuid4().hex[:8]
        self._counter = itertools.count(1)
        self._poll_timeout_s = poll_timeout_s or min(1.0, config.health.heartbeat_interval_s)
        self._watchdog: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # tasks the router started itself (not its loops)
        self._stopping = False  # the loops end on it too (a cancellation can be lost: cluster/shutdown.py)
        self._accepting = True

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="router-watchdog")

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the watchdog and every poll loop (and the ends they started); StopTimeout, naming
        the tasks, if they are still running after `timeout_s`."""
        self._stopping = True
        members = self.fleet.members.values()
        tasks = [t for t in [self._watchdog, *(m.task for m in members), *self._background] if t is not None]
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
        existing = self.fleet.get(info.instance_id)
        if existing is not None and existing.task is not None:
            existing.task.cancel()
        now = self._clock()
        member = self.fleet.register(client, info, now, self._wall(now))
        member.task = asyncio.create_task(self._poll_loop(member), name=f"poll-{info.instance_id}")
        where = f" at {info.transfer_address}" if info.transfer_address else " (no KV receiver)"
        logger.info("registered instance %s (%s)%s", info.instance_id, info.role.name, where)
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
        now = self._clock()
        # Together, so that the instance calls of each end (bounded each) add up to one bound.
        await asyncio.gather(
            *(self._run(entry, entry.flow.fail(now, ErrorKind.UNAVAILABLE, "the router is shutting down")) for entry in left)
        )
        return len(left)

    # --- RouterAPI ----------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    async def submit(self, request: ClientRequest) -> _Handle:
        return (await self.submit_all((request,)))[0]

    async def submit_all(self, requests: Sequence[ClientRequest]) -> list[_Handle]:
        """Admit every request or none: a batch of prompts, or a prompt's n choices, is one decision.
        Every request is checked and its id settled before any is registered, and registering takes
        no await, so no other submit can take the queue's last places in between."""
        if not self._accepting:
            raise RouterError(ErrorKind.UNAVAILABLE, "the cluster is draining and takes no new requests")
        limit = self.config.admission.max_queued_requests
        if len(self._requests) + len(requests) > limit:
            more = "" if len(requests) == 1 else f" (a batch of {len(requests)} is admitted whole or not at all)"
            raise RouterError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"{len(self._requests)} requests in flight; the admission limit is {limit}{more}",
            )
        prepared = []
        taken: set[str] = set()
        for request in requests:
            prompt = self._validated_prompt(request)
            params = request.sampling
            if params.seed is None:
                params = params.with_seed(self._rng.randrange(MAX_SEED))
            client_id = request.client_request_id
            if client_id is not None and (client_id in self._by_client_id or client_id in taken):
                raise RouterError(ErrorKind.ALREADY_EXISTS, f"client_request_id {client_id!r} is in use", "client_request_id")
            # The client's id, when it gives one, is the request's id (so that operators and chaos
            # plans can name a request's hops: "<id>.p1", "<id>.g1").
            request_id = client_id if client_id is not None else f"{self._id_prefix}-{next(self._counter)}"
            if request_id in self._requests or request_id in taken:
                raise RouterError(ErrorKind.ALREADY_EXISTS, f"request id {request_id!r} is in use", "client_request_id")
            taken.add(request_id)
            prepared.append((request, prompt, params, request_id))
        entries = [self._register(*item) for item in prepared]
        self._observe_requests()
        for entry in entries:
            await self._run(entry, entry.flow.admit(self._clock(), self.fleet))
        return [_Handle(entry) for entry in entries]

    def _register(self, request: ClientRequest, prompt: tuple[int, ...], params, request_id: str) -> _Entry:
        now = self._clock()
        client_id = request.client_request_id
        previous = self._ended.get(request_id)
        flow = RequestFlow(
            request_id=request_id,
            client_request_id=client_id,
            prompt_token_ids=prompt,
            params=params,
            priority=request.priority,
            block_hashes=tuple(block_hash_chain(prompt, self.tokens_per_block)),
            deadline_s=None if request.timeout_s is None else now + request.timeout_s,
            now_s=now,
            config=self.config,
            attempt_numbers=Counter(dict(previous.attempt_numbers)) if previous is not None else None,
            on_illegal=self.observer.illegal,
        )
        entry = _Entry(flow, asyncio.Queue(maxsize=self.config.admission.max_buffered_events))
        self._requests[request_id] = entry
        if client_id is not None:
            self._by_client_id[client_id] = request_id
        return entry

    async def abort(self, request_id: str | None = None, client_request_id: str | None = None) -> tuple[bool, str]:
        entry = self._lookup(request_id, client_request_id)
        if isinstance(entry, _Ended):
            return False, entry.view.state
        flow = entry.flow
        if flow.ended:
            return False, flow.state.name
        # An abort the client asked for ends its stream normally, with finish reason "abort".
        await self._run(entry, flow.abort(self._clock(), None, "aborted by the client"))
        return True, flow.state.name

    def get_request(self, request_id: str | None = None, client_request_id: str | None = None) -> RequestView:
        entry = self._lookup(request_id, client_request_id)
        if isinstance(entry, _Ended):
            return entry.view
        return self._view(entry.flow)

    def _view(self, flow: RequestFlow) -> RequestView:
        return RequestView(
            request_id=flow.request_id,
            client_request_id=flow.client_request_id,
            state=flow.state.name,
            timeline=flow.timeline_entries(self._wall_offset_s),
            instances=tuple(flow.uses),
            final=flow.final,
            error=flow.error,
        )

    def cluster_status(self) -> ClusterView:
        active: Counter = Counter(
            attempt.instance_id for _, attempt in self._hops.values() if attempt.transfer_id and attempt.live
        )
        instances = []
        for member in sorted(self.fleet.members.values(), key=lambda m: m.instance_id):
            load = member.load
            instances.append(
                InstanceView(
                    instance_id=member.instance_id,
                    role=member.info.role,
                    address=member.info.transfer_address,
                    health=member.health,
                    free_blocks=load.free_blocks if load else 0,
                    total_blocks=load.total_blocks if load else member.info.num_blocks,
                    cached_blocks=self.fleet.prefix.num_blocks(member.instance_id),
                    queued_requests=load.queued_requests if load else 0,
                    running_requests=load.running_requests if load else 0,
                    active_transfers=active[member.instance_id],
                    last_report_s=member.last_report_wall_s,
                )
            )
        by_state = Counter(entry.flow.state.name for entry in self._requests.values())
        placement = self.config.placement
        observer = self.observer
        return ClusterView(
            instances=tuple(instances),
            queue_depth=by_state.get(GlobalState.QUEUED.name, 0),
            requests_by_state=dict(by_state),
            requests_by_outcome=dict(observer.outcomes),
            # client.proto's `fallbacks`: the recovery chain, the steps a failed transfer goes through.
            fallbacks=tuple(recovery_step_summary(step) for step in self.config.recovery.chain),
            max_recovery_attempts=sum(step.max_attempts for step in self.config.recovery.chain[:-1]),
            placement_policy=placement_summary(placement),
            timestamp_s=self._wall(self._clock()),
            model=self.model_info,
            extra={
                "inconsistent_reports": float(observer.inconsistent_reports),
                "illegal_transitions": float(observer.illegal_transitions),
                **{f"recovery_{k.value}": float(v) for k, v in observer.recovery_actions.items()},
                **{f"transfers_{k}": float(v) for k, v in observer.transfers.items()},
            },
        )

    # --- validation ---------------------------------------------------------------------------------
    def _validated_prompt(self, request: ClientRequest) -> tuple[int, ...]:
        """The prompt's token ids; the checks only for a request no front end validated."""
        if request.validated and request.prompt_token_ids is not None:
            return request.prompt_token_ids
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

    # --- executing a flow's actions -----------------------------------------------------------------
    async def _run(self, entry: _Entry, actions: list[Action]) -> None:
        """Execute one event's actions in order. What needs no I/O happens at once, before the
        first await: hops are registered, an ended request leaves the router's books, counters
        move; then the instance calls, in the flow's order."""
        for action in actions:
            self._note(entry, action)
        await self._execute(entry, actions)

    async def _execute(self, entry: _Entry, actions: list[Action]) -> None:
        """The instance calls and client events of actions whose notes were taken, in the flow's
        order. A call that fails unexpectedly (an instance's bug) is logged and costs the request
        none of its other actions: its final event above all, without which its client would wait
        forever (an ended request has left the router's books)."""
        for action in actions:
            try:
                if isinstance(action, StartHop):
                    await self._start_hop(entry, action)
                elif isinstance(action, StopHop):
                    await self._stop_hop(action)
                elif isinstance(action, Push):
                    await self._push(entry, action)
                elif isinstance(action, RenewReservation):
                    await self._renew(action.instance_id, (action.engine_id,))
                elif isinstance(action, EmitTokens):
                    self._emit(entry, action)
                elif isinstance(action, Finish):
                    self._deliver_final(entry)
            except Exception:  # noqa: BLE001 - see the docstring
                logger.exception("%s of request %s failed", type(action).__name__, entry.flow.request_id)

    def _note(self, entry: _Entry, action: Action) -> None:
        flow = entry.flow
        if isinstance(action, StartHop):
            attempt = next(a for a in flow.hops() if a.engine_id == action.engine_id)
            self._hops[action.engine_id] = (entry, attempt)
            self._unsubmitted.add(action.engine_id)
            entry.engine_ids.append(action.engine_id)
            member = self.fleet.get(action.instance_id)
            if member is not None:
                member.attempts.add(action.engine_id)
        elif isinstance(action, StopHop):
            member = self.fleet.get(action.instance_id)
            if member is not None:
                member.attempts.discard(action.engine_id)
        elif isinstance(action, Finish):
            self._retire(entry)
        elif isinstance(action, NoteTransfer):
            self.observer.transfer(action.note)
        elif isinstance(action, NoteRecovery):
            self.observer.recovery(action.request_id, action.action, action.reason)
        elif isinstance(action, NoteInconsistent):
            self.observer.inconsistent(action)

    def _retire(self, entry: _Entry) -> None:
        """An ended request leaves the router's books (its final event is delivered after its hops'
        stops): the client's name is free again, GetRequest still finds it for a while."""
        flow = entry.flow
        assert flow.final is not None
        flow.final = dataclasses.replace(flow.final, timeline=flow.timeline_entries(self._wall_offset_s))
        self.observer.request_ended(flow, flow.final, self._clock())
        self._requests.pop(flow.request_id, None)
        self.fleet.forget(flow.request_id)
        if flow.client_request_id is not None and self._by_client_id.get(flow.client_request_id) == flow.request_id:
            # A client's name is unique among its live requests only (client.proto): free it. The
            # ended request stays findable by it (its request id is that name).
            del self._by_client_id[flow.client_request_id]
        for engine_id in entry.engine_ids:
            self._hops.pop(engine_id, None)  # late reports of its hops are ignored
        self._ended[flow.request_id] = _Ended(self._view(flow), tuple(flow.attempt_numbers.items()))
        while len(self._ended) > ENDED_REQUESTS_KEPT:
            self._ended.pop(next(iter(self._ended)))
        self._observe_requests()

    async def _start_hop(self, entry: _Entry, action: StartHop) -> None:
        self._unsubmitted.discard(action.engine_id)
        hop = self._hops.get(action.engine_id)
        if hop is None or not hop[1].live:
            return  # retired before its submit went out: nothing to submit, nothing to stop
        attempt = hop[1]
        member = self.fleet.get(action.instance_id)
        self._submitting[action.engine_id] = None
        rejected = unavailable = None
        try:
            if member is None:
                raise InstanceUnavailable(f"{action.instance_id}: not registered")
            submit = SubmitRequest(
                request_id=action.engine_id,
                prompt_token_ids=action.prompt_token_ids,
                sampling_params=action.sampling,
                request_type=action.phase.request_type,
                output_token_ids=action.output_token_ids,
                priority=action.priority,
                token_with_kv=action.token_with_kv,
            )
            await member.client.submit(submit)
        except InstanceRejected as error:
            rejected = (error.field, error.message)
        except InstanceUnavailable as error:
            unavailable = str(error)
            if member is not None:
                member.to_abort.add(action.engine_id)  # the submit may have landed: abort it once it answers
            logger.warning("request %s: %s unavailable at submit: %s", action.request_id, action.instance_id, error)
        finally:
            stop = self._submitting.pop(action.engine_id, None)
        if stop is not None:
            # Retired while its submit was in flight (the request ended or moved on): nothing to
            # recover, and the submit may have landed even if its call failed, so the stop goes out.
            await self._stop_hop(stop)
            return
        if rejected is not None or unavailable is not None:
            # Uncounted before the flow places the request again (it may pick the same instance).
            self.fleet.submit_failed(action.instance_id, entry.flow.request_id)
            actions = entry.flow.on_submit_failed(attempt, self._clock(), self.fleet, rejected=rejected, unavailable=unavailable)
            await self._run(entry, actions)

    async def _stop_hop(self, action: StopHop) -> None:
        if action.engine_id in self._unsubmitted:
            return  # the instance never heard of it, and its submit will not go out
        if action.engine_id in self._submitting:
            self._submitting[action.engine_id] = action  # sent by _start_hop once the submit returned
            return
        member = self.fleet.get(action.instance_id)
        if member is None:
            return
        if member.dead:
            member.to_abort.add(action.engine_id)  # told when it answers again
            return
        try:
            if action.release:
                await member.client.release(action.engine_id, FailureReason.CANCELLED, action.detail)
            await member.client.abort(action.engine_id, action.detail)
        except InstanceUnavailable as error:
            member.to_abort.add(action.engine_id)
            logger.info("could not stop %s on %s: %s", action.engine_id, action.instance_id, error)
        except InstanceRejected as error:  # it does not hold the hop (any more): nothing to stop
            logger.info("%s on %s refused its stop: %s", action.engine_id, action.instance_id, error)

    async def _push(self, entry: _Entry, action: Push) -> None:
        source = self.fleet.get(action.instance_id)
        target = self.fleet.get(action.target_instance_id)
        try:
            if source is None or target is None:
                raise InstanceUnavailable(f"{action.instance_id} or {action.target_instance_id}: not registered")
            await source.client.push(
                action.engine_id, target.info.transfer_address, action.transfer_id, action.deadline_s, action.target_engine_id
            )
        except (InstanceUnavailable, InstanceRejected) as error:  # no push went out: as if unreachable
            hop = self._hops.get(action.target_engine_id)
            if hop is None:
                return
            actions = entry.flow.on_push_call_failed(hop[1], f"{action.instance_id} could not be asked to push: {error}", self._clock(), self.fleet)
            await self._run(entry, actions)

    async def _renew(self, instance_id: str, engine_ids: tuple[str, ...]) -> None:
        """Keep early reservations alive. A renewal that cannot reach the instance is dropped: the
        next tick tries again, and a reservation that expires fails like any other."""
        member = self.fleet.get(instance_id)
        if member is None or member.dead:
            return
        try:
            await member.client.renew(engine_ids)
        except InstanceUnavailable as error:
            logger.info("could not renew reservations on %s: %s", instance_id, error)

    def _emit(self, entry: _Entry, action: EmitTokens) -> None:
        if entry.events.full():
            # The client stopped reading: end the request now, and free its hops in a task of its
            # own (this runs inside a report's handling), referenced until done.
            actions = entry.flow.abort(self._clock(), ErrorKind.CANCELLED, "the client stopped reading its stream")
            for later in actions:
                self._note(entry, later)
            task = asyncio.get_running_loop().create_task(self._execute(entry, actions))  # its stops and its final
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        if action.first_token:
            flow = entry.flow
            assert flow.first_token_s is not None
            self.observer.first_token(flow.first_token_s - flow.admitted_s)
        now = self._clock()
        if entry.last_token_s is not None:
            self.observer.tokens_after(now - entry.last_token_s, len(action.event.token_ids))
        entry.last_token_s = now
        entry.events.put_nowait(action.event)

    def _deliver_final(self, entry: _Entry) -> None:
        final = entry.flow.final
        assert final is not None
        # The final event must reach the client even if its queue is full of unread tokens.
        while entry.events.full():
            entry.events.get_nowait()
        entry.events.put_nowait(final)

    # --- instance polling -----------------------------------------------------------------------------
    async def _poll_loop(self, member: Member) -> None:
        health = self.config.health
        while not self._stopping:
            try:
                batch = await self._poll(member)
            except asyncio.CancelledError:
                raise
            except InstanceUnavailable as error:
                if error.dead and not member.dead:
                    # Certain, not a late answer: recover at once rather than after dead_after_s.
                    await self._declare_dead(member, str(error))
                else:
                    await self._on_silence(member, str(error), late=error.late)
                await asyncio.sleep(min(0.2, health.heartbeat_interval_s))
                continue
            except Exception:  # noqa: BLE001 - a bug in decoding must not stop polling
                logger.exception("polling %s failed", member.instance_id)
                await asyncio.sleep(0.2)
                continue
            try:
                await self._on_batch(member, batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - nor a bug in handling one batch: the instance would look
                # healthy forever without ever being polled again.
                logger.exception("handling a batch from %s failed", member.instance_id)

    async def _poll(self, member: Member) -> PollBatch:
        """One poll. A poll that runs `probe_after_s` past its wait is a suspicion, and the instance
        is probed while the poll goes on: a probe that says the instance is gone (Ray reports its
        actor restarting or dead, or another incarnation answers) ends the poll as dead at once;
        a slow probe proves nothing, and the poll is awaited as before."""
        probe_call = getattr(member.client, "probe", None)
        if probe_call is None or member.dead:
            # Nothing to race the poll against: no task of its own (a simulated instance, polled
            # once per step of each of hundreds of instances, has no probe).
            return await member.client.poll(self._poll_timeout_s)
        poll = asyncio.ensure_future(member.client.poll(self._poll_timeout_s))
        health = self.config.health
        probe: asyncio.Future | None = None
        try:
            done, _ = await asyncio.wait({poll}, timeout=self._poll_timeout_s + health.probe_after_s)
            if done:
                return poll.result()
            probe = asyncio.ensure_future(probe_call(max(0.5, health.heartbeat_interval_s), member.info.incarnation))
            done, _ = await asyncio.wait({poll, probe}, return_when=asyncio.FIRST_COMPLETED)
            if poll not in done:
                try:
                    reason = probe.result()
                except Exception:  # noqa: BLE001 - a failed probe proves nothing either
                    logger.debug("probing %s failed", member.instance_id, exc_info=True)
                    reason = None
                if reason is not None:
                    raise InstanceUnavailable(f"{member.instance_id}: a poll overran its wait and {reason}", dead=True)
            return await poll
        finally:
            for task in (poll, probe):
                if task is not None and not task.done():
                    task.cancel()
            if probe is not None and probe.done() and not probe.cancelled():
                probe.exception()  # retrieved: no "exception never retrieved" warning

    async def _on_silence(self, member: Member, reason: str, *, late: bool = True) -> None:
        now = self._clock()
        if self.fleet.silent(member, now, reason, late=late):
            what = "failed twice in a row" if member.failed_polls >= 2 else f"silent for {self.fleet.silent_for_s(member, now):.1f}s"
            await self._declare_dead(member, f"{what} ({reason})")

    async def _declare_dead(self, member: Member, reason: str) -> None:
        held = self.fleet.mark_dead(member, reason)
        self.observer.instance(member)
        for engine_id in held:
            hop = self._hops.get(engine_id)
            if hop is None:
                continue
            entry, attempt = hop
            actions = entry.flow.on_instance_dead(attempt, f"instance {member.instance_id} died: {reason}", self._clock(), self.fleet)
            await self._run(entry, actions)

    async def _on_batch(self, member: Member, batch: PollBatch) -> None:
        now = self._clock()
        restarted = batch.incarnation != member.info.incarnation
        if restarted:
            # A new process: whatever the old one held is gone. Recover, then take it back.
            logger.warning("instance %s restarted (incarnation %s)", member.instance_id, batch.incarnation)
            if not member.dead:
                await self._declare_dead(member, "restarted")
            member.info = await member.client.get_info()
            await self._restarted(member)
        if member.dead:
            self.fleet.revive(member)  # back (SIGCONT, restart)
        if member.to_abort:
            # It answers again: free what it may still hold of hops given up while it could not be
            # told (it was dead, or a stop or submit call to it failed).
            for engine_id in self.fleet.take_aborts(member):
                try:
                    await member.client.abort(engine_id, "a hop the router gave up while it could not reach this instance")
                except InstanceUnavailable:
                    member.to_abort.add(engine_id)
        self.fleet.answered(member, now)
        if batch.load is not None:
            self.fleet.apply_load(member, batch, self._wall(now), reset=restarted)
            self.observer.instance(member)
        role = member.info.role
        for event in batch.events:
            hop = self._hop(member, event.request_id)
            if hop is not None:
                if member.unreported:  # this report's load counts the request (its "submitted" event at the latest)
                    self.fleet.reported(member, hop[0].flow.request_id)
                await self._run(hop[0], hop[0].flow.on_state(hop[1], role, event.state, event.detail, self._clock(), self.fleet))
        for output in batch.outputs:
            hop = self._hop(member, output.request_id)
            if output.finished:
                member.attempts.discard(output.request_id)
            if hop is not None:
                actions = hop[0].flow.on_output(hop[1], output, self._clock(), self.fleet)
                if len(actions) == 1 and type(actions[0]) is EmitTokens:
                    # Most outputs: tokens to stream and nothing else, which `_run` would emit
                    # with nothing to note and no I/O (a driver of 100,000s of outputs a second
                    # saves the coroutine and the dispatch).
                    self._emit(hop[0], actions[0])
                elif actions:
                    await self._run(hop[0], actions)
        for reservation in batch.reservations:
            hop = self._hop(member, reservation.request_id)
            if hop is not None:
                await self._run(hop[0], hop[0].flow.on_reservation(hop[1], reservation, self._clock(), self.fleet))
        for push in batch.push_results:
            self.observer.push_result(push)
            hop = self._hop(member, push.request_id)
            if hop is not None:
                await self._run(hop[0], hop[0].flow.on_push_result(hop[1], push, self._clock(), self.fleet))

    async def _restarted(self, member: Member) -> None:
        """Hand a new incarnation what its spec could not give it (a reissued transfer certificate).
        A failure is logged, not fatal: the instance still serves, with its predecessor's certificate."""
        restarted = getattr(member.client, "restarted", None)
        if restarted is None:
            return
        try:
            if await restarted():
                logger.info("instance %s: a reissued KV transfer certificate was handed over", member.instance_id)
        except (InstanceUnavailable, InstanceRejected) as error:
            logger.warning("instance %s restarted, but its KV transfer certificate was not reissued: %s", member.instance_id, error)

    def _hop(self, member: Member, engine_id: str) -> tuple[_Entry, Attempt] | None:
        """The request and hop a report is about, if it is a hop of a request still in flight on
        this instance."""
        hop = self._hops.get(engine_id)
        if hop is None or hop[1].instance_id != member.instance_id or hop[0].flow.ended:
            return None
        return hop

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
        renewals: dict[str, list[str]] = {}
        for entry in list(self._requests.values()):
            actions = entry.flow.on_tick(self._clock(), self.fleet)
            for action in actions:
                if isinstance(action, RenewReservation):  # one Renew per instance, below
                    renewals.setdefault(action.instance_id, []).append(action.engine_id)
            actions = [action for action in actions if not isinstance(action, RenewReservation)]
            if actions:
                await self._run(entry, actions)
        for instance_id, engine_ids in renewals.items():
            await self._renew(instance_id, tuple(engine_ids))

    # --- helpers ---------------------------------------------------------------------------------------
    def _observe_requests(self) -> None:
        if self.observer.metrics is None:
            return  # the count below walks every request: only for a served gauge
        queued = sum(1 for entry in self._requests.values() if entry.flow.state is GlobalState.QUEUED)
        self.observer.requests_in_router(len(self._requests), queued)

    def _wall(self, monotonic_s: float) -> float:
        return monotonic_s + self._wall_offset_s

    def _lookup(self, request_id: str | None, client_request_id: str | None) -> _Entry | _Ended:
        if request_id is None and client_request_id is not None:
            request_id = self._by_client_id.get(client_request_id)
            if request_id is None:
                ended = self._ended.get(client_request_id)
                if ended is not None and ended.view.client_request_id == client_request_id:
                    return ended
        entry = self._requests.get(request_id or "") or self._ended.get(request_id or "")
        if entry is None:
            raise RouterError(ErrorKind.NOT_FOUND, f"no request {request_id or client_request_id!r}")
        return entry

    # --- read by tests, status and the chaos harness -----------------------------------------------------
    @property
    def instances(self) -> dict[str, Member]:
        return self.fleet.members

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def illegal_transitions(self) -> int:
        return self.observer.illegal_transitions

    @property
    def illegal_transition_reports(self):
        return self.observer.illegal_transition_reports

    @property
    def inconsistent_reports(self) -> int:
        return self.observer.inconsistent_reports

    @property
    def recovery_actions(self) -> Counter:
        return self.observer.recovery_actions

    @property
    def transfers(self) -> Counter:
        return self.observer.transfers

