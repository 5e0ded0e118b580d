"""Typed values that cross the engine's boundary (no torch here: the cluster imports them).

- `InstanceRole` / `RequestType`: what an instance serves and what a request asks of it.
- `EngineConfig`: one instance's scheduler, KV pool and hand-over settings, validated without I/O.
- `SubmitRequest`: a request as handed to an engine; `RequestOutput`: what a step emits for it.
- `StateEvent`: a local state transition (the router mirrors these in its global state machine).
- `Reservation`: the KV blocks a generation instance reserved for an incoming transfer.
- `EngineLoad`: the load numbers the router places by.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from scheduler.block_manager import PrefixEvent
from scheduler.config import CapacitySchedulerPolicy, ContextChunkingPolicy, NamedEnum
from worker.config import (
    ConfigProblem,
    ConfigStruct,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ProblemKind,
    dataclass_compatible,
    join_path,
    load_config,
)
from worker.kv_layout import KvLayout
from worker.sampling import SamplingParams
from worker.stopping import FinishReason


class EngineInputError(ValueError):
    """A request (or config) the engine refuses before it reaches the model; `.field` names why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# The detail of the StateEvent recorded when a request's first context chunk is scheduled (its
# state stays CONTEXT_INIT, so the router learns of it from this detail).
EVENT_PREFILL_STARTED = "prefill started"


class InstanceRole(NamedEnum, field="role", label="role"):
    PREFILL = "PREFILL"
    GENERATION = "GENERATION"
    MIXED = "MIXED"


class RequestType(enum.Enum):
    """TensorRT-LLM's request types: the whole request, or one half of a disaggregated one."""

    CONTEXT_AND_GENERATION = "CONTEXT_AND_GENERATION"
    CONTEXT_ONLY = "CONTEXT_ONLY"  # prefill, emit the first token, then hand the KV over
    GENERATION_ONLY = "GENERATION_ONLY"  # receive the KV and the first token, then generate


# Which request types each role accepts. A GENERATION instance also runs whole requests: that is
# the "recompute locally" recovery path and the conditional-disaggregation shortcut.
ACCEPTED_TYPES: dict[InstanceRole, frozenset[RequestType]] = {
    InstanceRole.PREFILL: frozenset({RequestType.CONTEXT_ONLY}),
    InstanceRole.GENERATION: frozenset({RequestType.GENERATION_ONLY, RequestType.CONTEXT_AND_GENERATION}),
    InstanceRole.MIXED: frozenset(RequestType),
}


@dataclass_compatible
class EngineConfig(ConfigStruct, frozen=True):
    """One instance's scheduler, KV pool and hand-over settings (`engine:` in the cluster config,
    overridable per instance group); errors are EngineInputErrors naming the field."""

    role: InstanceRole = InstanceRole.MIXED
    """What the instance serves."""
    tokens_per_block: PositiveInt = 16
    """Tokens per KV cache block (the same on every instance of a cluster)."""
    num_blocks: PositiveInt | None = None
    """KV pool size in blocks; None: as many blocks as fit in kv_cache_bytes."""
    kv_cache_bytes: PositiveInt = 256 * 1024 * 1024
    """KV pool size in bytes, used when num_blocks is None."""
    max_num_requests: PositiveInt = 64
    """Requests holding KV at once (capacity scheduler)."""
    max_batch_size: PositiveInt = 64
    """Requests per forward step (micro-batch scheduler)."""
    max_num_tokens: PositiveInt = 2048
    """Tokens per forward step."""
    capacity_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    """Capacity scheduler policy, by name."""
    chunking_policy: ContextChunkingPolicy | None = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    """Context chunking policy, by name; None: contexts are never chunked."""
    chunk_unit_tokens: PositiveInt = 256
    """Tokens per context chunk; a multiple of tokens_per_block, at most max_num_tokens."""
    enable_prefix_reuse: bool = True
    """Reuse cached KV blocks of shared prompt prefixes."""
    max_seq_len: PositiveInt | None = None
    """Longest prompt + output in tokens; None: the model's max_position_embeddings."""
    max_waiting_requests: PositiveInt = 4096
    """Requests queued in the engine beyond which submit refuses."""
    reservation_timeout_s: PositiveFloat = 30.0
    """Seconds a generation-side reservation waits for its KV to commit before it is freed."""
    sender_lease_s: PositiveFloat = 60.0
    """Seconds a prefill-side request keeps its blocks for a hand-over nobody acknowledged."""
    seed: NonNegativeInt = 0
    """Mixed into the seed of requests that come without one."""
    record_prefix_events: bool = True
    """Report prefix-cache stores and removals to the router (for KV-aware placement)."""

    @classmethod
    def config_error(cls, problem: ConfigProblem) -> Exception:
        if problem.kind is ProblemKind.UNKNOWN_KEY:
            return EngineInputError(problem.path, "unknown engine option")
        if problem.kind is ProblemKind.RULE and isinstance(problem.cause, EngineInputError):
            return EngineInputError(join_path(problem.path, problem.cause.field), problem.cause.message)
        return EngineInputError(problem.path, problem.detail)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_unit_tokens % self.tokens_per_block:
            raise EngineInputError(
                "chunk_unit_tokens",
                f"must be a multiple of tokens_per_block={self.tokens_per_block}, got {self.chunk_unit_tokens}",
            )
        if self.chunking_policy is not None and self.chunk_unit_tokens > self.max_num_tokens:
            raise EngineInputError(
                "chunk_unit_tokens", f"{self.chunk_unit_tokens} exceeds max_num_tokens {self.max_num_tokens}"
            )

    def with_overrides(self, **overrides: object) -> EngineConfig:
        """A copy with some fields replaced (policy and role names may be given as strings)."""
        return load_config(EngineConfig, {**msgspec.structs.asdict(self), **overrides})


@dataclass(frozen=True)
class SubmitRequest:
    """A request handed to an engine.

    `output_token_ids` are tokens this request already produced elsewhere (and that were already
    streamed): the engine replays them into its detokenizer and stop checker without emitting them
    again. For GENERATION_ONLY they are required (at least the first token, from the prefill
    instance) and the KV to receive covers prompt + output_token_ids[:-1]. For the other types,
    the context to compute is prompt + output_token_ids (a recomputation).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION
    output_token_ids: tuple[int, ...] = ()
    priority: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id or len(self.request_id) > 256:
            raise EngineInputError("request_id", "must be a non-empty string of at most 256 characters")
        if not self.prompt_token_ids:
            raise EngineInputError("prompt_token_ids", "must not be empty")
        if not isinstance(self.sampling_params, SamplingParams):
            raise EngineInputError("sampling_params", f"must be SamplingParams, got {type(self.sampling_params).__name__}")
        if not isinstance(self.request_type, RequestType):
            raise EngineInputError("request_type", f"must be a RequestType, got {self.request_type!r}")
        if self.request_type is RequestType.GENERATION_ONLY and not self.output_token_ids:
            raise EngineInputError("output_token_ids", "a GENERATION_ONLY request needs its first token")
        if len(self.output_token_ids) >= self.sampling_params.max_tokens:
            raise EngineInputError(
                "output_token_ids",
                f"{len(self.output_token_ids)} tokens already produced, max_tokens is {self.sampling_params.max_tokens}",
            )

    @property
    def context_token_ids(self) -> tuple[int, ...]:
        """The tokens whose KV this instance needs (computed, or received for GENERATION_ONLY)."""
        if self.request_type is RequestType.GENERATION_ONLY:
            return self.prompt_token_ids + self.output_token_ids[:-1]
        return self.prompt_token_ids + self.output_token_ids


class ErrorCode(enum.Enum):
    """Why a request ended without finishing normally (the router maps these to gRPC statuses)."""

    ABORTED = "ABORTED"  # cancelled by the client or the router
    TRANSFER_FAILED = "TRANSFER_FAILED"  # KV hand-over failed (see detail / transfer reason)
    LEASE_EXPIRED = "LEASE_EXPIRED"  # prefill side: nobody took the KV in time
    RESERVATION_EXPIRED = "RESERVATION_EXPIRED"  # generation side: the KV never arrived
    INTERNAL = "INTERNAL"  # a model or sampler failure


@dataclass(frozen=True)
class RequestError:
    code: ErrorCode
    detail: str = ""
    transfer_reason: str | None = None  # FailureReason name, for TRANSFER_FAILED


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: new tokens, their text, and whether it ended.

    A request's outputs are emitted in order; exactly one has `finished` True. `context_done` is
    set on the output that carries a CONTEXT_ONLY request's first token: from then on the request
    waits for its KV hand-over (DISAGG_CONTEXT_TRANS_IN_PROGRESS) unless it is `finished` already.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    logprobs: tuple[object, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: RequestError | None = None
    context_done: bool = False
    handed_over: bool = False  # CONTEXT_ONLY: the KV hand-over was acknowledged; the request is done here
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class StateEvent:
    request_id: str
    state: str  # an LlmRequestState name
    time_s: float
    detail: str = ""


@dataclass(frozen=True)
class Reservation:
    """Blocks a generation instance reserved for a request's incoming KV."""

    request_id: str
    transfer_id: str
    num_blocks: int
    num_tokens: int
    layout: KvLayout
    expires_at_s: float


@dataclass(frozen=True)
class EngineLoad:
    role: InstanceRole
    total_blocks: int
    free_blocks: int
    tokens_per_block: int
    queued_requests: int
    running_requests: int
    queued_prompt_tokens: int
    tokens_in_flight: int
    num_paused: int
    prefix_events: tuple[PrefixEvent, ...] = ()
    num_finished: int = 0
    extra: dict[str, float] = field(default_factory=dict)
