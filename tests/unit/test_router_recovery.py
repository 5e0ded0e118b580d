"""The recovery chain's decision alone (cluster/router/recovery.py): no flow, no fleet, no clock.

A failure, where the request stands and a scripted view of the fleet's health go in; the action of
the chain, what the failure left applicable and the instances to avoid come out. Each chain step is
checked with its applicability rule, its attempt limit and the step it falls back to; the wait's
bound and the stage timeouts too. The flow that executes these decisions is tested in
test_router_flow.py and test_router_wait_for_instance.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cluster.loadgen.chaos_report import recovery_cause
from cluster.router.config import (
    DisaggMode,
    FallbackKind,
    HandoverConfig,
    PlacementConfig,
    RecoveryAction,
    RecoveryConfig,
    RecoveryStep,
    StageTimeouts,
)
from cluster.router.recovery import (
    Cause,
    Failure,
    Standing,
    Wait,
    admission_wait_s,
    decide,
    outage,
    stage_limit_s,
    transmission_bound_s,
)
from cluster.router.state import GlobalState
from worker.protocol import InstanceRole

A = RecoveryAction
S = GlobalState
P, G, M = InstanceRole.PREFILL, InstanceRole.GENERATION, InstanceRole.MIXED
CHAIN = RecoveryConfig(
    chain=(
        RecoveryStep(A.RETRY_TRANSFER, 2),
        RecoveryStep(A.REPREFILL_ELSEWHERE, 1),
        RecoveryStep(A.RECOMPUTE_LOCAL, 1),
        RecoveryStep(A.WAIT_FOR_INSTANCE, 2, max_wait_s=20.0),
        RecoveryStep(A.FAIL),
    )
)
ALWAYS = PlacementConfig()
TRANSFER_FAILED = Failure.transfer_failed("checksum_mismatch: chunk 3", kv_survives=True)


@dataclass
class Health:
    """A fleet's health as the chain reads it: registered instances and which of them are down."""

    roles: dict[str, InstanceRole]
    down: set[str] = field(default_factory=set)

    def is_healthy(self, instance_id: str) -> bool:
        return instance_id in self.roles and instance_id not in self.down

    def has_healthy(self, roles: frozenset[InstanceRole], exclude: frozenset[str]) -> bool:
        return any(r in roles and i not in exclude and i not in self.down for i, r in self.roles.items())

    def has_members(self, roles: frozenset[InstanceRole]) -> bool:
        return any(r in roles for r in self.roles.values())


def fleet(*down: str) -> Health:
    return Health({"p0": P, "p1": P, "g0": G, "g1": G}, set(down))


def in_handover(**attempts: int) -> Standing:
    """A request in TRANSMISSION on p0 -> g0, the prefill hop holding its final KV."""
    return Standing(
        attempts={A(name): n for name, n in attempts.items()},
        in_handover=True,
        prefill_instance="p0",
        prefill_holds_kv=True,
        generation_instance="g0",
    )


def generating(**attempts: int) -> Standing:
    """A request GENERATING on g0 after its prefill on p0 (the hand-over done)."""
    return Standing({A(name): n for name, n in attempts.items()}, in_handover=False, prefill_instance="p0", generation_instance="g0")


# --- the chain, step by step ----------------------------------------------------------------------


def test_a_failed_transfer_whose_kv_survived_is_retried_first() -> None:
    decision = decide(CHAIN, ALWAYS, TRANSFER_FAILED, in_handover(), fleet())
    assert decision.action is A.RETRY_TRANSFER
    assert decision.reason == "KV transfer failed: checksum_mismatch: chunk 3"
    # Waiting is applicable whenever the roles the request needs were deployed (see outage).
    assert decision.applicable == {A.RETRY_TRANSFER, A.REPREFILL_ELSEWHERE, A.RECOMPUTE_LOCAL, A.WAIT_FOR_INSTANCE, A.FAIL}
    assert decision.exclude == frozenset() and decision.recompute_on is None and decision.max_wait_s is None


def test_each_step_is_taken_up_to_its_attempts_then_the_next() -> None:
    taken = []
    attempts: dict[A, int] = {}
    while True:
        standing = Standing(attempts, in_handover=True, prefill_instance="p0", prefill_holds_kv=True, generation_instance="g0")
        action = decide(CHAIN, ALWAYS, TRANSFER_FAILED, standing, fleet()).action
        taken.append(action)
        if action is A.FAIL:
            break
        attempts = {**attempts, action: attempts.get(action, 0) + 1}
    # Waiting is applicable with every instance healthy too (outage checks registration only).
    assert taken == [A.RETRY_TRANSFER] * 2 + [A.REPREFILL_ELSEWHERE, A.RECOMPUTE_LOCAL] + [A.WAIT_FOR_INSTANCE] * 2 + [A.FAIL]


@pytest.mark.parametrize(
    ("failure", "standing", "down", "why"),
    [
        (Failure.transfer_failed("peer_unavailable: gone", kv_survives=False), in_handover(), (), "the KV died with the failure"),
        (TRANSFER_FAILED, generating(), (), "the hand-over is done: the KV moved already"),
        (TRANSFER_FAILED, Standing({}, in_handover=True, prefill_instance="p0", generation_instance="g0"), (), "the prefill hop holds no KV"),
        (TRANSFER_FAILED, in_handover(), ("g0", "g1"), "no healthy generation instance"),
        (Failure.instance_died("g1", "instance g1 died: x", kv_survives=True), in_handover(), ("g0",), "only the suspect is left"),
    ],
)
def test_retry_transfer_needs_surviving_kv_a_pending_hand_over_and_a_generation_instance(failure, standing, down, why) -> None:
    decision = decide(CHAIN, ALWAYS, failure, standing, fleet(*down))
    assert A.RETRY_TRANSFER not in decision.applicable, why
    assert decision.action is not A.RETRY_TRANSFER


def test_reprefill_elsewhere_excludes_the_current_prefill_instance_and_the_suspect() -> None:
    decision = decide(CHAIN, ALWAYS, TRANSFER_FAILED, in_handover(retry_transfer=2), fleet())
    assert decision.action is A.REPREFILL_ELSEWHERE
    assert decision.elsewhere == {"p0"} and decision.exclude == frozenset()
    died = Failure.instance_died("g0", "instance g0 died: killed", kv_survives=False)
    decision = decide(CHAIN, ALWAYS, died, generating(), fleet("g0"))
    assert decision.action is A.REPREFILL_ELSEWHERE
    assert decision.elsewhere == {"p0", "g0"} and decision.exclude == {"g0"}


def test_reprefill_elsewhere_is_skipped_without_another_prefill_instance() -> None:
    # p1 is down and p0 is the request's own: judged on the candidates re-placement would see.
    decision = decide(CHAIN, ALWAYS, TRANSFER_FAILED, in_handover(retry_transfer=2), fleet("p1"))
    assert A.REPREFILL_ELSEWHERE not in decision.applicable
    assert decision.action is A.RECOMPUTE_LOCAL


def test_reprefill_elsewhere_needs_a_generation_instance_other_than_the_suspect() -> None:
    died = Failure.instance_died("g1", "instance g1 died: killed", kv_survives=False)
    decision = decide(CHAIN, ALWAYS, died, generating(), fleet("g0"))
    assert A.REPREFILL_ELSEWHERE not in decision.applicable and A.RECOMPUTE_LOCAL not in decision.applicable


def test_recompute_local_stays_on_the_previous_generation_instance_when_it_can() -> None:
    hop_failed = Failure(Cause.HOP_FAILED, "internal: step failed")
    decision = decide(CHAIN, ALWAYS, hop_failed, generating(reprefill_elsewhere=1), fleet())
    assert decision.action is A.RECOMPUTE_LOCAL and decision.recompute_on == "g0"


@pytest.mark.parametrize(
    ("failure", "down"),
    [
        (Failure.instance_died("g0", "instance g0 died: killed", kv_survives=False), ("g0",)),  # the suspect
        (Failure.unavailable("g0", "connection refused", kv_survives=False), ()),  # suspected though not down
        (Failure(Cause.HOP_FAILED, "internal: step failed"), ("g0",)),  # not healthy
    ],
)
def test_recompute_local_moves_when_the_previous_generation_instance_cannot_take_it(failure, down) -> None:
    decision = decide(CHAIN, ALWAYS, failure, generating(reprefill_elsewhere=1), fleet(*down))
    assert decision.action is A.RECOMPUTE_LOCAL and decision.recompute_on is None
    assert decision.exclude == ({failure.suspect} if failure.suspect else frozenset())


def test_a_chain_is_walked_in_its_own_order() -> None:
    chain = RecoveryConfig(chain=(RecoveryStep(A.RECOMPUTE_LOCAL), RecoveryStep(A.RETRY_TRANSFER), RecoveryStep(A.FAIL)))
    assert decide(chain, ALWAYS, TRANSFER_FAILED, in_handover(), fleet()).action is A.RECOMPUTE_LOCAL
    assert decide(chain, ALWAYS, TRANSFER_FAILED, in_handover(recompute_local=1), fleet()).action is A.RETRY_TRANSFER


def test_an_action_the_chain_does_not_list_is_never_taken() -> None:
    chain = RecoveryConfig(chain=(RecoveryStep(A.RETRY_TRANSFER), RecoveryStep(A.FAIL)))
    decision = decide(chain, ALWAYS, TRANSFER_FAILED, in_handover(retry_transfer=1), fleet())
    assert A.RECOMPUTE_LOCAL in decision.applicable and decision.action is A.FAIL


def test_fail_is_always_applicable_and_ends_a_chain_of_only_fail() -> None:
    decision = decide(RecoveryConfig(chain=(RecoveryStep(A.FAIL),)), ALWAYS, TRANSFER_FAILED, in_handover(), fleet())
    assert decision.action is A.FAIL and A.FAIL in decision.applicable


# --- waiting for an instance ----------------------------------------------------------------------


def test_waiting_is_applicable_for_deployed_roles_only() -> None:
    died = Failure.instance_died("g0", "instance g0 died: killed", kv_survives=False)
    decision = decide(CHAIN, ALWAYS, died, generating(), Health({"p0": P, "g0": G, "g1": G}, {"g0"}))
    assert A.WAIT_FOR_INSTANCE in decision.applicable
    decision = decide(CHAIN, ALWAYS, died, generating(), Health({"g0": G}, {"g0"}))
    assert decision.applicable == {A.FAIL} and decision.action is A.FAIL


def test_an_outage_makes_waiting_applicable_with_the_steps_bound() -> None:
    died = Failure.instance_died("g0", "instance g0 died: killed", kv_survives=False)
    decision = decide(CHAIN, ALWAYS, died, generating(), Health({"p0": P, "g0": G}, {"g0"}))
    assert decision.applicable == {A.WAIT_FOR_INSTANCE, A.FAIL}
    assert decision.action is A.WAIT_FOR_INSTANCE and decision.max_wait_s == 20.0


def test_the_wait_has_its_attempts_then_the_request_fails() -> None:
    health = Health({"p0": P, "g0": G}, {"g0"})
    died = Failure.instance_died("g0", "instance g0 died: killed", kv_survives=False)
    assert decide(CHAIN, ALWAYS, died, generating(wait_for_instance=1), health).action is A.WAIT_FOR_INSTANCE
    assert decide(CHAIN, ALWAYS, died, generating(wait_for_instance=2), health).action is A.FAIL


def test_only_registered_roles_make_an_outage() -> None:
    assert outage(ALWAYS, Health({"p0": P, "g0": G}, {"p0", "g0"}))
    assert not outage(ALWAYS, Health({"p0": P}, {"p0"})), "no generation instance was ever deployed"
    assert not outage(ALWAYS, Health({"g0": G}, {"g0"})), "disaggregation always needs a prefill instance"
    assert not outage(ALWAYS, Health({"m0": M}, {"m0"})), "nor without one when only MIXED ones were deployed"
    colocating = PlacementConfig(allowed_fallbacks=frozenset({FallbackKind.COLOCATE_WHEN_NO_PREFILL}))
    assert outage(colocating, Health({"g0": G}, {"g0"})), "a fallback runs it without a prefill instance"
    assert outage(PlacementConfig(disaggregation=DisaggMode.NEVER), Health({"m0": M}, {"m0"}))


def test_admission_waits_only_during_an_outage_and_only_if_the_chain_waits() -> None:
    down = Health({"p0": P, "g0": G}, {"p0", "g0"})
    assert admission_wait_s(CHAIN, ALWAYS, down) == 20.0
    assert admission_wait_s(CHAIN, ALWAYS, Health({"p0": P}, {"p0"})) is None
    no_wait = RecoveryConfig(chain=(RecoveryStep(A.RETRY_TRANSFER), RecoveryStep(A.FAIL)))
    assert admission_wait_s(no_wait, ALWAYS, down) is None


def test_a_wait_is_bounded() -> None:
    wait = Wait.starting(100.0, 20.0)
    assert (wait.since_s, wait.until_s) == (100.0, 120.0)
    assert wait.waited_s(112.5) == 12.5
    assert not wait.expired(119.99) and wait.expired(120.0) and wait.expired(130.0)


# --- stage timeouts -------------------------------------------------------------------------------

TIMEOUTS = StageTimeouts(context_s=30.0, reservation_s=10.0, transfer_s=12.0, generation_s=60.0)
HANDOVER = HandoverConfig(stall_base_s=2.0, stall_min_bytes_per_s=1e6)


@pytest.mark.parametrize(
    ("state", "limit"),
    [
        (S.CONTEXT_WAIT, 30.0),
        (S.CONTEXT_IN_PROGRESS, 30.0),
        (S.GENERATION_INIT, 10.0),
        (S.TRANSMISSION, 2.0 + 3.0),
        (S.GENERATING, 60.0),
        (S.QUEUED, None),
        (S.COMPLETE, None),
        (S.ERROR, None),
        (S.ABORTED, None),
    ],
)
def test_each_state_has_its_stage_limit(state, limit) -> None:
    assert stage_limit_s(state, TIMEOUTS, HANDOVER, 3_000_000) == limit


def test_the_transmission_bound_scales_with_the_bytes_up_to_the_transfer_timeout() -> None:
    assert transmission_bound_s(TIMEOUTS, HANDOVER, 0) == 2.0
    assert transmission_bound_s(TIMEOUTS, HANDOVER, 4_000_000) == 6.0
    assert transmission_bound_s(TIMEOUTS, HANDOVER, 50_000_000) == 12.0


# --- what a failure says --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "reason", "cause"),
    [
        (TRANSFER_FAILED, "KV transfer failed: checksum_mismatch: chunk 3", "checksum_mismatch"),
        (
            Failure.stage_timeout(S.TRANSMISSION, 4.56789, kv_survives=True),
            "TRANSMISSION exceeded its 4.57s stage timeout",
            "stage_timeout",
        ),
        (Failure.instance_died("g0", "instance g0 died: killed", kv_survives=False), "instance g0 died: killed", "instance_died"),
        (Failure.unavailable("g0", "connection refused", kv_survives=True), "g0 unavailable: connection refused", "instance_unavailable"),
        (Failure(Cause.NO_INSTANCE, "no generation instance for the hand-over"), "no generation instance for the hand-over", "no_instance"),
        (Failure(Cause.KV_LOST, "reservation made but the prefill KV is gone"), "reservation made but the prefill KV is gone", "kv_lost"),
    ],
)
def test_a_failures_reason_is_what_the_chaos_report_reads_its_cause_from(failure, reason, cause) -> None:
    assert failure.reason == reason
    assert decide(CHAIN, ALWAYS, failure, in_handover(), fleet()).reason == reason
    assert recovery_cause(reason) == cause


def test_the_suspect_of_a_failure_is_the_instance_it_names() -> None:
    assert Failure.instance_died("g0", "instance g0 died: x", kv_survives=False).suspect == "g0"
    assert Failure.unavailable("p1", "refused", kv_survives=False).suspect == "p1"
    assert TRANSFER_FAILED.suspect is None and Failure.stage_timeout(S.GENERATING, 1.0, kv_survives=False).suspect is None
