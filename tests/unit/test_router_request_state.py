"""The global request state machine: table, timeline, and the mapping from local instance states."""

from __future__ import annotations

from collections import deque

import pytest

from cluster.router.state import (
    LOCAL_STATE_NAMES,
    TERMINAL_STATES,
    TRANSITIONS,
    GlobalState,
    IllegalTransition,
    Node,
    RequestTimeline,
    RoleMismatch,
    Route,
    UnknownLocalState,
    global_states_for_local,
    is_legal,
    request_type_for,
)
from worker.protocol import REQUEST_TYPES_BY_ROLE, InstanceRole, RequestType

S = GlobalState
D = Route.DISAGGREGATED
C = Route.COLOCATED
Q: Node = (S.QUEUED, None)


class FakeClock:
    def __init__(self, start_s: float = 100.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def _expected_edges() -> set[tuple[Node, Node]]:
    """The table written out independently of the module, edge by edge."""
    edges: set[tuple[Node, Node]] = {
        (Q, (S.CONTEXT_WAIT, D)),
        (Q, (S.CONTEXT_WAIT, C)),
        ((S.CONTEXT_WAIT, D), (S.CONTEXT_IN_PROGRESS, D)),
        ((S.CONTEXT_IN_PROGRESS, D), (S.GENERATION_INIT, D)),
        ((S.CONTEXT_IN_PROGRESS, D), (S.COMPLETE, D)),
        ((S.GENERATION_INIT, D), (S.TRANSMISSION, D)),
        ((S.TRANSMISSION, D), (S.GENERATING, D)),
        ((S.GENERATING, D), (S.COMPLETE, D)),
        ((S.CONTEXT_WAIT, C), (S.CONTEXT_IN_PROGRESS, C)),
        ((S.CONTEXT_IN_PROGRESS, C), (S.GENERATING, C)),
        ((S.CONTEXT_IN_PROGRESS, C), (S.COMPLETE, C)),
        ((S.GENERATING, C), (S.COMPLETE, C)),
        # retry transfer
        ((S.TRANSMISSION, D), (S.GENERATION_INIT, D)),
        ((S.GENERATION_INIT, D), (S.GENERATION_INIT, D)),
        # local recompute
        ((S.GENERATION_INIT, D), (S.GENERATING, C)),
        ((S.TRANSMISSION, D), (S.GENERATING, C)),
    }
    non_terminal: list[Node] = [
        Q,
        (S.CONTEXT_WAIT, D),
        (S.CONTEXT_WAIT, C),
        (S.CONTEXT_IN_PROGRESS, D),
        (S.CONTEXT_IN_PROGRESS, C),
        (S.GENERATION_INIT, D),
        (S.TRANSMISSION, D),
        (S.GENERATING, D),
        (S.GENERATING, C),
    ]
    for node in non_terminal:
        edges.add((node, (S.CONTEXT_WAIT, D)))
        edges.add((node, (S.CONTEXT_WAIT, C)))
        if node != Q:
            edges.add((node, Q))
        edges.add((node, (S.ERROR, node[1])))
        edges.add((node, (S.ABORTED, node[1])))
    return edges


def _table_edges() -> set[tuple[Node, Node]]:
    return {(source, target) for source, targets in TRANSITIONS.items() for target in targets}


def _path_to(node: Node) -> list[Node]:
    """Shortest sequence of nodes from QUEUED to `node` through the table."""
    parents: dict[Node, Node | None] = {Q: None}
    frontier = deque([Q])
    while frontier:
        current = frontier.popleft()
        if current == node:
            break
        for target in sorted(TRANSITIONS.get(current, ()), key=repr):
            if target not in parents:
                parents[target] = current
                frontier.append(target)
    assert node in parents, f"{node} unreachable"
    path: list[Node] = []
    cursor: Node | None = node
    while cursor is not None:
        path.append(cursor)
        cursor = parents[cursor]
    return path[::-1][1:]


def _drive(timeline: RequestTimeline, path: list[Node]) -> None:
    for state, route in path:
        timeline.transition(state, route=route, instance_id="i0")


def test_table_matches_the_specification_edge_for_edge():
    assert _table_edges() == _expected_edges()


def test_terminal_states_have_no_outgoing_edges():
    for source in TRANSITIONS:
        assert not source[0].is_terminal
    assert TERMINAL_STATES == {S.COMPLETE, S.ERROR, S.ABORTED}


@pytest.mark.parametrize("edge", sorted(_expected_edges(), key=repr), ids=lambda e: f"{e[0]}->{e[1]}")
def test_every_legal_edge_is_accepted_by_a_timeline(edge):
    source, target = edge
    timeline = RequestTimeline("r1", clock=FakeClock())
    _drive(timeline, _path_to(source))
    assert timeline.node == source
    timeline.transition(target[0], route=target[1], instance_id="i1", detail="edge under test")
    assert timeline.node == target


ILLEGAL = [
    (Q, (S.CONTEXT_IN_PROGRESS, D)),
    (Q, (S.GENERATING, C)),
    (Q, (S.COMPLETE, None)),
    ((S.CONTEXT_WAIT, D), (S.TRANSMISSION, D)),
    ((S.CONTEXT_WAIT, D), (S.CONTEXT_IN_PROGRESS, C)),  # a route cannot change silently
    ((S.CONTEXT_WAIT, C), (S.GENERATING, C)),
    ((S.CONTEXT_IN_PROGRESS, C), (S.GENERATION_INIT, C)),
    ((S.CONTEXT_IN_PROGRESS, C), (S.GENERATION_INIT, D)),
    ((S.CONTEXT_IN_PROGRESS, D), (S.GENERATING, D)),  # generation needs the KV first
    ((S.CONTEXT_IN_PROGRESS, D), (S.TRANSMISSION, D)),
    ((S.GENERATION_INIT, D), (S.CONTEXT_IN_PROGRESS, D)),
    ((S.GENERATION_INIT, D), (S.COMPLETE, D)),
    ((S.TRANSMISSION, D), (S.TRANSMISSION, D)),
    ((S.TRANSMISSION, D), (S.COMPLETE, D)),
    ((S.GENERATING, D), (S.GENERATION_INIT, D)),
    ((S.GENERATING, D), (S.TRANSMISSION, D)),
    ((S.GENERATING, C), (S.CONTEXT_IN_PROGRESS, C)),
    ((S.GENERATING, D), (S.GENERATING, C)),
]


@pytest.mark.parametrize("edge", ILLEGAL, ids=lambda e: f"{e[0]}->{e[1]}")
def test_illegal_edges_are_rejected_and_leave_the_timeline_unchanged(edge):
    source, target = edge
    assert not is_legal(source, target)
    timeline = RequestTimeline("r1", clock=FakeClock())
    _drive(timeline, _path_to(source))
    before = timeline.entries
    with pytest.raises(IllegalTransition) as info:
        timeline.transition(target[0], route=target[1])
    assert info.value.source == source
    assert info.value.request_id == "r1"
    assert timeline.entries == before


def test_placement_must_name_a_route():
    timeline = RequestTimeline("r1", clock=FakeClock())
    with pytest.raises(IllegalTransition):
        timeline.transition(S.CONTEXT_WAIT, instance_id="p0")
    assert timeline.state is S.QUEUED


@pytest.mark.parametrize("terminal", sorted(TERMINAL_STATES, key=lambda s: s.value))
def test_nothing_is_accepted_after_a_terminal_state(terminal):
    ends = [target for target in _table_edges() if target[1][0] is terminal]
    for _, end in ends:
        timeline = RequestTimeline("r1", clock=FakeClock())
        _drive(timeline, _path_to(end))
        assert timeline.is_terminal
        for state in GlobalState:
            for route in (None, D, C):
                with pytest.raises(IllegalTransition, match="already ended"):
                    timeline.transition(state, route=route)
        assert timeline.node == end


def test_disaggregated_timeline_records_states_instances_times_and_reasons():
    clock = FakeClock(10.0)
    timeline = RequestTimeline("req-7", clock=clock)
    steps = [
        (S.CONTEXT_WAIT, D, "p0", "placed kv_aware", 0.5),
        (S.CONTEXT_IN_PROGRESS, None, "p0", "scheduled", 1.0),
        (S.GENERATION_INIT, None, "g1", "reserving 12 blocks", 2.0),
        (S.TRANSMISSION, None, "g1", "transfer t-1", 0.25),
        (S.GENERATING, None, "g1", "kv committed", 3.0),
        (S.COMPLETE, None, "g1", "length", 0.0),
    ]
    for state, route, instance, detail, dt in steps:
        clock.advance(dt)
        timeline.transition(state, route=route, instance_id=instance, detail=detail)
    entries = timeline.entries
    assert [e.state for e in entries] == [S.QUEUED] + [s[0] for s in steps]
    assert [e.timestamp_s for e in entries] == [10.0, 10.5, 11.5, 13.5, 13.75, 16.75, 16.75]
    assert [e.instance_id for e in entries] == [None, "p0", "p0", "g1", "g1", "g1", "g1"]
    assert entries[3].detail == "reserving 12 blocks"
    assert all(e.route is D for e in entries[1:])
    assert timeline.entered_at(S.TRANSMISSION) == 13.75
    assert timeline.entered_at(S.ERROR) is None
    clock.advance(4.0)
    assert timeline.time_in_state_s() == 4.0


def test_recovery_flow_retry_then_local_recompute_switches_route():
    clock = FakeClock()
    timeline = RequestTimeline("r", clock=clock)
    timeline.transition(S.CONTEXT_WAIT, route=D, instance_id="p0")
    timeline.transition(S.CONTEXT_IN_PROGRESS)
    timeline.transition(S.GENERATION_INIT, instance_id="g0")
    timeline.transition(S.TRANSMISSION, instance_id="g0")
    timeline.transition(S.GENERATION_INIT, instance_id="g0", detail="retry_transfer 1: checksum mismatch")
    timeline.transition(S.TRANSMISSION, instance_id="g0")
    timeline.transition(S.GENERATING, route=C, instance_id="g0", detail="recompute_local: peer died")
    assert timeline.route is C
    timeline.transition(S.CONTEXT_WAIT, route=D, instance_id="p1", detail="reprefill: g0 died")
    timeline.transition(S.QUEUED, detail="no instance right now")
    assert timeline.route is None
    timeline.transition(S.ERROR, detail="fail: recovery exhausted")
    assert timeline.is_terminal
    assert timeline.current.route is None


def test_requeued_request_keeps_no_route_and_can_be_placed_again():
    timeline = RequestTimeline("r", clock=FakeClock())
    timeline.transition(S.CONTEXT_WAIT, route=C, instance_id="m0")
    timeline.transition(S.QUEUED, route=C)  # the route argument cannot keep a route in the queue
    assert timeline.node == Q
    timeline.transition(S.CONTEXT_WAIT, route=D, instance_id="p0")
    assert timeline.node == (S.CONTEXT_WAIT, D)


def test_request_id_must_be_non_empty():
    with pytest.raises(ValueError):
        RequestTimeline("", clock=FakeClock())


# --- local state mapping -------------------------------------------------------------------------


def test_every_local_state_corresponds_to_some_global_state():
    for name in LOCAL_STATE_NAMES:
        union = global_states_for_local(name, InstanceRole.MIXED)
        assert union, name


def test_unknown_local_state_is_rejected():
    with pytest.raises(UnknownLocalState):
        global_states_for_local("GENERATION_SOMETHING", InstanceRole.PREFILL)


def test_role_that_never_runs_a_request_half_is_rejected():
    with pytest.raises(RoleMismatch):
        global_states_for_local("CONTEXT_INIT", InstanceRole.PREFILL, RequestType.GENERATION_ONLY)
    with pytest.raises(RoleMismatch):
        global_states_for_local("CONTEXT_INIT", InstanceRole.PREFILL, RequestType.CONTEXT_AND_GENERATION)


def test_impossible_reports_map_to_nothing():
    # A prefill instance never generates; a colocated request never transfers.
    assert global_states_for_local("GENERATION_IN_PROGRESS", InstanceRole.PREFILL) == frozenset()
    assert global_states_for_local("DISAGG_GENERATION_INIT", InstanceRole.PREFILL) == frozenset()
    assert (
        global_states_for_local("DISAGG_TRANS_ERROR", InstanceRole.MIXED, RequestType.CONTEXT_AND_GENERATION)
        == frozenset()
    )


def _consistent(timeline: RequestTimeline, states: frozenset[GlobalState]) -> bool:
    """The router's check: the report names the current state or one the table can move to."""
    if timeline.state in states:
        return True
    return any(target[0] in states for target in TRANSITIONS.get(timeline.node, ()))


def test_disaggregated_flow_reports_are_consistent_at_every_step():
    timeline = RequestTimeline("r", clock=FakeClock())
    prefill, generation = InstanceRole.PREFILL, InstanceRole.GENERATION
    flow = [
        # (global state to enter, route, role reporting, local state reported)
        (S.CONTEXT_WAIT, D, prefill, "CONTEXT_INIT"),
        (S.CONTEXT_IN_PROGRESS, None, prefill, "CONTEXT_INIT"),
        (S.GENERATION_INIT, None, prefill, "DISAGG_CONTEXT_TRANS_IN_PROGRESS"),
        (S.GENERATION_INIT, None, generation, "DISAGG_GENERATION_INIT"),
        (S.TRANSMISSION, None, generation, "DISAGG_GENERATION_TRANS_IN_PROGRESS"),
        (S.GENERATING, None, generation, "DISAGG_GENERATION_TRANS_COMPLETE"),
        (S.GENERATING, None, prefill, "DISAGG_CONTEXT_COMPLETE"),
        (S.GENERATING, None, generation, "GENERATION_IN_PROGRESS"),
        (S.COMPLETE, None, generation, "GENERATION_COMPLETE"),
    ]
    for state, route, role, local in flow:
        reported = global_states_for_local(local, role, request_type_for(D, role))
        if timeline.state is not state:
            assert _consistent(timeline, reported), (timeline.node, local)
            timeline.transition(state, route=route)
        assert state in reported, (state, local)


def test_inconsistent_reports_are_detected():
    timeline = RequestTimeline("r", clock=FakeClock())
    timeline.transition(S.CONTEXT_WAIT, route=D, instance_id="p0")
    # The generation instance claims to be generating before any KV moved.
    reported = global_states_for_local(
        "GENERATION_IN_PROGRESS", InstanceRole.GENERATION, RequestType.GENERATION_ONLY
    )
    assert not _consistent(timeline, reported)


def test_paused_and_recomputed_requests_report_context_init_while_generating():
    for role in (InstanceRole.GENERATION, InstanceRole.MIXED):
        for kind in REQUEST_TYPES_BY_ROLE[role] - {RequestType.CONTEXT_ONLY}:
            assert S.GENERATING in global_states_for_local("CONTEXT_INIT", role, kind)


def test_request_type_for_routes_and_roles():
    assert request_type_for(D, InstanceRole.PREFILL) is RequestType.CONTEXT_ONLY
    assert request_type_for(D, InstanceRole.GENERATION) is RequestType.GENERATION_ONLY
    assert request_type_for(D, InstanceRole.MIXED) is RequestType.GENERATION_ONLY
    assert request_type_for(C, InstanceRole.MIXED) is RequestType.CONTEXT_AND_GENERATION
