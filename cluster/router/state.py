"""The router's view of one request: a global state machine, its transition table, and its timeline.

A request is placed on one of two routes:

* DISAGGREGATED: a PREFILL instance runs the context-only half, a GENERATION (or MIXED) instance
  reserves KV, receives it, and generates:
  QUEUED -> CONTEXT_WAIT -> CONTEXT_IN_PROGRESS -> GENERATION_INIT -> TRANSMISSION -> GENERATING -> COMPLETE
* COLOCATED: one MIXED or GENERATION instance runs the whole request (conditional disaggregation
  decided to skip the prefill hop, or a configured fallback found no PREFILL instance):
  QUEUED -> CONTEXT_WAIT -> CONTEXT_IN_PROGRESS -> GENERATING -> COMPLETE

The table is keyed by (state, route) so that it says, for example, that GENERATION_INIT only
exists on the disaggregated route. QUEUED carries no route: a request in the queue is unplaced.

Recovery edges (the router picks among them by the configured recovery chain):

* retry the transfer: TRANSMISSION -> GENERATION_INIT (reserve again, same or another generation
  instance), and GENERATION_INIT -> GENERATION_INIT (a refused or expired reservation retried).
* recompute locally on the generation instance: GENERATION_INIT/TRANSMISSION (disaggregated) ->
  GENERATING (colocated): from then on that instance holds the whole request, so the route changes.
* re-run prefill elsewhere: every non-terminal state -> CONTEXT_WAIT on either route (this is also
  how a request is re-placed when its instance dies before scheduling it, or migrated mid-decode).
* requeue: every placed, non-terminal state -> QUEUED, when no instance can take it right now.
* fail / abort: every non-terminal state -> ERROR / ABORTED.

A request may also complete straight from CONTEXT_IN_PROGRESS: its first token (produced by the
prefill step) can be its last (max_tokens == 1, or a stop token).

Terminal states are COMPLETE, ERROR and ABORTED; a timeline accepts nothing after one, so every
request ends exactly once (docs/architecture.md, "Invariants").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from scheduler.state import LlmRequestState
from worker.protocol import REQUEST_TYPES_BY_ROLE, InstanceRole, RequestType

logger = logging.getLogger(__name__)


class GlobalState(Enum):
    QUEUED = "queued"
    CONTEXT_WAIT = "context_wait"
    CONTEXT_IN_PROGRESS = "context_in_progress"
    GENERATION_INIT = "generation_init"
    TRANSMISSION = "transmission"
    GENERATING = "generating"
    COMPLETE = "complete"
    ERROR = "error"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({GlobalState.COMPLETE, GlobalState.ERROR, GlobalState.ABORTED})


class Route(Enum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


# A node of the state machine: a state and the route it is on (None only for QUEUED and for ending
# straight out of the queue).
Node = tuple[GlobalState, Route | None]


class IllegalTransition(Exception):
    """A transition not in the table, or any transition after the request ended."""

    def __init__(self, request_id: str, source: Node, target: Node, reason: str) -> None:
        self.request_id = request_id
        self.source = source
        self.target = target
        super().__init__(
            f"request {request_id!r}: illegal transition {_node_name(source)} -> {_node_name(target)}: {reason}"
        )


def _node_name(node: Node) -> str:
    state, route = node
    return state.name if route is None else f"{state.name}[{route.name}]"


def _build_transitions() -> Mapping[Node, frozenset[Node]]:
    s = GlobalState
    d, c = Route.DISAGGREGATED, Route.COLOCATED
    edges: dict[Node, set[Node]] = {}

    def allow(source: Node, *targets: Node) -> None:
        edges.setdefault(source, set()).update(targets)

    # Placement.
    allow((s.QUEUED, None), (s.CONTEXT_WAIT, d), (s.CONTEXT_WAIT, c))
    # The disaggregated path.
    allow((s.CONTEXT_WAIT, d), (s.CONTEXT_IN_PROGRESS, d))
    allow((s.CONTEXT_IN_PROGRESS, d), (s.GENERATION_INIT, d), (s.COMPLETE, d))
    allow((s.GENERATION_INIT, d), (s.TRANSMISSION, d))
    allow((s.TRANSMISSION, d), (s.GENERATING, d))
    allow((s.GENERATING, d), (s.COMPLETE, d))
    # The colocated path.
    allow((s.CONTEXT_WAIT, c), (s.CONTEXT_IN_PROGRESS, c))
    allow((s.CONTEXT_IN_PROGRESS, c), (s.GENERATING, c), (s.COMPLETE, c))
    allow((s.GENERATING, c), (s.COMPLETE, c))
    # Recovery: retry the transfer (re-reserve, then re-send).
    allow((s.TRANSMISSION, d), (s.GENERATION_INIT, d))
    allow((s.GENERATION_INIT, d), (s.GENERATION_INIT, d))
    # Recovery: the generation instance recomputes the prompt itself and now owns the whole request.
    allow((s.GENERATION_INIT, d), (s.GENERATING, c))
    allow((s.TRANSMISSION, d), (s.GENERATING, c))

    non_terminal: list[Node] = [(s.QUEUED, None)] + [
        (state, route)
        for state in GlobalState
        if state is not s.QUEUED and not state.is_terminal
        for route in Route
        # GENERATION_INIT and TRANSMISSION exist only on the disaggregated route.
        if route is d or state not in (s.GENERATION_INIT, s.TRANSMISSION)
    ]
    for node in non_terminal:
        state, route = node
        # Recovery: re-run prefill elsewhere, on either route.
        allow(node, (s.CONTEXT_WAIT, d), (s.CONTEXT_WAIT, c))
        if state is not s.QUEUED:
            allow(node, (s.QUEUED, None))
        allow(node, (s.ERROR, route), (s.ABORTED, route))
    return MappingProxyType({node: frozenset(targets) for node, targets in edges.items()})


# Every legal (state, route) -> (state, route) edge; anything absent is illegal.
TRANSITIONS: Mapping[Node, frozenset[Node]] = _build_transitions()


def is_legal(source: Node, target: Node) -> bool:
    return target in TRANSITIONS.get(source, frozenset())


@dataclass(frozen=True)
class Transition:
    """One transition: the state entered, on which route, when, on which instance, and why."""

    state: GlobalState
    route: Route | None
    timestamp_s: float
    instance_id: str | None
    detail: str


class RequestTimeline:
    """The checked state machine of one request, with one entry per transition.

    `clock` returns seconds (default time.monotonic); tests inject a fake one.
    """

    def __init__(
        self,
        request_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        detail: str = "accepted",
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        self._request_id = request_id
        self._clock = clock
        self._entries: list[Transition] = [Transition(GlobalState.QUEUED, None, clock(), None, detail)]

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def entries(self) -> tuple[Transition, ...]:
        return tuple(self._entries)

    @property
    def current(self) -> Transition:
        return self._entries[-1]

    @property
    def state(self) -> GlobalState:
        return self._entries[-1].state

    @property
    def route(self) -> Route | None:
        return self._entries[-1].route

    @property
    def node(self) -> Node:
        return (self.state, self.route)

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    def transition(
        self,
        state: GlobalState,
        *,
        instance_id: str | None = None,
        route: Route | None = None,
        detail: str = "",
        at_s: float | None = None,
    ) -> Transition:
        """Enter `state`; raises IllegalTransition if the table forbids it or the request has ended.

        `route` must be given when it changes (placement into CONTEXT_WAIT, local recompute into
        GENERATING); otherwise the current route is kept. Entering QUEUED always clears the route.
        `at_s` is the time of the transition (default: the injected clock's now).
        """
        source = self.node
        target_route = None if state is GlobalState.QUEUED else (route if route is not None else self.route)
        target: Node = (state, target_route)
        if self.is_terminal:
            raise IllegalTransition(self._request_id, source, target, "the request has already ended")
        if not is_legal(source, target):
            raise IllegalTransition(self._request_id, source, target, "not in the transition table")
        entry = Transition(state, target_route, self._clock() if at_s is None else at_s, instance_id, detail)
        self._entries.append(entry)
        logger.debug(
            "request %s: %s -> %s on %s (%s)",
            self._request_id,
            _node_name(source),
            _node_name(target),
            instance_id,
            detail,
        )
        return entry

    def entered_at(self, state: GlobalState) -> float | None:
        """When `state` was last entered, or None if never."""
        for entry in reversed(self._entries):
            if entry.state is state:
                return entry.timestamp_s
        return None

    def time_in_state_s(self, now_s: float | None = None) -> float:
        """Seconds since the current state was entered, until `now_s` (default: the injected clock's now)."""
        return (self._clock() if now_s is None else now_s) - self._entries[-1].timestamp_s


# --- Correspondence with the instances' local (TensorRT-LLM) request states ---------------------


class UnknownLocalState(ValueError):
    """An instance reported a local state name that is not one of LOCAL_STATE_NAMES."""


class RoleMismatch(ValueError):
    """An instance reported running a request half that its role never runs."""


# The local states by name (scheduler/state.py's LlmRequestState, TensorRT-LLM's numbering): the
# tables below read best by name; global_states_for_local also takes the enum members instances report.
LOCAL_STATE_NAMES = frozenset(
    {
        "ENCODER_INIT",
        "DISAGG_CONTEXT_WAIT_SCHEDULER",
        "DISAGG_GENERATION_INIT",
        "DISAGG_GENERATION_TRANS_IN_PROGRESS",
        "CONTEXT_INIT",
        "DISAGG_CONTEXT_INIT_AND_TRANS",
        "DISAGG_GENERATION_TRANS_COMPLETE",
        "GENERATION_IN_PROGRESS",
        "GENERATION_TO_COMPLETE",
        "GENERATION_COMPLETE",
        "DISAGG_CONTEXT_TRANS_IN_PROGRESS",
        "DISAGG_CONTEXT_COMPLETE",
        "DISAGG_GENERATION_WAIT_TOKENS",
        "DISAGG_TRANS_ERROR",
    }
)


def _build_local_map() -> Mapping[RequestType, Mapping[str, frozenset[GlobalState]]]:
    s = GlobalState
    waiting_or_running = frozenset({s.CONTEXT_WAIT, s.CONTEXT_IN_PROGRESS})
    transfer = frozenset({s.GENERATION_INIT, s.TRANSMISSION})
    context_only = {
        "ENCODER_INIT": waiting_or_running,
        "DISAGG_CONTEXT_WAIT_SCHEDULER": frozenset({s.CONTEXT_WAIT}),
        # CONTEXT_INIT covers both "not yet scheduled" and "between prefill chunks".
        "CONTEXT_INIT": waiting_or_running,
        # Layer-wise transfer: prefill still running while KV already flows.
        "DISAGG_CONTEXT_INIT_AND_TRANS": frozenset({s.CONTEXT_IN_PROGRESS}) | transfer,
        # Prefill done; KV waits for the receiver's reservation or is being sent. GENERATING too: the
        # sender stays here until its push is acknowledged, after the receiver committed, and it
        # records a failed push here while a retried transfer may have landed already.
        "DISAGG_CONTEXT_TRANS_IN_PROGRESS": transfer | {s.GENERATING},
        # The sender is done; the receiver may not have committed yet, or may be generating already.
        "DISAGG_CONTEXT_COMPLETE": frozenset({s.TRANSMISSION, s.GENERATING, s.COMPLETE}),
        # The first token was the last one: nothing to transfer.
        "GENERATION_COMPLETE": frozenset({s.COMPLETE}),
        "DISAGG_TRANS_ERROR": transfer,
    }
    # An early reservation (router.handover.reserve): the generation hop is submitted and reserves
    # while the prefill still waits or runs. (Its commit can also reach the router before the
    # prefill's first token does: the flow judges those reports by where the first token will take
    # the request, cluster/router/flow.py `_consistent`; the table stays strict about them.)
    context = frozenset({s.CONTEXT_WAIT, s.CONTEXT_IN_PROGRESS})
    generation_only = {
        "DISAGG_GENERATION_INIT": context | {s.GENERATION_INIT},
        "DISAGG_GENERATION_TRANS_IN_PROGRESS": context | {s.TRANSMISSION},
        "DISAGG_GENERATION_TRANS_COMPLETE": frozenset({s.GENERATING}),
        "DISAGG_GENERATION_WAIT_TOKENS": frozenset({s.TRANSMISSION, s.GENERATING}),
        # A paused generation request is recomputed: it goes back through CONTEXT_INIT locally.
        "ENCODER_INIT": frozenset({s.GENERATING}),
        "CONTEXT_INIT": frozenset({s.GENERATING}),
        "GENERATION_IN_PROGRESS": frozenset({s.GENERATING}),
        "GENERATION_TO_COMPLETE": frozenset({s.GENERATING}),
        "GENERATION_COMPLETE": frozenset({s.COMPLETE}),
        "DISAGG_TRANS_ERROR": transfer,
    }
    whole = {
        # GENERATING too: a paused request, or one recomputed locally after a failed transfer,
        # runs its (grown) prompt again.
        "ENCODER_INIT": waiting_or_running | {s.GENERATING},
        "CONTEXT_INIT": waiting_or_running | {s.GENERATING},
        "GENERATION_IN_PROGRESS": frozenset({s.GENERATING}),
        "GENERATION_TO_COMPLETE": frozenset({s.GENERATING}),
        "GENERATION_COMPLETE": frozenset({s.COMPLETE}),
    }
    return MappingProxyType(
        {
            RequestType.CONTEXT_ONLY: MappingProxyType(context_only),
            RequestType.GENERATION_ONLY: MappingProxyType(generation_only),
            RequestType.CONTEXT_AND_GENERATION: MappingProxyType(whole),
        }
    )


_LOCAL_TO_GLOBAL = _build_local_map()


def request_type_for(route: Route, role: InstanceRole) -> RequestType:
    """The half a request on `route` runs on an instance of `role` when the instance is that route's
    context host (PREFILL) or generation host (GENERATION/MIXED)."""
    if route is Route.COLOCATED:
        return RequestType.CONTEXT_AND_GENERATION
    return RequestType.CONTEXT_ONLY if role is InstanceRole.PREFILL else RequestType.GENERATION_ONLY


def global_states_for_local(
    local_state: LlmRequestState | str, role: InstanceRole, request_type: RequestType | None = None
) -> frozenset[GlobalState]:
    """The global states a request can be in when an instance of `role` reports `local_state` for it.

    The router's view moves on those reports, so the result names the state the report puts the
    request in (a router in CONTEXT_IN_PROGRESS receiving DISAGG_CONTEXT_TRANS_IN_PROGRESS should
    move to GENERATION_INIT or TRANSMISSION): a report is consistent when the current state is in the
    result or has a legal edge into it. An empty result means the report is impossible for that half
    (for example GENERATION_IN_PROGRESS on a context-only request). Without `request_type`, the union
    over every half `role` may run.
    """
    if isinstance(local_state, LlmRequestState):
        local_state = local_state.name
    if local_state not in LOCAL_STATE_NAMES:
        raise UnknownLocalState(f"{local_state!r} is not a local request state")
    allowed = REQUEST_TYPES_BY_ROLE[role]
    if request_type is not None and request_type not in allowed:
        raise RoleMismatch(f"a {role.name} instance never runs {request_type.name} requests")
    types = allowed if request_type is None else frozenset({request_type})
    result: frozenset[GlobalState] = frozenset()
    for kind in types:
        result |= _LOCAL_TO_GLOBAL[kind].get(local_state, frozenset())
    return result
