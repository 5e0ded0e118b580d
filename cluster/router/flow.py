"""The flow of one request through the cluster, as pure code: events in, actions out.

No asyncio, no I/O, no clock of its own: every handler takes the time (`now_s`) and a read-only
view of the fleet (`FleetView`: health and placement), changes the request's state synchronously
and returns the actions the driver must execute (cluster/router/actions.py). Because a handler
runs to completion before the next event is looked at, nothing can change a request between a
decision and its transition; the driver only orders the I/O (a hop's stop after its submit).

The disaggregated flow (engine ids carry the hop and attempt: "<id>.p1", "<id>.g1", "<id>.c1"):

  QUEUED -> place (generation hop first, then conditional disaggregation, then prefill hop)
  CONTEXT_WAIT        StartHop CONTEXT_ONLY on the prefill instance
  CONTEXT_IN_PROGRESS its first chunk is scheduled ("prefill started")
  GENERATION_INIT     its first token streams to the client; StartHop GENERATION_ONLY (prompt +
                      first token) on the generation instance, which reserves blocks
  TRANSMISSION        the reservation's transfer id goes to the prefill instance: Push
  GENERATING          the generation instance committed the KV; its tokens stream to the client
  COMPLETE

Colocated requests (conditional disaggregation, or a configured fallback) run
CONTEXT_AND_GENERATION on one GENERATION/MIXED instance.

Recovery (the configured chain, bounded, RecoveryConfig): when a transfer fails, a stage times
out or an instance dies, the flow describes the failure (a `Failure`) and where the request stands,
and the pure decision in cluster/router/recovery.py picks the first applicable action with attempts
left: RETRY_TRANSFER (the prefill instance still holds the KV: reserve again, push again),
REPREFILL_ELSEWHERE (run the prefill hop again elsewhere), RECOMPUTE_LOCAL (a generation instance
runs prompt + tokens so far itself), WAIT_FOR_INSTANCE (an outage: back to QUEUED, bounded), FAIL
(a clear status). The flow executes the decision here (`_recover`): stops, starts, transitions.
Seeds are fixed at admission and sampling is keyed by (seed, output position), so a recovered
request produces exactly the tokens of a fault-free run, and tokens already streamed are never
streamed again.

The state machine and its table are in cluster/router/state.py; every transition goes through it.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cluster.router.actions import (
    Action,
    EmitTokens,
    Finish,
    NoteInconsistent,
    NoteRecovery,
    NoteTransfer,
    Phase,
    Push,
    RenewReservation,
    StartHop,
    StopHop,
    TransferNote,
)
from cluster.router.api import ErrorKind, FinalEvent, InstanceUse, Outcome, TimelineEntry, TokenEvent, Usage
from cluster.router.config import RecoveryAction, ReserveAt, RouterConfig
from cluster.router.placement import NoInstanceAvailable, PlacementPlan, PlacementRequest
from cluster.router.recovery import (
    HANDOVER_STATES,
    Cause,
    Decision,
    Failure,
    FleetHealth,
    Standing,
    Wait,
    admission_wait_s,
    decide,
    stage_limit_s,
    transmission_bound_s,
)
from cluster.router.state import (
    TRANSITIONS,
    GlobalState,
    IllegalTransition,
    RequestTimeline,
    Route,
    global_states_for_local,
)
from scheduler.state import LlmRequestState
from worker.protocol import (
    EVENT_PREFILL_STARTED,
    ErrorCode,
    InstanceRole,
    PushResult,
    RequestOutput,
    ReservationNotice,
)
from worker.protocol import RequestType as LocalRequestType
from worker.sampling import SamplingParams
from worker.stopping import FinishReason

logger = logging.getLogger(__name__)

_LOCAL_TYPES = {
    Phase.PREFILL: LocalRequestType.CONTEXT_ONLY,
    Phase.GENERATION: LocalRequestType.GENERATION_ONLY,
    Phase.COLOCATED: LocalRequestType.CONTEXT_AND_GENERATION,
}
# Global states in which a generation hop's tokens cannot be streamed yet.
_BEFORE_GENERATING = frozenset(
    {GlobalState.CONTEXT_WAIT, GlobalState.CONTEXT_IN_PROGRESS, GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION}
)
# Local states that end a hop; the hop's outputs, not its state events, say how it ended.
_ENDING_STATES = frozenset(
    {LlmRequestState.GENERATION_COMPLETE, LlmRequestState.DISAGG_TRANS_ERROR, LlmRequestState.DISAGG_CONTEXT_COMPLETE}
)


class FleetView(FleetHealth, Protocol):
    """What the flow reads of the fleet (cluster/router/fleet.py implements it): the health the
    recovery chain reads (FleetHealth), and placement."""

    def place(self, request: PlacementRequest, exclude: frozenset[str]) -> PlacementPlan:
        """Both hops of a request; raises NoInstanceAvailable."""
        ...

    def choose_generation(self, request: PlacementRequest, exclude: frozenset[str], *, receives_kv: bool) -> str:
        """A generation instance for a generation hop alone, a hand-over's target (`receives_kv`) or
        a local recompute; raises NoInstanceAvailable."""
        ...

    def kv_bytes(self, instance_id: str, num_blocks: int) -> int:
        """The bytes of `num_blocks` KV blocks on that instance."""
        ...

    def role(self, instance_id: str) -> InstanceRole: ...


@dataclass
class Attempt:
    """One hop of a request on one instance."""

    request_id: str
    phase: Phase
    number: int
    instance_id: str
    live: bool = True  # the instance may still hold state for it
    context_done: bool = False  # PREFILL: first token out, KV held for the hand-over
    transfer_id: str | None = None
    handed_over: bool = False
    failure_handled: bool = False
    recompute: bool = False
    # GENERATION hops submitted while the prefill runs (an early reservation, ReserveAt):
    early: bool = False
    committed: bool = False  # the instance reported the KV committed (maybe before the first token)
    reserved_blocks: int = 0
    reserved_bytes: int = 0
    lease_s: float = 0.0  # the reservation's timeout on the instance; renewed every third of it
    renewed_s: float = 0.0

    @property
    def engine_id(self) -> str:
        return f"{self.request_id}.{self.phase.suffix}{self.number}"

    @property
    def holds_handover_kv(self) -> bool:
        """A prefill hop whose KV is final and still held for its hand-over."""
        return self.phase is Phase.PREFILL and self.live and self.context_done


class RequestFlow:
    """One admitted request: its global state, its hops, and the decisions of the P/D flow."""

    def __init__(
        self,
        *,
        request_id: str,
        client_request_id: str | None,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        priority: float,
        block_hashes: tuple[int, ...],
        deadline_s: float | None,
        now_s: float,
        config: RouterConfig,
        attempt_numbers: Counter | None = None,
        on_illegal: Callable[[str], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_request_id = client_request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
        self.block_hashes = block_hashes
        self.deadline_s = deadline_s
        self.admitted_s = now_s
        self._now_s = now_s
        self._config = config
        self._on_illegal = on_illegal
        # Time is an input: every transition is stamped with the event's time (`_now_s`). The
        # timeline's own clock only stamps its first entry (no reference back to this flow: a
        # cycle would leave every ended request to the cyclic garbage collector).
        self.timeline = RequestTimeline(request_id, clock=lambda: now_s)
        self.outputs: list[int] = []
        self.cached_tokens = 0
        self.prefill: Attempt | None = None
        self.generation: Attempt | None = None  # the GENERATION or COLOCATED hop
        self.planned_generation: str | None = None  # the generation instance chosen at placement
        # A client's name used again continues the previous request's hop numbers ("r.c2" after
        # "r.c1"), so that an instance still ending the old hop neither refuses the new one as a
        # duplicate nor has its late report taken for the new request's.
        self.attempt_numbers: Counter = Counter(attempt_numbers or ())
        self.recovery: Counter = Counter()
        self.uses: list[InstanceUse] = []
        self.final: FinalEvent | None = None
        self.error = ""
        self.first_token_s: float | None = None
        # Outputs of an early generation hop that committed and decoded before the router heard of
        # the prefill's first token: streamed right after it, in order.
        self._held: list[RequestOutput] = []
        # Why a push streaming to the early reservation failed while the context computed (the
        # hand-over is then retried at context done, and the timeline says so).
        self._early_failure: str | None = None
        # Waiting for a healthy instance (RecoveryAction.WAIT_FOR_INSTANCE, or admitted during an
        # outage): since when, and until when at most. None: not waiting.
        self.waiting: Wait | None = None

    # --- reading ------------------------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        return self.final is not None

    @property
    def state(self) -> GlobalState:
        return self.timeline.state

    def hops(self) -> tuple[Attempt, ...]:
        return tuple(a for a in (self.prefill, self.generation) if a is not None)

    def timeline_entries(self, wall_offset_s: float) -> tuple[TimelineEntry, ...]:
        return tuple(
            TimelineEntry(e.state.name, e.timestamp_s + wall_offset_s, e.instance_id or "", e.detail)
            for e in self.timeline.entries
        )

    # --- admission ----------------------------------------------------------------------------------
    def admit(self, now_s: float, fleet: FleetView) -> list[Action]:
        """Place the request and start its first hop."""
        self._now_s = now_s
        actions: list[Action] = []
        try:
            plan = fleet.place(self.placement_request(), frozenset())
        except NoInstanceAvailable as error:
            wait_s = admission_wait_s(self._config.recovery, self._config.placement, fleet)
            if wait_s is not None:
                # An outage (the instances exist, none is healthy now): queue, do not refuse.
                self.error = f"no instance can serve it now: {error}"
                self.waiting = Wait.starting(now_s, wait_s)
                return actions
            return self._end(actions, Outcome.ERROR, None, None, ErrorKind.UNAVAILABLE, f"no instance can serve it: {error}")
        detail = plan.decision.detail
        if plan.fallback is not None:
            detail = f"fallback {plan.fallback.kind.value}: {plan.fallback.reason}"
        self._start_plan(actions, fleet, plan, detail)
        return actions

    def placement_request(self) -> PlacementRequest:
        return PlacementRequest(
            request_id=self.request_id,
            prompt_tokens=len(self.prompt_token_ids) + len(self.outputs),
            block_hashes=self.block_hashes,
            expected_decode_tokens=max(0, self.params.max_tokens - len(self.outputs)),
        )

    def _start_plan(self, actions: list[Action], fleet: FleetView, plan: PlacementPlan, detail: str) -> None:
        if plan.route is Route.DISAGGREGATED:
            self.planned_generation = plan.generation.instance_id
            self._transition(GlobalState.CONTEXT_WAIT, plan.context.instance_id, detail, Route.DISAGGREGATED)
            self._start(actions, fleet, Phase.PREFILL, plan.context.instance_id)
            if self._config.handover.reserve is ReserveAt.AT_ADMISSION:
                self._start_early_generation(actions, fleet)
        else:
            self._transition(GlobalState.CONTEXT_WAIT, plan.generation.instance_id, detail, Route.COLOCATED)
            self._start(actions, fleet, Phase.COLOCATED, plan.generation.instance_id)

    # --- reports from instances ---------------------------------------------------------------------
    def on_state(
        self, attempt: Attempt, role: InstanceRole, local_state: LlmRequestState, detail: str, now_s: float, fleet: FleetView
    ) -> list[Action]:
        """A local state event of a live hop."""
        self._now_s = now_s
        actions: list[Action] = []
        if not attempt.live or self.ended:
            return actions
        current = self.state
        if detail == EVENT_PREFILL_STARTED and current is GlobalState.CONTEXT_WAIT and attempt.phase is not Phase.GENERATION:
            self._transition(GlobalState.CONTEXT_IN_PROGRESS, attempt.instance_id, "prefill started")
            if attempt.phase is Phase.PREFILL and self._config.handover.reserve is ReserveAt.AT_CONTEXT_START:
                self._start_early_generation(actions, fleet)
        elif local_state is LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE and attempt.phase is Phase.GENERATION:
            attempt.committed = True
            if current is GlobalState.TRANSMISSION:
                actions.append(NoteTransfer(TransferNote.COMMITTED))
                self._transition(GlobalState.GENERATING, attempt.instance_id, "KV received and verified")
            # Earlier (an early reservation, committed before the first token reached the router):
            # the prefill's first token moves the request through the hand-over states.
        if not self._consistent(attempt, role, local_state):
            actions.append(NoteInconsistent(self.request_id, attempt.instance_id, local_state.name, self.state.name))
        return actions

    def _consistent(self, attempt: Attempt, role: InstanceRole, local_state: LlmRequestState) -> bool:
        """Whether the global view can be in, or move to, what an instance reports."""
        if attempt.recompute or local_state in _ENDING_STATES:
            return True  # a recompute replays states out of the usual order; ends are judged by outputs
        try:
            allowed = global_states_for_local(local_state, role, _LOCAL_TYPES[attempt.phase])
        except ValueError:
            allowed = frozenset()
        if attempt.early and attempt.committed and self.state in _BEFORE_GENERATING:
            # An early hop committed before the router heard of the prefill's first token, which
            # will take the request to GENERATING: judge the hop's reports against that.
            return GlobalState.GENERATING in allowed
        reachable = {target[0] for target in TRANSITIONS.get(self.timeline.node, frozenset())}
        return self.state in allowed or bool(allowed & reachable)

    def on_output(self, attempt: Attempt, output: RequestOutput, now_s: float, fleet: FleetView) -> list[Action]:
        """Tokens of a hop, and whether it finished (how, and its KV state for a prefill hop)."""
        self._now_s = now_s
        if (
            output.new_token_ids
            and not output.finished
            and attempt.live
            and attempt.phase is not Phase.PREFILL
            and self.first_token_s is not None
            and self.timeline.state is GlobalState.GENERATING
        ):
            # Most outputs: more tokens of the generating hop, streamed and nothing else (what the
            # checks below come to for them, without walking through them).
            self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
            self.outputs.extend(output.new_token_ids)
            return [EmitTokens(self.request_id, TokenEvent(tuple(output.new_token_ids), output.text_delta, tuple(output.logprobs)))]
        actions: list[Action] = []
        if self.ended:
            return actions
        if not attempt.live and not (attempt.phase is Phase.PREFILL and output.finished):
            return actions
        if output.new_token_ids and attempt.live:
            if attempt.phase is Phase.GENERATION and attempt.committed and self.state in _BEFORE_GENERATING:
                # An early hop decoding before the router heard of the first token: held, then
                # streamed after it.
                self._held.append(output)
                return actions
            if attempt.phase is Phase.GENERATION and self.state in _BEFORE_GENERATING:
                # Tokens of a generation hop whose KV was never committed: impossible for a sane
                # instance. Noted, not streamed; the stage timeout recovers the request.
                actions.append(NoteInconsistent(self.request_id, attempt.instance_id, "tokens before the KV commit", self.state.name))
                return actions
            self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
            if attempt.phase is not Phase.GENERATION and self.state is GlobalState.CONTEXT_WAIT:
                # Its first token says the prefill ran, if the "prefill started" event was not seen.
                self._transition(GlobalState.CONTEXT_IN_PROGRESS, attempt.instance_id, "prefill started")
            if attempt.phase is Phase.COLOCATED and self.state is GlobalState.CONTEXT_IN_PROGRESS:
                if not (output.finished and output.error is None):
                    self._transition(GlobalState.GENERATING, attempt.instance_id, "first token")
            first = self.first_token_s is None
            if first:
                self.first_token_s = now_s
            actions.append(
                EmitTokens(self.request_id, TokenEvent(tuple(output.new_token_ids), output.text_delta, tuple(output.logprobs)), first_token=first)
            )
            self.outputs.extend(output.new_token_ids)
        if attempt.phase is Phase.PREFILL:
            self._on_prefill_output(actions, attempt, output, fleet)
        elif output.finished:
            self._on_hop_finished(actions, attempt, output, fleet)
        return actions

    def _on_prefill_output(self, actions: list[Action], attempt: Attempt, output: RequestOutput, fleet: FleetView) -> None:
        if output.context_done and attempt.live and not attempt.context_done:
            attempt.context_done = True
            if self.state is GlobalState.CONTEXT_WAIT:
                self._transition(GlobalState.CONTEXT_IN_PROGRESS, attempt.instance_id, "prefill started")
            early = self.generation
            if early is not None and early.live and early.early:
                self._handover_early(actions, attempt, early, fleet)
                return
            target = self.planned_generation
            if target is None or not fleet.is_healthy(target):
                target = self._choose_generation(fleet, frozenset(), receives_kv=True)
            if target is None:
                failure = Failure(Cause.NO_INSTANCE, "no generation instance for the hand-over", kv_survives=True)
                self._recover(actions, attempt, failure, fleet)
                return
            detail = "first token; reserving KV"
            if self._early_failure is not None:
                detail = f"first token; retry transfer ({self._early_failure}): reserving KV"
                self._early_failure = None
            self._transition(GlobalState.GENERATION_INIT, target, detail)
            self._start(actions, fleet, Phase.GENERATION, target)
            return
        if not output.finished:
            return
        was_live = attempt.live
        attempt.live = False
        if output.handed_over:
            attempt.handed_over = True
            return
        if output.error is None:
            # The first token was also the last (stop token, max_tokens 1, stop string).
            self._complete(actions, output)
            return
        # An error the router caused (abort, release after a decision) was already handled; once
        # the request is GENERATING its KV moved, and the prefill hop's end changes nothing.
        if not was_live or output.error.code is ErrorCode.ABORTED or attempt.failure_handled or self.state is GlobalState.GENERATING:
            return
        failure = Failure.transfer_failed(f"{output.error.code.value}: {output.error.detail}", kv_survives=False)
        self._transfer_failed(actions, attempt, failure, fleet)

    def _on_hop_finished(self, actions: list[Action], attempt: Attempt, output: RequestOutput, fleet: FleetView) -> None:
        attempt.live = False
        if output.error is None:
            self._complete(actions, output)
            return
        if output.error.code is ErrorCode.ABORTED or attempt.failure_handled:
            return
        if self._early_hop_lost(attempt, f"{output.error.transfer_reason or output.error.code.value}: {output.error.detail}"):
            return
        if attempt.phase is Phase.GENERATION and self.state in HANDOVER_STATES:
            kv_survives = self.prefill is not None and self.prefill.holds_handover_kv
            reason = f"{output.error.transfer_reason or output.error.code.value}: {output.error.detail}"
            self._transfer_failed(actions, attempt, Failure.transfer_failed(reason, kv_survives=kv_survives), fleet)
        else:
            self._recover(actions, attempt, Failure(Cause.HOP_FAILED, f"{output.error.code.value}: {output.error.detail}"), fleet)

    def on_reservation(self, attempt: Attempt, notice: ReservationNotice, now_s: float, fleet: FleetView) -> list[Action]:
        """The generation instance reserved blocks for a hop: ask the prefill instance to push."""
        self._now_s = now_s
        actions: list[Action] = []
        if self.ended or not attempt.live or attempt.phase is not Phase.GENERATION:
            return actions
        prefill = self.prefill
        attempt.transfer_id = notice.transfer_id
        attempt.reserved_blocks = notice.num_blocks
        attempt.reserved_bytes = fleet.kv_bytes(attempt.instance_id, notice.num_blocks)
        attempt.lease_s = notice.lease_s
        attempt.renewed_s = now_s
        if attempt.early and prefill is not None and prefill.live and not prefill.context_done:
            # Reserved while the prefill runs: relay the target now, off the critical path; the
            # prefill instance pushes the moment its KV is final. The push's deadline is the
            # transfer deadline: it may start on the first finished chunks (stream_kv_chunks) and so
            # take the rest of the context's time too, which TRANSMISSION's bound does not hold.
            actions.append(self._push_action(prefill, attempt, self._config.timeouts.transfer_s))
            return actions
        if prefill is None or not prefill.holds_handover_kv:
            self._recover(actions, attempt, Failure(Cause.KV_LOST, "reservation made but the prefill KV is gone"), fleet)
            return actions
        self._transition(GlobalState.TRANSMISSION, attempt.instance_id, f"pushing {notice.num_blocks} blocks")
        actions.append(NoteTransfer(TransferNote.STARTED))
        # Held to the bound TRANSMISSION is held to (recovery.py), not timeouts.transfer_s: once it
        # passes the router recovers the request (retries the transfer elsewhere, or recomputes),
        # and a push still going on would only keep the prefill's blocks pinned (worker/handover.py)
        # for nothing, up to transfer_s (a minute by default).
        bound_s = transmission_bound_s(self._config.timeouts, self._config.handover, attempt.reserved_bytes)
        actions.append(self._push_action(prefill, attempt, bound_s))
        return actions

    def _push_action(self, prefill: Attempt, generation: Attempt, deadline_s: float) -> Push:
        assert generation.transfer_id is not None
        return Push(
            request_id=self.request_id,
            instance_id=prefill.instance_id,
            engine_id=prefill.engine_id,
            target_instance_id=generation.instance_id,
            target_engine_id=generation.engine_id,
            transfer_id=generation.transfer_id,
            deadline_s=deadline_s,
        )

    # --- early reservation ------------------------------------------------------------------------
    def _start_early_generation(self, actions: list[Action], fleet: FleetView) -> None:
        """Submit the generation hop while the prefill runs, so that its blocks are reserved and the
        target relayed before the KV is final. Skipped (the hop starts at context done, as
        AT_CONTEXT_DONE does) when the planned instance is not healthy or a hop is live already."""
        generation = self.generation
        if generation is not None and generation.live:
            return
        target = self.planned_generation
        if target is None or not fleet.is_healthy(target):
            return
        self._start(actions, fleet, Phase.GENERATION, target, token_with_kv=True)

    def _handover_early(self, actions: list[Action], prefill: Attempt, early: Attempt, fleet: FleetView) -> None:
        """The prefill's first token reached the router and its generation hop was submitted early:
        the request moves through the hand-over states as far as the instances have gone."""
        if early.transfer_id is None:  # a live hop's reservation is relayed the moment it is made
            # The generation pool could not reserve yet: the push is relayed when it does.
            self._transition(GlobalState.GENERATION_INIT, early.instance_id, "first token; waiting for the early reservation")
            return
        self._transition(
            GlobalState.GENERATION_INIT, early.instance_id, f"first token; KV reserved early ({early.reserved_blocks} blocks)"
        )
        self._transition(GlobalState.TRANSMISSION, early.instance_id, f"pushing {early.reserved_blocks} blocks")
        actions.append(NoteTransfer(TransferNote.STARTED))
        if not early.committed:
            return
        actions.append(NoteTransfer(TransferNote.COMMITTED))
        self._transition(GlobalState.GENERATING, early.instance_id, "KV received and verified")
        held, self._held = self._held, []
        for output in held:
            actions.extend(self.on_output(early, output, self._now_s, fleet))

    def _early_hop_lost(self, attempt: Attempt, reason: str) -> bool:
        """An early generation hop failed or its instance died while the prefill still runs: drop it;
        the hop starts again at context done, elsewhere if need be. True if that is the case."""
        if not (attempt.phase is Phase.GENERATION and attempt.early and self.state in (GlobalState.CONTEXT_WAIT, GlobalState.CONTEXT_IN_PROGRESS)):
            return False
        attempt.live = False
        attempt.failure_handled = True
        self._early_failure = f"the early reservation was lost: {reason}"
        if self.planned_generation == attempt.instance_id:
            self.planned_generation = None
        self._held.clear()
        return True

    def on_push_result(self, attempt: Attempt, push: PushResult, now_s: float, fleet: FleetView) -> list[Action]:
        """A prefill instance's result of a push it made for `attempt` (a prefill hop)."""
        self._now_s = now_s
        actions: list[Action] = []
        if self.ended or push.ok or attempt.phase is not Phase.PREFILL:
            return actions
        generation = self.generation
        if generation is None or generation.transfer_id != push.transfer_id or generation.failure_handled:
            return actions
        if self.state in (GlobalState.CONTEXT_WAIT, GlobalState.CONTEXT_IN_PROGRESS):
            # A push streaming the finished chunks of a context still computing failed: its
            # reservation may hold part of the KV. Free it; the hand-over starts again at context
            # done (the prefill instance keeps computing, and then holds the KV).
            generation.failure_handled = True
            self._early_failure = f"the streamed push failed: {push.reason}"
            self._stop(actions, generation, f"its push failed while the context computed: {push.reason}")
            return actions
        if self.state not in HANDOVER_STATES:
            # The receiver committed this transfer before the sender saw its call fail (a
            # connection lost after the commit): the hand-over stands; free the sender's copy.
            self._stop(actions, attempt, "KV already committed by the receiver")
            return actions
        failure = Failure.transfer_failed(f"{push.reason}: {push.detail}", kv_survives=attempt.live)
        self._transfer_failed(actions, generation, failure, fleet)
        return actions

    def on_push_call_failed(self, generation: Attempt, reason: str, now_s: float, fleet: FleetView) -> list[Action]:
        """The prefill instance could not be asked to push (unreachable): its KV is lost to us."""
        self._now_s = now_s
        actions: list[Action] = []
        if self.prefill is not None:
            self.prefill.live = False
        self._transfer_failed(actions, generation, Failure.transfer_failed(reason, kv_survives=False), fleet)
        return actions

    def on_submit_failed(
        self, attempt: Attempt, now_s: float, fleet: FleetView, *, rejected: tuple[str, str] | None = None, unavailable: str | None = None
    ) -> list[Action]:
        """A hop's submit failed: the instance refused its input (a client error), or could not be
        reached (recovery, with the instance suspected)."""
        self._now_s = now_s
        actions: list[Action] = []
        if self.ended or not attempt.live:
            return actions  # stopped meanwhile: nothing to recover
        attempt.live = False
        if rejected is not None:
            field, message = rejected
            return self._end(actions, Outcome.ERROR, None, None, ErrorKind.INVALID_ARGUMENT, f"{field}: {message}")
        if self._early_hop_lost(attempt, f"{attempt.instance_id} unavailable: {unavailable}"):
            return actions
        # A generation hop that could not be submitted leaves the prefill's KV where it was.
        kv_survives = attempt.phase is Phase.GENERATION and self.prefill is not None and self.prefill.holds_handover_kv
        self._recover(actions, attempt, Failure.unavailable(attempt.instance_id, unavailable, kv_survives=kv_survives), fleet)
        return actions

    def on_instance_dead(self, attempt: Attempt, reason: str, now_s: float, fleet: FleetView) -> list[Action]:
        """The instance of a live hop died (or restarted): what it held is gone."""
        self._now_s = now_s
        actions: list[Action] = []
        if self.ended or not attempt.live:
            return actions
        if self._early_hop_lost(attempt, reason):
            return actions
        attempt.live = False
        # The KV a prefill hop holds dies with it; a generation hop loses its reservation.
        kv_survives = attempt.phase is Phase.GENERATION and self.prefill is not None and self.prefill.holds_handover_kv
        self._recover(actions, attempt, Failure.instance_died(attempt.instance_id, reason, kv_survives=kv_survives), fleet)
        return actions

    # --- time ---------------------------------------------------------------------------------------
    def on_tick(self, now_s: float, fleet: FleetView) -> list[Action]:
        """The request's deadline and its current stage's timeout."""
        self._now_s = now_s
        actions: list[Action] = []
        if self.ended:
            return actions
        if self.deadline_s is not None and now_s >= self.deadline_s:
            return self._end(actions, Outcome.ABORTED, "abort", None, ErrorKind.DEADLINE_EXCEEDED, "the request's deadline passed")
        state = self.state
        if self.waiting is not None:
            return self._try_resume(actions, self.waiting, fleet)
        generation = self.generation
        if (
            generation is not None
            and generation.live
            and generation.early
            and generation.transfer_id is not None
            and not generation.committed
            and generation.lease_s > 0
            and state in (GlobalState.CONTEXT_WAIT, GlobalState.CONTEXT_IN_PROGRESS)
            and now_s - generation.renewed_s >= generation.lease_s / 3
        ):
            generation.renewed_s = now_s
            actions.append(RenewReservation(generation.instance_id, generation.engine_id))
        limit = stage_limit_s(state, self._config.timeouts, self._config.handover, generation.reserved_bytes if generation else 0)
        if limit is None or self.timeline.time_in_state_s(now_s) < limit:
            return actions
        in_handover = state in (GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION, GlobalState.GENERATING)
        attempt = self.generation if in_handover else self.prefill
        if attempt is None or attempt.failure_handled:
            attempt = self.generation or self.prefill
        if attempt is None:
            return actions
        kv_survives = state in HANDOVER_STATES and self.prefill is not None and self.prefill.live
        self._stop(actions, attempt, f"{state.name} exceeded {limit:.3g}s")
        self._recover(actions, attempt, Failure.stage_timeout(state, limit, kv_survives=kv_survives), fleet)
        return actions

    # --- ends -----------------------------------------------------------------------------------------
    def abort(self, now_s: float, error_kind: ErrorKind | None, message: str) -> list[Action]:
        """End the request as ABORTED (the client's abort has no error kind: its stream ends
        normally with finish reason "abort"; a deadline, a client gone, a drain name theirs)."""
        self._now_s = now_s
        return self._end([], Outcome.ABORTED, "abort", None, error_kind, message)

    def fail(self, now_s: float, error_kind: ErrorKind, message: str) -> list[Action]:
        self._now_s = now_s
        return self._end([], Outcome.ERROR, None, None, error_kind, message)

    def _complete(self, actions: list[Action], output: RequestOutput) -> None:
        reason = output.finish_reason.value if isinstance(output.finish_reason, FinishReason) else None
        self._end(actions, Outcome.COMPLETE, reason, output.stop_reason, None, "")

    def _end(
        self,
        actions: list[Action],
        outcome: Outcome,
        finish_reason: str | None,
        stop_reason: int | str | None,
        error_kind: ErrorKind | None,
        message: str,
    ) -> list[Action]:
        if self.ended:
            return actions
        for attempt in self.hops():
            # A completed request's handed-over prefill hop is done there already.
            if not (outcome is Outcome.COMPLETE and attempt.handed_over):
                self._stop(actions, attempt, message or "request ended")
        state = {Outcome.COMPLETE: GlobalState.COMPLETE, Outcome.ERROR: GlobalState.ERROR, Outcome.ABORTED: GlobalState.ABORTED}[outcome]
        self._transition(state, None, message or (finish_reason or ""))
        if message:
            self.error = message
        self.final = FinalEvent(
            outcome=outcome,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            usage=Usage(len(self.prompt_token_ids), len(self.outputs), self.cached_tokens),
            timeline=(),  # filled in by the driver, which knows the wall clock
            instances=tuple(self.uses),
            error_kind=error_kind,
            error_message=message,
        )
        actions.append(Finish(self.request_id, self.final))
        return actions

    # --- recovery: the decision is cluster/router/recovery.py's, its execution is here -------------
    def _transfer_failed(self, actions: list[Action], attempt: Attempt, failure: Failure, fleet: FleetView) -> None:
        if self.ended or attempt.failure_handled:
            return
        self._recover(actions, attempt, failure, fleet)

    def _recover(self, actions: list[Action], attempt: Attempt, failure: Failure, fleet: FleetView) -> None:
        """Take the next action of the recovery chain after `attempt` failed."""
        if self.ended:
            return
        attempt.failure_handled = True
        prefill, generation = self.prefill, self.generation
        standing = Standing(
            attempts=dict(self.recovery),
            in_handover=self.state in HANDOVER_STATES,
            prefill_instance=prefill.instance_id if prefill is not None else None,
            prefill_holds_kv=prefill is not None and prefill.holds_handover_kv,
            generation_instance=generation.instance_id if generation is not None else None,
        )
        self._execute(actions, decide(self._config.recovery, self._config.placement, failure, standing, fleet), fleet)

    def _execute(self, actions: list[Action], decision: Decision, fleet: FleetView) -> None:
        """Carry out a recovery decision: count it, note it, stop the hops it gives up, start the
        new one and move the request to where that hop starts."""
        action, reason = decision.action, decision.reason
        self.recovery[action] += 1
        actions.append(NoteRecovery(self.request_id, action, reason))
        self.error = reason
        if action is RecoveryAction.RETRY_TRANSFER:
            target = self._choose_generation(fleet, decision.exclude, receives_kv=True)
            if target is None:  # pragma: no cover - checked by applicability
                self._end(actions, Outcome.ERROR, None, None, ErrorKind.UNAVAILABLE, reason)
                return
            self._stop(actions, self.generation, "transfer retried")
            self._transition(GlobalState.GENERATION_INIT, target, f"retry transfer ({reason})")
            self._start(actions, fleet, Phase.GENERATION, target)
        elif action is RecoveryAction.RECOMPUTE_LOCAL:
            previous = self.generation
            target = decision.recompute_on
            if target is None:
                target = self._choose_generation(fleet, decision.exclude, receives_kv=False)
            if target is None:  # pragma: no cover - checked by applicability
                self._end(actions, Outcome.ERROR, None, None, ErrorKind.UNAVAILABLE, reason)
                return
            self._stop(actions, self.prefill, "recomputing on the generation instance")
            self._stop(actions, previous, "recomputing on the generation instance")
            detail = f"recompute locally on {target} ({reason})"
            if self.state in HANDOVER_STATES:
                self._transition(GlobalState.GENERATING, target, detail, Route.COLOCATED)
            else:
                self._transition(GlobalState.CONTEXT_WAIT, target, detail, Route.COLOCATED)
            self._start(actions, fleet, Phase.COLOCATED, target, recompute=True)
        elif action is RecoveryAction.WAIT_FOR_INSTANCE:
            assert decision.max_wait_s is not None  # decide sets it for this action
            for hop in self.hops():
                self._stop(actions, hop, "waiting for a healthy instance")
            self._transition(GlobalState.QUEUED, None, f"waiting up to {decision.max_wait_s:g}s for a healthy instance ({reason})")
            self.waiting = Wait.starting(self._now_s, decision.max_wait_s)
        elif action is RecoveryAction.REPREFILL_ELSEWHERE:
            try:
                plan = fleet.place(self.placement_request(), decision.elsewhere)
            except NoInstanceAvailable as error:
                self._end(actions, Outcome.ERROR, None, None, ErrorKind.UNAVAILABLE, f"{reason}; re-placement failed: {error}")
                return
            self._stop(actions, self.prefill, "prefill re-run elsewhere")
            self._stop(actions, self.generation, "prefill re-run elsewhere")
            what = "re-run prefill" if plan.route is Route.DISAGGREGATED else "re-run colocated"
            self._start_plan(actions, fleet, plan, f"{what} ({reason})")
        else:
            self._end(actions, Outcome.ERROR, None, None, ErrorKind.UNAVAILABLE, f"{reason}; recovery exhausted")

    def _try_resume(self, actions: list[Action], wait: Wait, fleet: FleetView) -> list[Action]:
        """A waiting request: place it once an instance can take it (its hops recompute the prompt
        and the tokens already streamed, and stream only what follows); fail it when the wait's
        bound passes. Its stage timers stay paused meanwhile (QUEUED has none)."""
        waited_s = wait.waited_s(self._now_s)
        if wait.expired(self._now_s):
            self.waiting = None
            return self._end(
                actions, Outcome.ERROR, None, None, ErrorKind.UNAVAILABLE, f"no healthy instance within {waited_s:.1f}s ({self.error})"
            )
        try:
            plan = fleet.place(self.placement_request(), frozenset())
        except NoInstanceAvailable:
            return actions
        self.waiting = None
        self._start_plan(actions, fleet, plan, f"placed after waiting {waited_s:.1f}s for a healthy instance")
        return actions

    def _choose_generation(self, fleet: FleetView, exclude: frozenset[str], *, receives_kv: bool) -> str | None:
        try:
            return fleet.choose_generation(self.placement_request(), exclude, receives_kv=receives_kv)
        except NoInstanceAvailable:
            return None

    # --- hops and transitions ---------------------------------------------------------------------
    def _start(
        self, actions: list[Action], fleet: FleetView, phase: Phase, instance_id: str, *, recompute: bool = False, token_with_kv: bool = False
    ) -> None:
        self.attempt_numbers[phase] += 1
        attempt = Attempt(self.request_id, phase, self.attempt_numbers[phase], instance_id, recompute=recompute, early=token_with_kv)
        if phase is Phase.PREFILL:
            self.prefill = attempt
        else:
            self.generation = attempt
        self.uses.append(InstanceUse(instance_id, fleet.role(instance_id), "recompute" if recompute else phase.value, attempt.number))
        actions.append(
            StartHop(
                request_id=self.request_id,
                engine_id=attempt.engine_id,
                instance_id=instance_id,
                phase=phase,
                prompt_token_ids=self.prompt_token_ids,
                sampling=self.params,
                output_token_ids=tuple(self.outputs),
                priority=self.priority,
                token_with_kv=token_with_kv,
            )
        )

    @staticmethod
    def _stop(actions: list[Action], attempt: Attempt | None, detail: str) -> None:
        """Retire a live hop at once (reports from it are ignored from here on) and have its
        instance free what it holds."""
        if attempt is None or not attempt.live:
            return
        attempt.live = False
        release = attempt.phase is Phase.PREFILL and attempt.context_done
        actions.append(StopHop(attempt.engine_id, attempt.instance_id, release, detail))

    def _transition(self, state: GlobalState, instance_id: str | None, detail: str, route: Route | None = None) -> None:
        try:
            self.timeline.transition(state, instance_id=instance_id, route=route, detail=detail, at_s=self._now_s)
        except IllegalTransition as error:
            if self._on_illegal is not None:
                self._on_illegal(f"{error}\n{''.join(traceback.format_stack(limit=20))}")
            logger.exception("router bug: illegal transition for %s", self.request_id)
            raise
