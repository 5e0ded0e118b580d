"""The recovery chain of one request, as a pure decision: what failed in, what to do out.

When a hop of a request fails (cluster/router/flow.py notices it: a transfer failed, a stage timed
out, an instance died or could not be reached, no instance was left for the hand-over), `decide`
takes the configured chain (RecoveryConfig in cluster/router/config.py), the attempts the request
already used per action, the `Failure` and where the request stands (`Standing`), reads the
fleet's health (`FleetHealth`, read only) and returns a `Decision`: the first action of the chain
that this failure leaves applicable and that has attempts left, the instances it must avoid, and
why. The flow executes it (stops hops, starts hops, transitions) and counts the attempt.

An action is applicable when:

  RETRY_TRANSFER       the request is in the hand-over (GENERATION_INIT, TRANSMISSION), the failure
                       left the prefill hop's final KV in place and it still holds it, and a healthy
                       generation instance other than the suspect exists
  REPREFILL_ELSEWHERE  a healthy PREFILL and a healthy generation instance exist other than the
                       suspect and the current prefill instance (re-placement excludes both)
  RECOMPUTE_LOCAL      a healthy generation instance other than the suspect exists; it runs on the
                       previous generation instance when that one is healthy and not the suspect
  WAIT_FOR_INSTANCE    the roles the request needs were deployed (`outage`: registered, healthy or
                       not; the health of those left is not checked here, so with healthy instances
                       the wait ends at the next tick's placement); bounded by max_wait_s (`Wait`)
  FAIL                 always

The stage timeouts that start recovery are here too (`stage_limit_s`): the flow's watchdog tick
compares the time in the current state against them. Nothing here holds state, does I/O or reads a
clock; no action is taken here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from cluster.router.config import (
    DisaggMode,
    HandoverConfig,
    PlacementConfig,
    RecoveryAction,
    RecoveryConfig,
    StageTimeouts,
)
from cluster.router.placement import GENERATION_ROLES
from cluster.router.state import GlobalState
from worker.protocol import InstanceRole

PREFILL_ROLES = frozenset({InstanceRole.PREFILL})
# The hand-over's states: the prefill hop's KV has not moved to the generation hop yet.
HANDOVER_STATES = frozenset({GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION})


class FleetHealth(Protocol):
    """What the recovery chain reads of the fleet: health only (cluster/router/fleet.py)."""

    def is_healthy(self, instance_id: str) -> bool: ...

    def has_healthy(self, roles: frozenset[InstanceRole], exclude: frozenset[str]) -> bool: ...

    def has_members(self, roles: frozenset[InstanceRole]) -> bool:
        """Whether instances of these roles were registered at all (healthy or not)."""
        ...


class Cause(Enum):
    """What failed. The recovery note, the request's error and the timeline carry `Failure.reason`;
    the chaos report (cluster/loadgen/chaos_report.py recovery_cause) reads the cause back from it."""

    TRANSFER_FAILED = "transfer_failed"  # the KV hand-over failed (push, receiver, or its prefill hop)
    HOP_FAILED = "hop_failed"  # a hop ended in error outside the hand-over
    INSTANCE_DIED = "instance_died"  # its instance was declared dead or restarted
    INSTANCE_UNAVAILABLE = "instance_unavailable"  # its submit could not reach the instance
    STAGE_TIMEOUT = "stage_timeout"  # the request stayed in a state past its bound
    NO_INSTANCE = "no_instance"  # no generation instance for the hand-over
    KV_LOST = "kv_lost"  # a reservation was made after the prefill's KV was lost


@dataclass(frozen=True)
class Failure:
    """One failure of one hop, as the flow saw it."""

    cause: Cause
    detail: str
    # The prefill hop's final KV outlived the failure (a retried hand-over can push it again).
    kv_survives: bool = False
    # The instance suspected of the failure (unreachable or dead): no new hop goes there.
    suspect: str | None = None

    @property
    def reason(self) -> str:
        if self.cause is Cause.TRANSFER_FAILED:
            return f"KV transfer failed: {self.detail}"
        return self.detail

    @classmethod
    def transfer_failed(cls, detail: str, *, kv_survives: bool) -> Failure:
        return cls(Cause.TRANSFER_FAILED, detail, kv_survives)

    @classmethod
    def stage_timeout(cls, state: GlobalState, limit_s: float, *, kv_survives: bool) -> Failure:
        return cls(Cause.STAGE_TIMEOUT, f"{state.name} exceeded its {limit_s:.3g}s stage timeout", kv_survives)

    @classmethod
    def unavailable(cls, instance_id: str, detail: str | None, *, kv_survives: bool) -> Failure:
        return cls(Cause.INSTANCE_UNAVAILABLE, f"{instance_id} unavailable: {detail}", kv_survives, suspect=instance_id)

    @classmethod
    def instance_died(cls, instance_id: str, detail: str, *, kv_survives: bool) -> Failure:
        return cls(Cause.INSTANCE_DIED, detail, kv_survives, suspect=instance_id)


@dataclass(frozen=True)
class Standing:
    """Where the request stands when one of its hops fails."""

    attempts: Mapping[RecoveryAction, int]  # actions already taken for this request
    in_handover: bool  # GENERATION_INIT or TRANSMISSION (once GENERATING, the KV moved already)
    prefill_instance: str | None = None  # the current prefill hop's instance
    prefill_holds_kv: bool = False  # that hop is live with its final KV held for the hand-over
    generation_instance: str | None = None  # the current generation (or colocated) hop's instance


@dataclass(frozen=True)
class Decision:
    """What to do about a failure, and why."""

    action: RecoveryAction
    reason: str  # the failure's reason: the recovery note, the request's error, the timeline's
    applicable: frozenset[RecoveryAction]  # what the failure left open (FAIL always)
    exclude: frozenset[str]  # no new hop goes to these (the suspect)
    # REPREFILL_ELSEWHERE: the exclusions of the new placement (also the current prefill instance).
    elsewhere: frozenset[str]
    recompute_on: str | None = None  # RECOMPUTE_LOCAL: the previous generation instance, if usable
    max_wait_s: float | None = None  # WAIT_FOR_INSTANCE: the wait's bound


def decide(chain: RecoveryConfig, placement: PlacementConfig, failure: Failure, standing: Standing, fleet: FleetHealth) -> Decision:
    """The next action of the recovery chain after `failure` (RecoveryConfig.next_action over the
    actions applicable to it)."""
    exclude = frozenset({failure.suspect} if failure.suspect else ())
    applicable = {RecoveryAction.FAIL}
    # Retrying the transfer needs the prefill's KV and a hand-over not yet done: once the request is
    # GENERATING, tokens came from the generation hop and the KV moved already.
    if failure.kv_survives and standing.in_handover and standing.prefill_holds_kv and fleet.has_healthy(GENERATION_ROLES, exclude):
        applicable.add(RecoveryAction.RETRY_TRANSFER)
    # Re-placement excludes the request's current prefill instance: judge applicability on the same
    # candidates, or the chain stops at a placement failure instead of moving on.
    elsewhere = exclude | ({standing.prefill_instance} if standing.prefill_instance is not None else frozenset())
    if fleet.has_healthy(PREFILL_ROLES, elsewhere) and fleet.has_healthy(GENERATION_ROLES, elsewhere):
        applicable.add(RecoveryAction.REPREFILL_ELSEWHERE)
    if fleet.has_healthy(GENERATION_ROLES, exclude):
        applicable.add(RecoveryAction.RECOMPUTE_LOCAL)
    if outage(placement, fleet):
        applicable.add(RecoveryAction.WAIT_FOR_INSTANCE)
    action = chain.next_action(standing.attempts, frozenset(applicable))
    recompute_on = None
    max_wait_s = None
    if action is RecoveryAction.RECOMPUTE_LOCAL:
        previous = standing.generation_instance
        if previous is not None and previous not in exclude and fleet.is_healthy(previous):
            recompute_on = previous
    elif action is RecoveryAction.WAIT_FOR_INSTANCE:
        step = chain.step(action)
        assert step is not None  # next_action took it from the chain
        max_wait_s = step.max_wait_s
    return Decision(action, failure.reason, frozenset(applicable), exclude, elsewhere, recompute_on, max_wait_s)


def outage(placement: PlacementConfig, fleet: FleetHealth) -> bool:
    """Whether instances of the roles a request needs were registered, healthy or not: worth
    waiting for (Ray restarts them, or they answer again), unlike roles never deployed. It does not
    check that none is healthy: at admission placement just failed; in the chain, waiting is
    applicable whenever this holds, and a wait with healthy instances ends at the next tick."""
    if not fleet.has_members(GENERATION_ROLES):
        return False
    needs_prefill = placement.disaggregation is DisaggMode.ALWAYS and not placement.allowed_fallbacks
    return not needs_prefill or fleet.has_members(PREFILL_ROLES)


def admission_wait_s(chain: RecoveryConfig, placement: PlacementConfig, fleet: FleetHealth) -> float | None:
    """A request no instance can take at admission: how long it may wait for one (the chain's
    WAIT_FOR_INSTANCE bound, during an outage), or None: refuse it now."""
    step = chain.step(RecoveryAction.WAIT_FOR_INSTANCE)
    if step is not None and outage(placement, fleet):
        return step.max_wait_s
    return None


@dataclass(frozen=True)
class Wait:
    """A request waiting (in QUEUED, its stage timers paused) for a healthy instance."""

    since_s: float
    until_s: float

    @classmethod
    def starting(cls, now_s: float, max_wait_s: float) -> Wait:
        return cls(now_s, now_s + max_wait_s)

    def waited_s(self, now_s: float) -> float:
        return now_s - self.since_s

    def expired(self, now_s: float) -> bool:
        """The wait's bound passed: the request fails."""
        return now_s >= self.until_s


def transmission_bound_s(timeouts: StageTimeouts, handover: HandoverConfig, reserved_bytes: int) -> float:
    """How long TRANSMISSION may last: long enough for the transfer's bytes at the slowest rate a
    healthy path keeps, plus a fixed allowance, and never beyond timeouts.transfer_s. A stalled
    transfer is retried at the speed of its size, not after a deadline sized for the largest."""
    size_bound_s = handover.stall_base_s + reserved_bytes / handover.stall_min_bytes_per_s
    return min(timeouts.transfer_s, size_bound_s)


def stage_limit_s(state: GlobalState, timeouts: StageTimeouts, handover: HandoverConfig, reserved_bytes: int) -> float | None:
    """How long a request may stay in `state` before recovery starts (None: no bound; QUEUED, while
    a request waits for an instance, has its own). `reserved_bytes`: the generation hop's
    reservation, which sizes TRANSMISSION's bound."""
    if state is GlobalState.CONTEXT_WAIT or state is GlobalState.CONTEXT_IN_PROGRESS:
        return timeouts.context_s
    if state is GlobalState.GENERATION_INIT:
        return timeouts.reservation_s
    if state is GlobalState.TRANSMISSION:
        return transmission_bound_s(timeouts, handover, reserved_bytes)
    if state is GlobalState.GENERATING:
        return timeouts.generation_s
    return None
