"""The request flow alone (cluster/router/flow.py): no engines, no event loop, no driver.

Table-driven: a request is scripted into every global state it can be in, then every event is
applied to it; each case checks that the flow never attempts an illegal transition, ends a request
at most once, retires every hop it gives up with a stop (a prefill hop holding KV released first),
starts no hop for an ended request, and lands in the state the table says. Recovery actions are
checked with their attempt counts, and aborts in every state. The fleet is the real one
(cluster/router/fleet.py) over registered instances whose health the cases set.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from cluster.router.actions import (
    EmitTokens,
    Finish,
    NoteRecovery,
    NoteTransfer,
    Phase,
    Push,
    StartHop,
    StopHop,
)
from cluster.router.api import ErrorKind, InstanceHealthView, Outcome
from cluster.router.config import RecoveryAction, RouterConfig
from cluster.router.fleet import Fleet
from cluster.router.flow import Attempt, RequestFlow
from cluster.router.state import GlobalState, Route
from scheduler.state import LlmRequestState
from worker.kv_layout import KvLayout
from worker.protocol import (
    ErrorCode,
    InstanceInfo,
    InstanceRole,
    PushResult,
    RequestError,
    RequestOutput,
    ReservationNotice,
)
from worker.sampling import SamplingParams
from worker.stopping import FinishReason

S = GlobalState
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32", model_fingerprint="flow")
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, seed=7, ignore_eos=True)
TIMEOUTS = {"context_s": 30.0, "reservation_s": 10.0, "transfer_s": 10.0, "generation_s": 60.0}
CHAIN = [
    {"action": "retry_transfer", "max_attempts": 1},
    {"action": "reprefill_elsewhere", "max_attempts": 1},
    {"action": "recompute_local", "max_attempts": 1},
    {"action": "fail"},
]


def config(chain=CHAIN, reserve="at_context_done", **placement) -> RouterConfig:
    """The table below scripts the hand-over as it runs when the generation instance reserves at
    context done; early reservations have their own tests (test_router_early_reservation.py)."""
    return RouterConfig.from_dict(
        {
            "handover": {"reserve": reserve},
            "recovery": {"chain": chain},
            "timeouts": TIMEOUTS,
            "health": {"heartbeat_interval_s": 0.1, "dead_after_s": 5.0},
            "placement": {"prefill_policy": {"name": "round_robin"}, "generation_policy": {"name": "round_robin"}, **placement},
        }
    )


def fleet_of(*members: tuple[str, InstanceRole], cfg: RouterConfig | None = None) -> Fleet:
    fleet = Fleet((cfg or config()).placement, random.Random(1), dead_after_s=5.0)
    for port, (name, role) in enumerate(members, start=1):
        info = InstanceInfo(name, role, "inc", f"127.0.0.1:{port}", LAYOUT, 64, 264, 4096, 0, "cpu")
        fleet.register(None, info, 0.0, 0.0)  # type: ignore[arg-type] - the flow never calls a client
    return fleet


def set_health(fleet: Fleet, instance_id: str, healthy: bool) -> None:
    member = fleet.members[instance_id]
    member.health = InstanceHealthView.HEALTHY if healthy else InstanceHealthView.UNHEALTHY
    fleet.invalidate(member)  # placement rebuilds its candidate


@dataclass
class Run:
    """A flow, its fleet, and every action it returned so far (the invariants are checked on all)."""

    flow: RequestFlow
    fleet: Fleet
    now: float = 0.0
    actions: list = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.actions = []

    def apply(self, step: Callable[[RequestFlow, float, Fleet], list]) -> list:
        self.now += 0.01
        before = {a.engine_id: a.live for a in self.flow.hops()}
        ended_before = self.flow.ended
        out = step(self.flow, self.now, self.fleet)
        check_invariants(self.flow, out, before, ended_before)
        self.actions.extend(out)
        return out

    def hop(self, phase: Phase) -> Attempt:
        hop = self.flow.prefill if phase is Phase.PREFILL else self.flow.generation
        assert hop is not None and hop.phase is phase, (phase, self.flow.hops())
        return hop


def check_invariants(flow: RequestFlow, actions: list, live_before: dict[str, bool], ended_before: bool) -> None:
    finishes = [a for a in actions if isinstance(a, Finish)]
    assert len(finishes) <= 1
    if ended_before:
        assert not any(isinstance(a, (StartHop, Finish, Push, EmitTokens)) for a in actions), actions
    if finishes:
        assert flow.ended and actions[-1] is finishes[0], "the final event comes last, after the stops"
        assert not any(isinstance(a, StartHop) for a in actions), "a hop started by an ending event"
    stopped = {a.engine_id: a for a in actions if isinstance(a, StopHop)}
    for hop in flow.hops():
        if hop.engine_id in stopped:
            assert not hop.live
            assert stopped[hop.engine_id].release == (hop.phase is Phase.PREFILL and hop.context_done)
    starts = [a for a in actions if isinstance(a, StartHop)]
    # One hop starts per event, except a disaggregated admission that reserves at once: its prefill
    # hop and its early generation hop.
    phases = [start.phase for start in starts]
    assert len(starts) <= 1 or (
        phases == [Phase.PREFILL, Phase.GENERATION] and starts[1].token_with_kv
    ), starts
    for start in starts:
        assert not flow.ended
        assert any(h.engine_id == start.engine_id and h.live for h in flow.hops())
        # A new hop of a phase comes after the stop of the hop it replaces (same list).
    assert len({h.engine_id for h in flow.hops() if h.live}) <= 2


def new_run(fleet: Fleet, cfg: RouterConfig | None = None, deadline_s: float | None = None) -> Run:
    flow = RequestFlow(
        request_id="r",
        client_request_id="r",
        prompt_token_ids=(256, 1, 2, 3),
        params=PARAMS,
        priority=0.5,
        block_hashes=(),
        deadline_s=deadline_s,
        now_s=0.0,
        config=cfg or config(),
    )
    return Run(flow, fleet)


# ---- scripting a request into each state ---------------------------------------------------------


def output(hop: Attempt, tokens=(), **kwargs) -> RequestOutput:
    return RequestOutput(hop.engine_id, tuple(tokens), "", **kwargs)


def to_state(state: GlobalState, route: Route = Route.DISAGGREGATED, fleet: Fleet | None = None, cfg=None) -> Run:
    """A request in `state` on `route` (1 PREFILL + 1 GENERATION, or 1 MIXED for colocated)."""
    if route is Route.COLOCATED:
        cfg = cfg or config(disaggregation="never")
    if fleet is None:
        fleet = fleet_of(
            ("p0", InstanceRole.PREFILL), ("p1", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION), ("g1", InstanceRole.GENERATION), cfg=cfg
        )
    run = new_run(fleet, cfg)
    if state is S.QUEUED:
        return run
    run.apply(lambda f, t, fl: f.admit(t, fl))
    assert run.flow.timeline.route is route
    if state is S.CONTEXT_WAIT:
        return run
    if route is Route.COLOCATED:
        hop = run.hop(Phase.COLOCATED)
        run.apply(lambda f, t, fl: f.on_state(hop, InstanceRole.GENERATION, LlmRequestState.CONTEXT_INIT, "prefill started", t, fl))
        if state is S.CONTEXT_IN_PROGRESS:
            return run
        run.apply(lambda f, t, fl: f.on_output(hop, output(hop, (5,)), t, fl))
        assert state is S.GENERATING
        return run
    prefill = run.hop(Phase.PREFILL)
    run.apply(lambda f, t, fl: f.on_state(prefill, InstanceRole.PREFILL, LlmRequestState.CONTEXT_INIT, "prefill started", t, fl))
    if state is S.CONTEXT_IN_PROGRESS:
        return run
    run.apply(lambda f, t, fl: f.on_output(prefill, output(prefill, (5,), context_done=True), t, fl))
    if state is S.GENERATION_INIT:
        return run
    generation = run.hop(Phase.GENERATION)
    run.apply(lambda f, t, fl: f.on_reservation(generation, ReservationNotice(generation.engine_id, "t" * 24, 1, 1e12), t, fl))
    if state is S.TRANSMISSION:
        return run
    run.apply(lambda f, t, fl: f.on_state(generation, InstanceRole.GENERATION, LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE, "", t, fl))
    assert state is S.GENERATING
    return run


STATES = [
    (S.QUEUED, Route.DISAGGREGATED),
    (S.CONTEXT_WAIT, Route.DISAGGREGATED),
    (S.CONTEXT_IN_PROGRESS, Route.DISAGGREGATED),
    (S.GENERATION_INIT, Route.DISAGGREGATED),
    (S.TRANSMISSION, Route.DISAGGREGATED),
    (S.GENERATING, Route.DISAGGREGATED),
    (S.CONTEXT_WAIT, Route.COLOCATED),
    (S.CONTEXT_IN_PROGRESS, Route.COLOCATED),
    (S.GENERATING, Route.COLOCATED),
]
STATE_IDS = [f"{s.name}-{r.name}" for s, r in STATES]


def test_the_scripted_paths_reach_every_state() -> None:
    for state, route in STATES:
        run = to_state(state, route)
        assert run.flow.state is state
        if state is not S.QUEUED:
            assert run.flow.timeline.route is route
        assert not [a for a in run.actions if isinstance(a, StopHop)], "the happy path stops nothing"


# ---- every state x every event -------------------------------------------------------------------


def current(run: Run) -> Attempt | None:
    """The hop of the request's current stage: its live generation (or colocated) hop, else its
    live prefill hop."""
    for hop in (run.flow.generation, run.flow.prefill):
        if hop is not None and hop.live:
            return hop
    return run.flow.generation or run.flow.prefill


def _abort(run):
    return lambda f, t, fl: f.abort(t, None, "aborted by the client")


def _deadline(run):
    run.flow.deadline_s = run.now
    return lambda f, t, fl: f.on_tick(t, fl)


def _stage_timeout(run):
    return lambda f, t, fl: f.on_tick(t + 1000.0, fl)


def _hop_error(run, code=ErrorCode.TRANSFER_FAILED):
    hop = current(run)
    return lambda f, t, fl: f.on_output(hop, output(hop, finished=True, error=RequestError(code, "x", "CHECKSUM_MISMATCH")), t, fl)


def _hop_done(run):
    hop = current(run)
    return lambda f, t, fl: f.on_output(hop, output(hop, (9,), finished=True, finish_reason=FinishReason.LENGTH), t, fl)


def _submit_unavailable(run):
    hop = current(run)
    return lambda f, t, fl: f.on_submit_failed(hop, t, fl, unavailable="gone")


def _submit_rejected(run):
    hop = current(run)
    return lambda f, t, fl: f.on_submit_failed(hop, t, fl, rejected=("prompt", "too long"))


def _instance_dead(run):
    hop = current(run)
    return lambda f, t, fl: f.on_instance_dead(hop, f"instance {hop.instance_id} died", t, fl)


def _push_failed(run):
    prefill = run.flow.prefill
    transfer = run.flow.generation.transfer_id if run.flow.generation else None
    if prefill is None:
        return lambda f, t, fl: []
    push = PushResult(prefill.engine_id, transfer or "none", False, "PEER_UNAVAILABLE", "x", 0, 0.0)
    return lambda f, t, fl: f.on_push_result(prefill, push, t, fl)


def _prefill_lost(run):
    prefill = run.flow.prefill
    if prefill is None:
        return lambda f, t, fl: []
    error = RequestError(ErrorCode.LEASE_EXPIRED, "gone")
    return lambda f, t, fl: f.on_output(prefill, output(prefill, finished=True, error=error), t, fl)


EVENTS = {
    "client abort": _abort,
    "deadline": _deadline,
    "stage timeout": _stage_timeout,
    "hop failed": _hop_error,
    "hop aborted by its instance": lambda run: _hop_error(run, ErrorCode.ABORTED),
    "hop finished": _hop_done,
    "submit unavailable": _submit_unavailable,
    "submit rejected": _submit_rejected,
    "instance died": _instance_dead,
    "push failed": _push_failed,
    "prefill KV lost": _prefill_lost,
}

# What each event leads to, by state: a state, or "ended:<OUTCOME>". Absent: the state is kept.
END_ABORTED, END_ERROR, END_COMPLETE = "ended:ABORTED", "ended:ERROR", "ended:COMPLETE"
EXPECTED: dict[tuple[str, GlobalState, Route], object] = {}
for _state, _route in STATES:
    if _state is S.QUEUED:
        continue
    EXPECTED[("client abort", _state, _route)] = END_ABORTED
    EXPECTED[("deadline", _state, _route)] = END_ABORTED
    EXPECTED[("submit rejected", _state, _route)] = END_ERROR
    EXPECTED[("hop finished", _state, _route)] = END_COMPLETE
D, C = Route.DISAGGREGATED, Route.COLOCATED
EXPECTED.update(
    {
        # A failed transfer with the prefill KV held: retry it (back to GENERATION_INIT).
        ("hop failed", S.GENERATION_INIT, D): S.GENERATION_INIT,
        ("hop failed", S.TRANSMISSION, D): S.GENERATION_INIT,
        ("push failed", S.TRANSMISSION, D): S.GENERATION_INIT,
        # A failure without KV to retry from: re-run the prefill on the other PREFILL instance.
        ("hop failed", S.CONTEXT_WAIT, D): S.CONTEXT_WAIT,
        ("hop failed", S.CONTEXT_IN_PROGRESS, D): S.CONTEXT_WAIT,
        ("hop failed", S.GENERATING, D): S.CONTEXT_WAIT,
        ("prefill KV lost", S.CONTEXT_IN_PROGRESS, D): S.CONTEXT_WAIT,
        ("prefill KV lost", S.GENERATION_INIT, D): S.CONTEXT_WAIT,
        ("prefill KV lost", S.TRANSMISSION, D): S.CONTEXT_WAIT,
        ("submit unavailable", S.CONTEXT_WAIT, D): S.CONTEXT_WAIT,
        ("submit unavailable", S.CONTEXT_IN_PROGRESS, D): S.CONTEXT_WAIT,
        ("submit unavailable", S.GENERATING, D): S.CONTEXT_WAIT,
        ("instance died", S.CONTEXT_WAIT, D): S.CONTEXT_WAIT,
        ("instance died", S.CONTEXT_IN_PROGRESS, D): S.CONTEXT_WAIT,
        ("instance died", S.GENERATING, D): S.CONTEXT_WAIT,
        # The generation hop's instance is gone but the prefill KV is held: retry the transfer.
        ("submit unavailable", S.GENERATION_INIT, D): S.GENERATION_INIT,
        ("submit unavailable", S.TRANSMISSION, D): S.GENERATION_INIT,
        ("instance died", S.GENERATION_INIT, D): S.GENERATION_INIT,
        ("instance died", S.TRANSMISSION, D): S.GENERATION_INIT,
        # A stage timeout stops the hop and recovers like its failure.
        ("stage timeout", S.CONTEXT_WAIT, D): S.CONTEXT_WAIT,
        ("stage timeout", S.CONTEXT_IN_PROGRESS, D): S.CONTEXT_WAIT,
        ("stage timeout", S.GENERATION_INIT, D): S.GENERATION_INIT,
        ("stage timeout", S.TRANSMISSION, D): S.GENERATION_INIT,
        ("stage timeout", S.GENERATING, D): S.CONTEXT_WAIT,
        # Colocated: nothing to retry a transfer from, no route back to the prefill: the chain's
        # re-run (colocated only when no PREFILL is needed) or recompute.
        ("hop failed", S.CONTEXT_WAIT, C): S.CONTEXT_WAIT,
        ("hop failed", S.CONTEXT_IN_PROGRESS, C): S.CONTEXT_WAIT,
        ("hop failed", S.GENERATING, C): S.CONTEXT_WAIT,
        ("submit unavailable", S.CONTEXT_WAIT, C): S.CONTEXT_WAIT,
        ("submit unavailable", S.CONTEXT_IN_PROGRESS, C): S.CONTEXT_WAIT,
        ("submit unavailable", S.GENERATING, C): S.CONTEXT_WAIT,
        ("instance died", S.CONTEXT_WAIT, C): S.CONTEXT_WAIT,
        ("instance died", S.CONTEXT_IN_PROGRESS, C): S.CONTEXT_WAIT,
        ("instance died", S.GENERATING, C): S.CONTEXT_WAIT,
        ("stage timeout", S.CONTEXT_WAIT, C): S.CONTEXT_WAIT,
        ("stage timeout", S.CONTEXT_IN_PROGRESS, C): S.CONTEXT_WAIT,
        ("stage timeout", S.GENERATING, C): S.CONTEXT_WAIT,
    }
)
# Kept: the push of a transfer already committed (GENERATING) failing frees the sender's copy only,
# and so does the prefill hop ending then; a hop aborted by its instance was stopped by the router.
# A generation hop finishing before its KV commit is impossible: noted, not an end (below).
for _state in (S.GENERATION_INIT, S.TRANSMISSION):
    EXPECTED[("hop finished", _state, D)] = _state


@pytest.mark.parametrize("event", sorted(EVENTS))
@pytest.mark.parametrize(("state", "route"), STATES, ids=STATE_IDS)
def test_every_event_in_every_state(state: GlobalState, route: Route, event: str) -> None:
    run = to_state(state, route)
    if state is S.QUEUED:
        return  # a queued request has no hop yet; admission is the only event (test below)
    live_before = [h.engine_id for h in run.flow.hops() if h.live]
    out = run.apply(EVENTS[event](run))
    expected = EXPECTED.get((event, state, route), state)
    if isinstance(expected, str):
        assert run.flow.ended and run.flow.final.outcome.name == expected.split(":")[1], (run.flow.state, out)
        # Every hop that was live is stopped, except a completed request's handed-over prefill.
        stopped = {a.engine_id for a in out if isinstance(a, StopHop)}
        finished_hop = current(run).engine_id if event in ("hop finished",) else None
        for engine_id in live_before:
            if engine_id == finished_hop:
                continue
            if event == "submit rejected" and engine_id == current(run).engine_id:
                continue  # the instance refused it: it holds nothing
            assert engine_id in stopped, (engine_id, out)
    else:
        assert not run.flow.ended, run.flow.final
        assert run.flow.state is expected, (run.flow.timeline.entries, out)
    if event == "push failed" and state is S.GENERATING and route is D:
        assert [a for a in out if isinstance(a, StopHop)] == [StopHop("r.p1", "p0", True, "KV already committed by the receiver")]


def test_admission_places_and_starts_one_hop() -> None:
    run = to_state(S.QUEUED)
    out = run.apply(lambda f, t, fl: f.admit(t, fl))
    assert run.flow.state is S.CONTEXT_WAIT and run.flow.timeline.route is D
    assert [type(a) for a in out] == [StartHop] and out[0].phase is Phase.PREFILL and out[0].engine_id == "r.p1"


def test_admission_without_any_healthy_instance_fails_unavailable() -> None:
    fleet = fleet_of(("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION))
    set_health(fleet, "g0", False)
    run = new_run(fleet)
    out = run.apply(lambda f, t, fl: f.admit(t, fl))
    assert run.flow.final.outcome is Outcome.ERROR and run.flow.final.error_kind is ErrorKind.UNAVAILABLE
    assert [type(a) for a in out] == [Finish]


# ---- the hand-over -------------------------------------------------------------------------------


def test_the_hand_over_actions_in_order() -> None:
    run = to_state(S.GENERATING)
    kinds = [type(a).__name__ for a in run.actions]
    assert kinds == ["StartHop", "EmitTokens", "StartHop", "NoteTransfer", "Push", "NoteTransfer"]
    push = next(a for a in run.actions if isinstance(a, Push))
    assert (push.instance_id, push.engine_id, push.target_instance_id, push.target_engine_id) == ("p0", "r.p1", "g0", "r.g1")
    assert [a.note.value for a in run.actions if isinstance(a, NoteTransfer)] == ["started", "committed"]
    assert [s.state for s in run.flow.timeline.entries] == [
        S.QUEUED, S.CONTEXT_WAIT, S.CONTEXT_IN_PROGRESS, S.GENERATION_INIT, S.TRANSMISSION, S.GENERATING,
    ]


def test_a_completed_request_does_not_stop_its_handed_over_prefill() -> None:
    run = to_state(S.GENERATING)
    prefill = run.hop(Phase.PREFILL)
    run.apply(lambda f, t, fl: f.on_output(prefill, output(prefill, finished=True, handed_over=True), t, fl))
    out = run.apply(_hop_done(run))
    assert run.flow.final.outcome is Outcome.COMPLETE
    assert not [a for a in out if isinstance(a, StopHop)]


def test_the_first_token_is_the_last() -> None:
    run = to_state(S.CONTEXT_IN_PROGRESS)
    prefill = run.hop(Phase.PREFILL)
    out = run.apply(lambda f, t, fl: f.on_output(prefill, output(prefill, (5,), finished=True, finish_reason=FinishReason.STOP), t, fl))
    assert run.flow.final.outcome is Outcome.COMPLETE and run.flow.state is S.COMPLETE
    assert [type(a) for a in out] == [EmitTokens, Finish]


def test_reports_of_a_retired_hop_are_ignored() -> None:
    run = to_state(S.TRANSMISSION)
    old = run.hop(Phase.GENERATION)
    run.apply(_hop_error(run))  # retry: r.g2
    assert run.hop(Phase.GENERATION).engine_id == "r.g2"
    for late in (
        lambda f, t, fl: f.on_output(old, output(old, (1,), finished=True, finish_reason=FinishReason.LENGTH), t, fl),
        lambda f, t, fl: f.on_state(old, InstanceRole.GENERATION, LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE, "", t, fl),
        lambda f, t, fl: f.on_reservation(old, ReservationNotice(old.engine_id, "u" * 24, 1, 1e12), t, fl),
    ):
        assert run.apply(late) == []
    assert run.flow.state is S.GENERATION_INIT and not run.flow.ended


def test_an_inconsistent_report_is_noted() -> None:
    run = to_state(S.CONTEXT_WAIT)
    prefill = run.hop(Phase.PREFILL)
    out = run.apply(lambda f, t, fl: f.on_state(prefill, InstanceRole.PREFILL, LlmRequestState.GENERATION_IN_PROGRESS, "", t, fl))
    assert [type(a).__name__ for a in out] == ["NoteInconsistent"]


# ---- recovery: the chain with its attempts ------------------------------------------------------


def recoveries(run: Run) -> list[RecoveryAction]:
    return [a.action for a in run.actions if isinstance(a, NoteRecovery)]


def test_the_chain_in_order_with_its_attempts() -> None:
    """Transfer failures in a row walk the chain: one retry (KV held), then a prefill re-run
    elsewhere, then a local recompute, then FAIL, each counted once."""
    run = to_state(S.TRANSMISSION)
    run.apply(_hop_error(run))
    assert recoveries(run) == [RecoveryAction.RETRY_TRANSFER] and run.flow.state is S.GENERATION_INIT
    assert run.hop(Phase.GENERATION).engine_id == "r.g2"
    run.apply(_hop_error(run))
    assert recoveries(run)[-1] is RecoveryAction.REPREFILL_ELSEWHERE
    assert run.flow.state is S.CONTEXT_WAIT and run.hop(Phase.PREFILL).instance_id == "p1"
    assert run.hop(Phase.PREFILL).engine_id == "r.p2"
    run.apply(_submit_unavailable(run))
    assert recoveries(run)[-1] is RecoveryAction.RECOMPUTE_LOCAL
    assert run.flow.generation.phase is Phase.COLOCATED and run.flow.generation.recompute
    assert run.flow.timeline.route is C
    run.apply(_hop_error(run))
    assert recoveries(run)[-1] is RecoveryAction.FAIL
    assert run.flow.final.outcome is Outcome.ERROR and "recovery exhausted" in run.flow.final.error_message
    assert dict(run.flow.recovery) == {a: 1 for a in RecoveryAction if a is not RecoveryAction.WAIT_FOR_INSTANCE}


@pytest.mark.parametrize("max_attempts", [1, 2, 3])
def test_retry_transfer_is_tried_max_attempts_times(max_attempts: int) -> None:
    chain = [{"action": "retry_transfer", "max_attempts": max_attempts}, {"action": "fail"}]
    run = to_state(S.TRANSMISSION, cfg=config(chain))
    for attempt in range(max_attempts):
        run.apply(_hop_error(run))
        assert run.flow.state is S.GENERATION_INIT and run.hop(Phase.GENERATION).number == attempt + 2
    run.apply(_hop_error(run))
    assert run.flow.final.outcome is Outcome.ERROR
    assert recoveries(run) == [RecoveryAction.RETRY_TRANSFER] * max_attempts + [RecoveryAction.FAIL]


def test_retry_transfer_is_skipped_once_the_prefill_kv_is_gone() -> None:
    run = to_state(S.TRANSMISSION)
    run.apply(_prefill_lost(run))
    assert recoveries(run) == [RecoveryAction.REPREFILL_ELSEWHERE]


def test_reprefill_elsewhere_needs_another_prefill_instance() -> None:
    fleet = fleet_of(("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION))
    run = to_state(S.CONTEXT_IN_PROGRESS, fleet=fleet)
    run.apply(_hop_error(run))
    assert recoveries(run) == [RecoveryAction.RECOMPUTE_LOCAL]
    assert run.flow.state is S.CONTEXT_WAIT and run.flow.timeline.route is C


def test_recompute_local_from_the_hand_over_keeps_generating() -> None:
    chain = [{"action": "recompute_local"}, {"action": "fail"}]
    run = to_state(S.TRANSMISSION, cfg=config(chain))
    out = run.apply(_hop_error(run))
    assert run.flow.state is S.GENERATING and run.flow.timeline.route is C
    start = next(a for a in out if isinstance(a, StartHop))
    # The tokens already streamed travel with the recompute hop.
    assert (start.engine_id, start.instance_id, start.output_token_ids) == ("r.c1", "g0", (5,))
    stops = [a for a in out if isinstance(a, StopHop)]
    # The failed generation hop ended on its own: only the prefill's KV is left to free.
    assert [(s.engine_id, s.release) for s in stops] == [("r.p1", True)]
    assert out.index(stops[-1]) < out.index(start)


def test_a_suspected_instance_is_not_chosen_again() -> None:
    fleet = fleet_of(("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION), ("g1", InstanceRole.GENERATION))
    run = to_state(S.GENERATION_INIT, fleet=fleet)
    failed_on = run.hop(Phase.GENERATION).instance_id
    run.apply(_submit_unavailable(run))
    assert run.hop(Phase.GENERATION).instance_id != failed_on


def test_no_healthy_generation_instance_fails_the_request() -> None:
    fleet = fleet_of(("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION))
    run = to_state(S.GENERATION_INIT, fleet=fleet)
    set_health(fleet, "g0", False)
    run.apply(_hop_error(run))
    assert recoveries(run) == [RecoveryAction.FAIL] and run.flow.final.error_kind is ErrorKind.UNAVAILABLE


# ---- aborts in every state -----------------------------------------------------------------------


@pytest.mark.parametrize(("state", "route"), STATES[1:], ids=STATE_IDS[1:])
def test_an_abort_stops_every_live_hop_then_finishes(state: GlobalState, route: Route) -> None:
    run = to_state(state, route)
    live = [(h.engine_id, h.phase is Phase.PREFILL and h.context_done) for h in run.flow.hops() if h.live]
    out = run.apply(_abort(run))
    assert [(a.engine_id, a.release) for a in out if isinstance(a, StopHop)] == live
    assert isinstance(out[-1], Finish) and out[-1].final.finish_reason == "abort" and out[-1].final.error_kind is None
    assert run.flow.state is S.ABORTED
    # Anything after the end changes nothing.
    assert run.apply(_abort(run)) == []
    assert run.apply(lambda f, t, fl: f.on_tick(t + 1e6, fl)) == []


def test_a_small_transfer_that_stalls_is_retried_at_the_speed_of_its_size() -> None:
    """TRANSMISSION's bound is handover.stall_base_s + bytes / stall_min_bytes_per_s (at most
    timeouts.transfer_s): one block of KV stalled is retried after about two seconds (the default
    base), not after the 10 s transfer deadline."""
    run = to_state(S.TRANSMISSION)
    generation = run.hop(Phase.GENERATION)
    assert generation.reserved_bytes == LAYOUT.run_bytes(LAYOUT.num_layers, 1)
    bound_s = 2.0 + generation.reserved_bytes / 50e6
    entered = run.now
    assert run.apply(lambda f, t, fl: f.on_tick(entered + bound_s - 0.01, fl)) == []
    out = run.apply(lambda f, t, fl: f.on_tick(entered + bound_s + 0.001, fl))
    assert recoveries(run) == [RecoveryAction.RETRY_TRANSFER], out
    assert run.flow.state is S.GENERATION_INIT
    # The push is held to the same bound: a stalled one gives up when the router does, and the
    # prefill's blocks it pins are free then, not after the 10 s transfer deadline.
    pushes = [a for a in run.actions if isinstance(a, Push)]
    assert len(pushes) == 1 and pushes[0].deadline_s == pytest.approx(bound_s)
    # A large transfer keeps the configured deadline as its cap.
    big = to_state(S.TRANSMISSION)
    big.hop(Phase.GENERATION).reserved_bytes = 10**12
    assert big.apply(lambda f, t, fl: f.on_tick(big.now + TIMEOUTS["transfer_s"] - 0.1, fl)) == []


def test_a_hand_overs_target_is_chosen_as_a_receiver_of_kv_and_a_recompute_as_computing_the_prompt() -> None:
    """kv_aware counts a cached prefix only where the prompt is computed (cluster/router/placement.py
    Placer.choose_generation): the flow says which a hop alone is."""
    chosen: list[tuple[str, bool]] = []

    def recording(fleet: Fleet) -> Fleet:
        choose = fleet.choose_generation

        def choose_generation(request, exclude, *, receives_kv):
            instance_id = choose(request, exclude, receives_kv=receives_kv)
            chosen.append((instance_id, receives_kv))
            return instance_id

        fleet.choose_generation = choose_generation  # type: ignore[method-assign]
        return fleet

    members = (("p0", InstanceRole.PREFILL), ("p1", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION), ("g1", InstanceRole.GENERATION))
    # A retried transfer: a new receiver of the prefill instance's KV.
    run = to_state(S.TRANSMISSION, fleet=recording(fleet_of(*members)))
    run.apply(_hop_error(run))
    assert recoveries(run) == [RecoveryAction.RETRY_TRANSFER] and chosen == [("g1", True)]
    # The planned receiver unhealthy when the context is done: another receiver.
    chosen.clear()
    run = to_state(S.CONTEXT_IN_PROGRESS, fleet=recording(fleet_of(*members)))
    planned = run.flow.planned_generation
    set_health(run.fleet, planned, False)
    prefill = run.hop(Phase.PREFILL)
    run.apply(lambda f, t, fl: f.on_output(prefill, output(prefill, (5,), context_done=True), t, fl))
    assert chosen == [("g1" if planned == "g0" else "g0", True)]
    # A local recompute placed anew (no generation instance to recompute on): it computes the prompt.
    chosen.clear()
    chain = [{"action": "recompute_local"}, {"action": "fail"}]
    fleet = recording(fleet_of(("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION), ("g1", InstanceRole.GENERATION), cfg=config(chain)))
    run = to_state(S.CONTEXT_IN_PROGRESS, fleet=fleet, cfg=config(chain))
    run.apply(_hop_error(run))
    assert recoveries(run) == [RecoveryAction.RECOMPUTE_LOCAL]
    assert [receives_kv for _, receives_kv in chosen] == [False]
