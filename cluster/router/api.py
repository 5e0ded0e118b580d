"""The router's public face: what the gRPC front end (and tests) hand it and get back.

Plain, typed values (no torch, no grpc): the front end converts protobuf to these and back, the
router never sees protobuf. `RouterAPI` is the interface the front end is written against; the
real router (cluster/router/driver.py) and test fakes implement it.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from worker.protocol import InstanceRole
from worker.sampler_types import SampleLogprobs
from worker.sampling import SamplingParams


class ErrorKind(enum.Enum):
    """Why a call or a request failed; each maps to one gRPC status code (same names)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # bad input, before placement (field named)
    ALREADY_EXISTS = "ALREADY_EXISTS"  # the client_request_id names a request still running (field named)
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # admission queue full
    UNAVAILABLE = "UNAVAILABLE"  # no healthy instance can serve it (draining, all dead)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the request's own deadline passed
    CANCELLED = "CANCELLED"  # the client went away or aborted it
    ABORTED = "ABORTED"  # recovery gave up (transfer failures beyond the chain), retryable by the client
    NOT_FOUND = "NOT_FOUND"  # unknown request id
    INTERNAL = "INTERNAL"  # a bug or an instance failure that recovery could not mask


class RouterError(Exception):
    """A refused call. `field` names the offending input field for INVALID_ARGUMENT."""

    def __init__(self, kind: ErrorKind, message: str, field: str | None = None) -> None:
        super().__init__(f"{kind.value}: {field + ': ' if field else ''}{message}")
        self.kind = kind
        self.message = message
        self.field = field


class Outcome(enum.Enum):
    COMPLETE = "COMPLETE"
    ERROR = "ERROR"
    ABORTED = "ABORTED"


@dataclass(frozen=True)
class ClientRequest:
    """A generation request as the front end received it (exactly one of text / token ids).

    `validated`: the front end has tokenized the text and checked the request against the model's
    limits (vocabulary, context length, sampling ranges), so the router takes it as it is: a
    request is validated once, at the edge. Callers that skip a front end (tests, tools) leave it
    False and the router checks (the engine checks again in any case: the offline API enters there)."""

    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    sampling: SamplingParams
    client_request_id: str | None = None
    timeout_s: float | None = None  # end-to-end deadline, from arrival
    priority: float = 0.5
    validated: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of a request, in order, with the text they complete."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[SampleLogprobs | None, ...] = ()


@dataclass(frozen=True)
class TimelineEntry:
    state: str  # a GlobalState name, e.g. "CONTEXT_WAIT"
    time_s: float  # wall-clock seconds since the epoch
    instance_id: str = ""
    detail: str = ""


@dataclass(frozen=True)
class InstanceUse:
    instance_id: str
    role: InstanceRole
    phase: str  # "prefill", "generation", "colocated", "recompute"
    attempt: int = 1


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class FinalEvent:
    """The last event of every accepted request: exactly one per request."""

    outcome: Outcome
    finish_reason: str | None  # "stop", "length", "abort" (vLLM's strings); None on error
    stop_reason: int | str | None
    usage: Usage
    timeline: tuple[TimelineEntry, ...]
    instances: tuple[InstanceUse, ...]
    error_kind: ErrorKind | None = None
    error_message: str = ""


RequestEvent = TokenEvent | FinalEvent


@dataclass(frozen=True)
class RequestView:
    """GetRequest: a request's state now (and its final event once it ended)."""

    request_id: str
    client_request_id: str | None
    state: str
    timeline: tuple[TimelineEntry, ...]
    instances: tuple[InstanceUse, ...]
    final: FinalEvent | None = None
    error: str = ""


class InstanceHealthView(enum.Enum):
    HEALTHY = "HEALTHY"
    DEGRADED = "DEGRADED"  # missed heartbeats, not yet declared dead
    UNHEALTHY = "UNHEALTHY"
    DRAINING = "DRAINING"


@dataclass(frozen=True)
class InstanceView:
    instance_id: str
    role: InstanceRole
    address: str
    health: InstanceHealthView
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    queued_requests: int
    running_requests: int
    active_transfers: int
    last_report_s: float  # wall clock of the last load report


@dataclass(frozen=True)
class ModelInfo:
    """What is served, as logged at startup, shown by `duet status` and exported as duet_model_info."""

    model: str  # the checkpoint directory, or "built-in"
    architecture: str  # LlamaForCausalLM, ...
    dtype: str  # the dtype the instances compute in (after `auto` was resolved)
    max_model_len: int  # the longest sequence (prompt + output), tokens
    kv_capacity_tokens: int  # KV cache tokens of the smallest instance

    def describe(self) -> str:
        return (
            f"{self.model} ({self.architecture}, {self.dtype}, context {self.max_model_len} tokens, "
            f"KV capacity {self.kv_capacity_tokens} tokens per instance)"
        )


@dataclass(frozen=True)
class ClusterView:
    instances: tuple[InstanceView, ...]
    queue_depth: int
    requests_by_state: Mapping[str, int]
    requests_by_outcome: Mapping[str, int]
    fallbacks: tuple[str, ...]
    max_recovery_attempts: int
    placement_policy: str
    timestamp_s: float
    extra: Mapping[str, float] = field(default_factory=dict)
    model: ModelInfo | None = None


class RequestHandle(Protocol):
    request_id: str

    def events(self) -> AsyncIterator[RequestEvent]:
        """Token events in order, then exactly one FinalEvent; then the iterator ends."""
        ...


async def collect(handle: RequestHandle) -> tuple[list[int], FinalEvent]:
    """Every token of a submitted request's event stream, and its final event (tests and tools)."""
    tokens: list[int] = []
    final: FinalEvent | None = None
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        else:
            final = event
    if final is None:
        raise RuntimeError(f"the stream of {handle.request_id} ended without a final event")
    return tokens, final


class RouterAPI(Protocol):
    """What the front ends (gRPC, OpenAI HTTP) need from the router. All methods run on the router's event loop."""

    vocab_size: int
    max_seq_len: int

    def tokenize(self, text: str) -> list[int]:
        """Prompt text -> token ids with the served model's tokenizer."""
        ...

    async def submit(self, request: ClientRequest) -> RequestHandle:
        """Validate, admit and place; raises RouterError (INVALID_ARGUMENT naming the field,
        ALREADY_EXISTS when its client_request_id names a request the router still holds,
        RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when nothing can serve it)."""
        ...

    async def submit_all(self, requests: Sequence[ClientRequest]) -> list[RequestHandle]:
        """Admit every request or none (a batch of prompts, n choices): RESOURCE_EXHAUSTED when
        they do not all fit the admission queue, and then nothing runs."""
        ...

    async def abort(self, request_id: str | None = None, client_request_id: str | None = None) -> tuple[bool, str]:
        """(aborted?, state now); raises RouterError(NOT_FOUND) for an unknown id."""
        ...

    def get_request(self, request_id: str | None = None, client_request_id: str | None = None) -> RequestView:
        """Raises RouterError(NOT_FOUND) for an unknown id."""
        ...

    def cluster_status(self) -> ClusterView: ...
