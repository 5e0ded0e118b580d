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
import math
from dataclasses import dataclass, field

from scheduler.block_manager import PrefixEvent
from scheduler.config import CapacitySchedulerPolicy, ContextChunkingPolicy
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


class InstanceRole(enum.Enum):
    PREFILL = "PREFILL"
    GENERATION = "GENERATION"
    MIXED = "MIXED"

    @classmethod
    def parse(cls, value: str | InstanceRole) -> InstanceRole:
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise EngineInputError("role", f"unknown role {value!r}; expected one of {[r.name for r in cls]}") from None


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


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EngineInputError(name, f"must be a positive integer, got {value!r}")


def _positive_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise EngineInputError(name, f"must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    role: InstanceRole = InstanceRole.MIXED
    tokens_per_block: int = 16
    # KV pool size: `num_blocks` if given, else as many blocks as fit in kv_cache_bytes.
    num_blocks: int | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_requests: int = 64  # requests holding KV at once (capacity scheduler)
    max_batch_size: int = 64  # requests per forward step (micro-batch scheduler)
    max_num_tokens: int = 2048  # tokens per forward step
    capacity_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    chunking_policy: ContextChunkingPolicy | None = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    chunk_unit_tokens: int = 256  # a multiple of tokens_per_block
    enable_prefix_reuse: bool = True
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    max_waiting_requests: int = 4096  # requests queued in the engine beyond which submit refuses
    # Hand-over bounds: a generation-side reservation is freed if no KV commits within
    # reservation_timeout_s; a prefill-side request frees its blocks if the hand-over has not been
    # acknowledged within sender_lease_s.
    reservation_timeout_s: float = 30.0
    sender_lease_s: float = 60.0
    seed: int = 0  # mixed into the seed of requests that come without one
    record_prefix_events: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.role, InstanceRole):
            raise EngineInputError("role", f"must be an InstanceRole, got {self.role!r}")
        for name in ("tokens_per_block", "kv_cache_bytes", "max_num_requests", "max_batch_size", "max_num_tokens",
                     "chunk_unit_tokens", "max_waiting_requests"):
            _positive_int(name, getattr(self, name))
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks)
        if self.max_seq_len is not None:
            _positive_int("max_seq_len", self.max_seq_len)
        if not isinstance(self.capacity_policy, CapacitySchedulerPolicy):
            raise EngineInputError("capacity_policy", f"must be a CapacitySchedulerPolicy, got {self.capacity_policy!r}")
        if self.chunking_policy is not None and not isinstance(self.chunking_policy, ContextChunkingPolicy):
            raise EngineInputError("chunking_policy", f"must be a ContextChunkingPolicy or None, got {self.chunking_policy!r}")
        if self.chunk_unit_tokens % self.tokens_per_block:
            raise EngineInputError(
                "chunk_unit_tokens",
                f"must be a multiple of tokens_per_block={self.tokens_per_block}, got {self.chunk_unit_tokens}",
            )
        if self.chunking_policy is not None and self.chunk_unit_tokens > self.max_num_tokens:
            raise EngineInputError(
                "chunk_unit_tokens", f"{self.chunk_unit_tokens} exceeds max_num_tokens {self.max_num_tokens}"
            )
        _positive_seconds("reservation_timeout_s", self.reservation_timeout_s)
        _positive_seconds("sender_lease_s", self.sender_lease_s)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise EngineInputError("seed", f"must be a non-negative integer, got {self.seed!r}")

    def with_overrides(self, **overrides: object) -> EngineConfig:
        """A copy with some fields replaced (policy names may be given as strings)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        for name, value in overrides.items():
            if name not in values:
                raise EngineInputError(name, "unknown engine option")
            if name == "role":
                value = InstanceRole.parse(value)  # type: ignore[arg-type]
            elif name == "capacity_policy":
                value = CapacitySchedulerPolicy.parse(value)  # type: ignore[arg-type]
            elif name == "chunking_policy" and value is not None:
                value = ContextChunkingPolicy.parse(value)  # type: ignore[arg-type]
            values[name] = value
        return EngineConfig(**values)  # type: ignore[arg-type]


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
