"""What the request flow (cluster/router/flow.py) asks the driver to do: plain values, no I/O.

The flow decides; the driver (cluster/router/driver.py) executes these in order, each through the
instance's InstanceClient, the request's event stream or the observer. A list of actions from one
event is executed in its order: the stops of a request's old hops before its new hop, its final
event after the stops of its hops.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cluster.router.api import FinalEvent, TokenEvent
from cluster.router.config import RecoveryAction
from worker.protocol import RequestType
from worker.sampling import SamplingParams


class Phase(enum.Enum):
    """Which half of a request one hop runs."""

    PREFILL = "prefill"  # CONTEXT_ONLY on a PREFILL instance
    GENERATION = "generation"  # GENERATION_ONLY: receives KV, then generates
    COLOCATED = "colocated"  # CONTEXT_AND_GENERATION on one instance

    @property
    def suffix(self) -> str:
        """The letter of the hop in its engine id: "<request id>.p1", ".g1", ".c1"."""
        return _SUFFIXES[self]

    @property
    def request_type(self) -> RequestType:
        """The local request type (TensorRT-LLM's LlmRequestType) an instance runs the hop as."""
        return _REQUEST_TYPES[self]


_SUFFIXES = {Phase.PREFILL: "p", Phase.GENERATION: "g", Phase.COLOCATED: "c"}
_REQUEST_TYPES = {
    Phase.PREFILL: RequestType.CONTEXT_ONLY,
    Phase.GENERATION: RequestType.GENERATION_ONLY,
    Phase.COLOCATED: RequestType.CONTEXT_AND_GENERATION,
}


@dataclass(frozen=True)
class StartHop:
    """Submit one hop to an instance. Tokens already streamed travel with it: the instance replays
    them (prompt + outputs is its context) and emits only what comes after."""

    request_id: str
    engine_id: str
    instance_id: str
    phase: Phase
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    output_token_ids: tuple[int, ...]
    priority: float
    # A generation hop submitted while its prefill runs (an early reservation): the token after
    # its context comes with the KV's commit (worker/protocol.py SubmitRequest.token_with_kv).
    token_with_kv: bool = False


@dataclass(frozen=True)
class StopHop:
    """Make an instance free what it holds for a hop: release its KV hand-over first when the hop
    is a prefill that finished its context, then abort it. Sent only after the hop's submit
    returned (an abort beside its submit could reach the instance first and be lost)."""

    engine_id: str
    instance_id: str
    release: bool
    detail: str


@dataclass(frozen=True)
class Push:
    """Ask the prefill instance to push a hop's KV to the generation instance's reservation: at once
    if its KV is final, otherwise the moment its context completes (an early reservation)."""

    request_id: str
    instance_id: str  # the prefill instance
    engine_id: str  # the prefill hop
    target_instance_id: str  # the generation instance
    target_engine_id: str  # the generation hop
    transfer_id: str
    deadline_s: float


@dataclass(frozen=True)
class RenewReservation:
    """Keep an early reservation alive while its prefill still runs (the driver batches these per
    instance into one Renew command)."""

    instance_id: str
    engine_id: str


@dataclass(frozen=True)
class EmitTokens:
    request_id: str
    event: TokenEvent
    first_token: bool = False  # the request's first tokens (its TTFT ends here)


@dataclass(frozen=True)
class Finish:
    """The request ended: deliver its final event (after the stops listed before this action)."""

    request_id: str
    final: FinalEvent


class TransferNote(enum.Enum):
    STARTED = "started"
    COMMITTED = "committed"


@dataclass(frozen=True)
class NoteTransfer:
    """A KV transfer started or was committed (for counters and metrics)."""

    note: TransferNote


@dataclass(frozen=True)
class NoteRecovery:
    request_id: str
    action: RecoveryAction
    reason: str


@dataclass(frozen=True)
class NoteInconsistent:
    """An instance reported a local state the global view cannot be in or move to (must stay 0)."""

    request_id: str
    instance_id: str
    local_state: str
    global_state: str


Action = StartHop | StopHop | Push | RenewReservation | EmitTokens | Finish | NoteTransfer | NoteRecovery | NoteInconsistent
