"""Riding out the loss of the only instance of a role (RecoveryAction.WAIT_FOR_INSTANCE).

With one PREFILL and one GENERATION instance, the death of either leaves no recovery action but
waiting: the request goes back to QUEUED (visibly, in its timeline), its stage timers pause, and
once an instance is healthy again it is placed anew with the tokens it already streamed (the hops
recompute prompt + those tokens and stream only what follows). The wait is bounded by max_wait_s
and by the request's deadline. New requests admitted during the outage queue instead of failing.
"""

from __future__ import annotations

from cluster.router.actions import Finish, NoteRecovery, Phase, StartHop, StopHop
from cluster.router.api import ErrorKind, Outcome
from cluster.router.config import RecoveryAction
from cluster.router.state import GlobalState
from tests.unit.test_router_flow import config, fleet_of, new_run, output, set_health, to_state
from worker.protocol import InstanceRole

S = GlobalState
MAX_WAIT_S = 20.0
CHAIN = [
    {"action": "retry_transfer"},
    {"action": "reprefill_elsewhere"},
    {"action": "recompute_local"},
    {"action": "wait_for_instance", "max_wait_s": MAX_WAIT_S, "max_attempts": 2},
    {"action": "fail"},
]


def pair():
    cfg = config(CHAIN)
    return fleet_of(("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION), cfg=cfg), cfg


def generating_on_the_only_generation_instance():
    fleet, cfg = pair()
    run = to_state(S.GENERATING, fleet=fleet, cfg=cfg)
    generation = run.hop(Phase.GENERATION)
    run.apply(lambda f, t, fl: f.on_output(generation, output(generation, (6, 7)), t, fl))
    assert run.flow.outputs == [5, 6, 7]
    return run, generation


def test_the_only_generation_instance_dies_the_request_waits_then_resumes_with_its_tokens() -> None:
    run, generation = generating_on_the_only_generation_instance()
    set_health(run.fleet, "g0", False)
    out = run.apply(lambda f, t, fl: f.on_instance_dead(generation, "instance g0 died", t, fl))
    assert [a.action for a in out if isinstance(a, NoteRecovery)] == [RecoveryAction.WAIT_FOR_INSTANCE]
    assert not [a for a in out if isinstance(a, (StartHop, Finish))]
    assert run.flow.state is S.QUEUED and "waiting up to 20s" in run.flow.timeline.entries[-1].detail
    # Stage timers pause: far past every stage timeout, within the wait's bound, nothing happens.
    assert run.apply(lambda f, t, fl: f.on_tick(t + MAX_WAIT_S / 2, fl)) == []
    set_health(run.fleet, "g0", True)  # Ray restarted it
    resumed = run.apply(lambda f, t, fl: f.on_tick(t + MAX_WAIT_S / 2 + 1, fl))
    (start,) = [a for a in resumed if isinstance(a, StartHop)]
    assert start.phase is Phase.PREFILL and start.output_token_ids == (5, 6, 7), "recompute what was streamed"
    assert run.flow.state is S.CONTEXT_WAIT and "after waiting" in run.flow.timeline.entries[-1].detail
    assert not run.flow.ended


def test_a_wait_is_bounded_by_max_wait_s() -> None:
    run, generation = generating_on_the_only_generation_instance()
    set_health(run.fleet, "g0", False)
    run.apply(lambda f, t, fl: f.on_instance_dead(generation, "instance g0 died", t, fl))
    out = run.apply(lambda f, t, fl: f.on_tick(t + MAX_WAIT_S + 0.1, fl))
    assert run.flow.ended and run.flow.final.outcome is Outcome.ERROR
    assert run.flow.final.error_kind is ErrorKind.UNAVAILABLE and "no healthy instance within" in run.flow.final.error_message
    assert isinstance(out[-1], Finish)


def test_a_wait_is_bounded_by_the_request_deadline() -> None:
    fleet, cfg = pair()
    run = new_run(fleet, cfg, deadline_s=5.0)
    set_health(fleet, "g0", False)
    run.apply(lambda f, t, fl: f.admit(t, fl))
    assert not run.flow.ended and run.flow.state is S.QUEUED
    run.apply(lambda f, t, fl: f.on_tick(6.0, fl))
    assert run.flow.final.outcome is Outcome.ABORTED and run.flow.final.error_kind is ErrorKind.DEADLINE_EXCEEDED


def test_a_request_admitted_during_an_outage_queues_then_runs() -> None:
    fleet, cfg = pair()
    set_health(fleet, "p0", False)
    run = new_run(fleet, cfg)
    assert run.apply(lambda f, t, fl: f.admit(t, fl)) == []
    assert run.flow.state is S.QUEUED and not run.flow.ended
    assert run.apply(lambda f, t, fl: f.on_tick(t + 1, fl)) == []
    set_health(fleet, "p0", True)
    (start,) = [a for a in run.apply(lambda f, t, fl: f.on_tick(t + 2, fl)) if isinstance(a, StartHop)]
    assert start.phase is Phase.PREFILL and start.output_token_ids == ()
    assert run.flow.state is S.CONTEXT_WAIT


def test_the_only_prefill_instance_dies_in_flight_requests_recompute_on_the_generation_instance() -> None:
    """Waiting is the last resort: with a healthy GENERATION instance, a request whose prefill died
    recomputes there at once."""
    fleet, cfg = pair()
    run = to_state(S.CONTEXT_IN_PROGRESS, fleet=fleet, cfg=cfg)
    prefill = run.hop(Phase.PREFILL)
    set_health(fleet, "p0", False)
    out = run.apply(lambda f, t, fl: f.on_instance_dead(prefill, "instance p0 died", t, fl))
    assert [a.action for a in out if isinstance(a, NoteRecovery)] == [RecoveryAction.RECOMPUTE_LOCAL]
    assert run.flow.generation.phase is Phase.COLOCATED


def test_a_role_never_deployed_is_no_outage_and_fails_at_once() -> None:
    cfg = config(CHAIN)
    fleet = fleet_of(("g0", InstanceRole.GENERATION), cfg=cfg)  # disaggregation always, no PREFILL at all
    run = new_run(fleet, cfg)
    run.apply(lambda f, t, fl: f.admit(t, fl))
    assert run.flow.final.outcome is Outcome.ERROR and run.flow.final.error_kind is ErrorKind.UNAVAILABLE


def test_waiting_stops_every_hop_it_gives_up() -> None:
    fleet, cfg = pair()
    run = to_state(S.TRANSMISSION, fleet=fleet, cfg=cfg)
    prefill, generation = run.hop(Phase.PREFILL), run.hop(Phase.GENERATION)
    set_health(fleet, "g0", False)
    set_health(fleet, "p0", False)
    out = run.apply(lambda f, t, fl: f.on_instance_dead(generation, "instance g0 died", t, fl))
    assert {a.engine_id for a in out if isinstance(a, StopHop)} == {prefill.engine_id}
    assert run.flow.state is S.QUEUED


def test_two_failed_polls_in_a_row_confirm_a_death_a_late_one_does_not() -> None:
    """A poll that fails with an error (Ray: the actor is unavailable) is a suspicion, a second in a
    row confirms it; polls that are merely late count only toward dead_after_s (a loaded machine)."""
    fleet, _ = pair()
    member = fleet.members["g0"]
    assert not fleet.silent(member, 0.1, "late", late=True)
    assert not fleet.silent(member, 0.2, "late", late=True)
    assert not fleet.silent(member, 0.3, "ActorUnavailableError", late=False)
    fleet.answered(member, 0.4)  # an answer clears the suspicion
    assert not fleet.silent(member, 0.5, "ActorUnavailableError", late=False)
    assert fleet.silent(member, 0.6, "ActorUnavailableError", late=False)
    other = fleet.members["p0"]
    assert fleet.silent(other, 5.0, "late", late=True), "silence for dead_after_s still kills"
