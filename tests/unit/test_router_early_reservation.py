"""Early KV reservation in the request flow (cluster/router/flow.py, router.handover.reserve).

The generation hop is submitted while the prefill runs; its reservation is relayed to the prefill
instance at once (a Push the instance keeps until its KV is final), and the prefill's first token
then moves the request through GENERATION_INIT and TRANSMISSION with no instance call on the
critical path. The instances' reports can arrive in any order across instances: these cases script
the orders that matter, and every step is checked with test_router_flow.py's invariants.
"""

from __future__ import annotations

import pytest

from cluster.router.actions import (
    EmitTokens,
    NoteRecovery,
    NoteTransfer,
    Phase,
    Push,
    RenewReservation,
    StartHop,
    StopHop,
)
from cluster.router.flow import Attempt
from cluster.router.recovery import transmission_bound_s
from cluster.router.state import GlobalState
from scheduler.state import LlmRequestState
from tests.unit.test_router_flow import Run, config, fleet_of, new_run, output, set_health
from worker.protocol import ErrorCode, InstanceRole, PushResult, RequestError, ReservationNotice
from worker.stopping import FinishReason

S = GlobalState
LEASE_S = 30.0


def early_run(reserve: str = "at_context_start") -> Run:
    fleet = fleet_of(
        ("p0", InstanceRole.PREFILL), ("p1", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION), ("g1", InstanceRole.GENERATION)
    )
    return new_run(fleet, config(reserve=reserve))


def starts(actions) -> list[StartHop]:
    return [a for a in actions if isinstance(a, StartHop)]


def prefill_started(run: Run) -> list:
    prefill = run.hop(Phase.PREFILL)
    return run.apply(lambda f, t, fl: f.on_state(prefill, InstanceRole.PREFILL, LlmRequestState.CONTEXT_INIT, "prefill started", t, fl))


def reserve(run: Run, hop: Attempt, transfer_id: str = "t" * 24) -> list:
    notice = ReservationNotice(hop.engine_id, transfer_id, 3, 1e12, LEASE_S)
    return run.apply(lambda f, t, fl: f.on_reservation(hop, notice, t, fl))


def commit(run: Run, hop: Attempt) -> list:
    return run.apply(
        lambda f, t, fl: f.on_state(hop, InstanceRole.GENERATION, LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE, "KV received", t, fl)
    )


def first_token(run: Run, token: int = 5) -> list:
    prefill = run.hop(Phase.PREFILL)
    return run.apply(lambda f, t, fl: f.on_output(prefill, output(prefill, (token,), context_done=True), t, fl))


def relayed_run() -> tuple[Run, Attempt]:
    """A request whose prefill runs and whose early reservation was relayed to it."""
    run = early_run()
    run.apply(lambda f, t, fl: f.admit(t, fl))
    prefill_started(run)
    generation = run.hop(Phase.GENERATION)
    reserve(run, generation)
    return run, generation


def states(run: Run) -> list[GlobalState]:
    return [entry.state for entry in run.flow.timeline.entries]


def test_at_context_start_submits_the_generation_hop_when_the_prefill_starts() -> None:
    run = early_run()
    admitted = run.apply(lambda f, t, fl: f.admit(t, fl))
    assert [s.phase for s in starts(admitted)] == [Phase.PREFILL]
    started = prefill_started(run)
    (generation,) = starts(started)
    assert generation.phase is Phase.GENERATION and generation.token_with_kv
    assert run.flow.state is S.CONTEXT_IN_PROGRESS


def test_at_admission_submits_both_hops_at_once() -> None:
    run = early_run("at_admission")
    admitted = run.apply(lambda f, t, fl: f.admit(t, fl))
    assert [s.phase for s in starts(admitted)] == [Phase.PREFILL, Phase.GENERATION]
    assert starts(admitted)[1].token_with_kv
    assert not starts(prefill_started(run)), "one generation hop"


def test_at_context_done_keeps_the_hand_over_after_the_first_token() -> None:
    run = early_run("at_context_done")
    run.apply(lambda f, t, fl: f.admit(t, fl))
    assert not starts(prefill_started(run))
    (generation,) = starts(first_token(run))
    assert not generation.token_with_kv and generation.output_token_ids == (5,)


def test_the_reservation_is_relayed_during_the_prefill_and_the_first_token_moves_the_request() -> None:
    run = early_run()
    run.apply(lambda f, t, fl: f.admit(t, fl))
    prefill_started(run)
    generation = run.hop(Phase.GENERATION)
    relayed = reserve(run, generation)
    (push,) = [a for a in relayed if isinstance(a, Push)]
    assert push.engine_id == run.hop(Phase.PREFILL).engine_id and push.target_engine_id == generation.engine_id
    # It may start streaming the first finished chunks while the context computes: held to the
    # transfer deadline, which covers that time, not to TRANSMISSION's bound, which does not.
    assert push.deadline_s == config().timeouts.transfer_s
    assert run.flow.state is S.CONTEXT_IN_PROGRESS, "a reservation is no transition: the prefill still runs"
    out = first_token(run)
    assert [a.event.token_ids for a in out if isinstance(a, EmitTokens)] == [(5,)]
    assert not [a for a in out if isinstance(a, (Push, StartHop))], "nothing left to ask of an instance"
    assert run.flow.state is S.TRANSMISSION
    assert "reserved early" in run.flow.timeline.entries[-2].detail
    commit(run, generation)
    assert run.flow.state is S.GENERATING
    done = run.apply(lambda f, t, fl: f.on_output(generation, output(generation, (6, 7), finished=True, finish_reason=FinishReason.LENGTH), t, fl))
    assert run.flow.final is not None and run.flow.final.outcome.name == "COMPLETE"
    assert [a.event.token_ids for a in done if isinstance(a, EmitTokens)] == [(6, 7)]
    assert states(run) == [S.QUEUED, S.CONTEXT_WAIT, S.CONTEXT_IN_PROGRESS, S.GENERATION_INIT, S.TRANSMISSION, S.GENERATING, S.COMPLETE]


def test_a_commit_and_tokens_before_the_first_token_are_held_then_streamed_in_order() -> None:
    run, generation = relayed_run()
    # The generation instance's poll loop is ahead of the prefill instance's.
    committed = commit(run, generation)
    assert not [a for a in committed if type(a).__name__ == "NoteInconsistent"]
    early_tokens = run.apply(lambda f, t, fl: f.on_output(generation, output(generation, (6,)), t, fl))
    assert not [a for a in early_tokens if isinstance(a, EmitTokens)], "no token before the first"
    assert run.flow.state is S.CONTEXT_IN_PROGRESS
    out = first_token(run)
    assert [a.event.token_ids for a in out if isinstance(a, EmitTokens)] == [(5,), (6,)]
    assert [a.note.value for a in out if isinstance(a, NoteTransfer)] == ["started", "committed"]
    assert run.flow.state is S.GENERATING
    assert run.flow.outputs == [5, 6]


def test_a_pool_too_full_to_reserve_early_reserves_after_the_first_token() -> None:
    run = early_run()
    run.apply(lambda f, t, fl: f.admit(t, fl))
    prefill_started(run)
    generation = run.hop(Phase.GENERATION)
    out = first_token(run)
    assert not starts(out), "the early hop still waits for its blocks: no second hop"
    assert run.flow.state is S.GENERATION_INIT
    relayed = reserve(run, generation)
    assert [type(a) for a in relayed if isinstance(a, Push)] == [Push]
    assert run.flow.state is S.TRANSMISSION
    # Sent once the KV is final: held to TRANSMISSION's bound (a stalled push gives up when the
    # router does), not to the transfer deadline.
    (push,) = [a for a in relayed if isinstance(a, Push)]
    config_ = config()
    assert push.deadline_s == transmission_bound_s(config_.timeouts, config_.handover, generation.reserved_bytes) < config_.timeouts.transfer_s


def test_early_reservations_are_renewed_until_the_context_is_done() -> None:
    run, generation = relayed_run()
    assert not [a for a in run.apply(lambda f, t, fl: f.on_tick(t, fl)) if isinstance(a, RenewReservation)]
    renew = run.apply(lambda f, t, fl: f.on_tick(t + LEASE_S / 3, fl))
    assert renew == [RenewReservation("g0", generation.engine_id)]
    first_token(run)
    assert not [a for a in run.apply(lambda f, t, fl: f.on_tick(t + LEASE_S, fl)) if isinstance(a, RenewReservation)]


@pytest.mark.parametrize("how", ["instance died", "submit unavailable", "reservation expired"])
def test_an_early_hop_lost_during_the_prefill_costs_no_recovery(how: str) -> None:
    run, generation = relayed_run()
    if how == "instance died":
        set_health(run.fleet, "g0", False)
        out = run.apply(lambda f, t, fl: f.on_instance_dead(generation, "instance g0 died", t, fl))
    elif how == "submit unavailable":
        set_health(run.fleet, "g0", False)
        out = run.apply(lambda f, t, fl: f.on_submit_failed(generation, t, fl, unavailable="gone"))
    else:
        error = RequestError(ErrorCode.RESERVATION_EXPIRED, "no KV", "RESERVATION_EXPIRED")
        out = run.apply(lambda f, t, fl: f.on_output(generation, output(generation, finished=True, error=error), t, fl))
    assert not [a for a in out if isinstance(a, (NoteRecovery, StopHop, StartHop))], out
    assert run.flow.prefill is not None and run.flow.prefill.live, "the prefill runs on"
    assert run.flow.state is S.CONTEXT_IN_PROGRESS
    (late,) = starts(first_token(run))
    assert late.phase is Phase.GENERATION and not late.token_with_kv and late.output_token_ids == (5,)
    if how != "reservation expired":
        assert late.instance_id == "g1"
    assert run.flow.state is S.GENERATION_INIT


def test_a_failed_prefill_stops_its_early_generation_hop() -> None:
    run, generation = relayed_run()
    prefill = run.hop(Phase.PREFILL)
    error = RequestError(ErrorCode.INTERNAL, "model failed")
    out = run.apply(lambda f, t, fl: f.on_output(prefill, output(prefill, finished=True, error=error), t, fl))
    stopped = {a.engine_id for a in out if isinstance(a, StopHop)}
    assert generation.engine_id in stopped, "the early reservation is freed"
    assert [a.action.value for a in out if isinstance(a, NoteRecovery)] == ["reprefill_elsewhere"]
    assert run.flow.state is S.CONTEXT_WAIT


def test_a_client_abort_during_the_prefill_frees_both_hops() -> None:
    run = early_run("at_admission")
    run.apply(lambda f, t, fl: f.admit(t, fl))
    hops = [h.engine_id for h in run.flow.hops()]
    out = run.apply(lambda f, t, fl: f.abort(t, None, "aborted by the client"))
    assert sorted(a.engine_id for a in out if isinstance(a, StopHop)) == sorted(hops)


def test_a_failed_early_push_retries_the_transfer_from_the_held_kv() -> None:
    run, generation = relayed_run()
    first_token(run)
    prefill = run.hop(Phase.PREFILL)
    push = PushResult(prefill.engine_id, generation.transfer_id or "", False, "PEER_UNAVAILABLE", "x", 0, 0.0)
    out = run.apply(lambda f, t, fl: f.on_push_result(prefill, push, t, fl))
    assert [a.action.value for a in out if isinstance(a, NoteRecovery)] == ["retry_transfer"]
    (retry,) = starts(out)
    assert retry.phase is Phase.GENERATION and not retry.token_with_kv and retry.output_token_ids == (5,)
    assert run.flow.state is S.GENERATION_INIT


# ---- every event in every state, with early reservations --------------------------------------------
from tests.unit.test_router_flow import EVENTS, STATE_IDS, STATES, to_state  # noqa: E402


@pytest.mark.parametrize("event", sorted(EVENTS))
@pytest.mark.parametrize(("state", "route"), STATES, ids=STATE_IDS)
@pytest.mark.parametrize("reserve_at", ["at_admission", "at_context_start"])
def test_every_event_in_every_state_keeps_the_invariants(reserve_at: str, state: GlobalState, route, event: str) -> None:
    """No illegal transition (it would raise), the invariants of test_router_flow.py on every step,
    and the ends the client asked for."""
    run = to_state(state, route, cfg=config(reserve=reserve_at, **({"disaggregation": "never"} if route.name == "COLOCATED" else {})))
    assert run.flow.state is state
    if state is S.QUEUED:
        return
    run.apply(EVENTS[event](run))
    if event in ("client abort", "deadline"):
        assert run.flow.ended and run.flow.final.outcome.name == "ABORTED"
    if not run.flow.ended and event != "hop aborted by its instance":  # only the router aborts a hop
        live = [h for h in run.flow.hops() if h.live]
        assert live, "a request in flight has a live hop"


def test_a_push_failing_while_the_context_streams_frees_the_early_reservation() -> None:
    """The prefill instance streams finished chunks to the early reservation and the push fails
    before the context is done: the generation hop is stopped (its blocks may hold part of the KV),
    no recovery is needed, and the hand-over starts again from the KV the prefill still computes."""
    run, generation = relayed_run()
    prefill = run.hop(Phase.PREFILL)
    push = PushResult(prefill.engine_id, generation.transfer_id or "", False, "CHECKSUM_MISMATCH", "x", 0, 0.0)
    out = run.apply(lambda f, t, fl: f.on_push_result(prefill, push, t, fl))
    assert [a.engine_id for a in out if isinstance(a, StopHop)] == [generation.engine_id]
    assert not [a for a in out if isinstance(a, NoteRecovery)]
    assert prefill.live and run.flow.state is S.CONTEXT_IN_PROGRESS
    (late,) = starts(first_token(run))
    assert late.phase is Phase.GENERATION and not late.token_with_kv
    assert run.flow.state is S.GENERATION_INIT
    assert "retry transfer (the streamed push failed: CHECKSUM_MISMATCH)" in run.flow.timeline.entries[-1].detail


def test_the_timeline_says_why_the_hand_over_was_retried_at_context_done() -> None:
    run, generation = relayed_run()
    error = RequestError(ErrorCode.TRANSFER_FAILED, "bad chunk", "CHECKSUM_MISMATCH")
    run.apply(lambda f, t, fl: f.on_output(generation, output(generation, finished=True, error=error), t, fl))
    first_token(run)
    assert "retry transfer (the early reservation was lost: CHECKSUM_MISMATCH: bad chunk)" in run.flow.timeline.entries[-1].detail
