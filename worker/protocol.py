"""Everything that crosses the router/instance boundary, defined once, and the one codec for it.

The router (cluster/router/) and an instance (worker/instance.py) exchange the msgspec Structs of
this module, encoded by one generic msgpack `Encoder` and a `Decoder` per expected type: the shape
of vLLM's MsgpackEncoder / MsgpackDecoder (vllm/v1/serial_utils.py), without its pickle fallback.
Nothing here is ever pickled: a value msgspec cannot encode is an error.

What crosses:
- router -> instance, one `Command` per call: Submit, Abort, Push, Renew, Release, Poll, GetInfo,
  Ping, Drain, KvDigest, ReplaceTransferTls (worker/instance.py `Instance.handle` takes it);
- instance -> router, one `Reply`: Ack, Pong, Drained, Digest, InstanceInfo, PollBatch, or one of
  the two refusals: `Rejected` (the request's input was refused: a client error naming the field)
  and `Unavailable` (the instance is stopped, draining or its loop died);
- inside them: SubmitRequest (with worker/sampling.py's SamplingParams), RequestOutput (with
  worker/sampler_types.py's SampleLogprobs), StateEvent, RequestError, ReservationNotice,
  PushResult, EngineLoad (with scheduler/block_hash.py's PrefixEvent). Those dataclasses travel as
  they are: msgspec encodes dataclasses and runs their `__post_init__` checks on decode. PrefixEvent
  stays in scheduler/ because that package is standard library only.

The wire form of every message is an envelope, the msgpack array [PROTOCOL_VERSION, body]. A decoder
reads the version first and refuses a peer on another version with `ProtocolVersionMismatch`, which
names both, so an instance restarted on other code is never misread. Only then is the body decoded
into the expected type, which checks every field: types, unknown fields (refused), ranges (the
`__post_init__` of each type). Any defect is a `ProtocolError`. Messages are bounded by
`MAX_MESSAGE_BYTES` when encoded and before anything is decoded.

No torch here: the router imports this module.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import msgspec

from scheduler.block_hash import BLOCK_HASH_BYTES, PrefixEvent
from scheduler.config import NamedEnum
from scheduler.state import LlmRequestState
from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason
from worker.kv_transfer.tls import TlsConfig
from worker.sampler_types import SampleLogprobs
from worker.sampling import SamplingParams
from worker.stopping import FinishReason

# 2: msgspec Structs in a versioned envelope (1 was a hand-written msgpack map per message).
# 4: EngineLoad.pending_context_tokens (a version-3 peer would refuse it as an unknown field).
PROTOCOL_VERSION = 4
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Counters travel as msgpack integers; bounding them by int64 keeps every peer's decoder happy.
MAX_COUNTER = 2**63 - 1
# scheduler/block_hash.py makes 8-byte hashes read as unsigned little-endian integers.
MAX_BLOCK_HASH = 2 ** (8 * BLOCK_HASH_BYTES) - 1

# The detail of the StateEvent recorded when a request's first context chunk is scheduled (its
# state stays CONTEXT_INIT, so the router learns of it from this detail).
EVENT_PREFILL_STARTED = "prefill started"


class ProtocolError(ValueError):
    """A message that cannot be encoded, or bytes that do not decode into the expected message."""


class MessageTooLarge(ProtocolError):
    def __init__(self, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(f"message of {size_bytes} bytes exceeds the {limit_bytes}-byte limit")
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes


class ProtocolVersionMismatch(ProtocolError):
    """The peer speaks another protocol version (it runs other code): nothing it sent is read."""

    def __init__(self, peer_version: object) -> None:
        super().__init__(
            f"the peer speaks protocol version {peer_version!r}, this side speaks version {PROTOCOL_VERSION}; "
            "run both on the same code"
        )
        self.peer_version = peer_version


class EngineInputError(ValueError):
    """A request (or config) the engine refuses before it reaches the model; `.field` names why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# --- roles and request types ------------------------------------------------------------------------
class InstanceRole(NamedEnum, field="role", label="role"):
    """What an instance serves; configured by name in any case ("prefill")."""

    PREFILL = "PREFILL"
    GENERATION = "GENERATION"
    MIXED = "MIXED"


class RequestType(enum.Enum):
    """TensorRT-LLM's LlmRequestType: the whole request, or one half of a disaggregated one."""

    CONTEXT_AND_GENERATION = "CONTEXT_AND_GENERATION"
    CONTEXT_ONLY = "CONTEXT_ONLY"  # prefill, emit the first token, then hand the KV over
    GENERATION_ONLY = "GENERATION_ONLY"  # receive the KV and the first token, then generate


# Which request types each role runs. PREFILL instances only run context-only halves; a GENERATION
# instance runs generation-only halves and whole requests (the "recompute locally" recovery path,
# conditional disaggregation and the fallback); MIXED runs anything.
REQUEST_TYPES_BY_ROLE: Mapping[InstanceRole, frozenset[RequestType]] = MappingProxyType(
    {
        InstanceRole.PREFILL: frozenset({RequestType.CONTEXT_ONLY}),
        InstanceRole.GENERATION: frozenset({RequestType.GENERATION_ONLY, RequestType.CONTEXT_AND_GENERATION}),
        InstanceRole.MIXED: frozenset(RequestType),
    }
)


class ErrorCode(enum.Enum):
    """Why a request ended without finishing normally (the router maps these to gRPC statuses)."""

    ABORTED = "ABORTED"  # cancelled by the client or the router
    TRANSFER_FAILED = "TRANSFER_FAILED"  # KV hand-over failed (see detail / transfer reason)
    LEASE_EXPIRED = "LEASE_EXPIRED"  # prefill side: nobody took the KV in time
    RESERVATION_EXPIRED = "RESERVATION_EXPIRED"  # generation side: the KV never arrived
    INTERNAL = "INTERNAL"  # a model or sampler failure


# --- messages -----------------------------------------------------------------------------------------
class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every message: immutable, and a decoder refuses fields it does not know."""


def _check_counter(name: str, value: object, minimum: int = 0) -> None:
    # bool is an int subclass; a True where a count belongs is a producer bug, not a 1.
    if type(value) is not int:
        raise ValueError(f"{name}: expected an integer, got {type(value).__name__}")
    if not minimum <= value <= MAX_COUNTER:
        raise ValueError(f"{name}: {value} is outside [{minimum}, {MAX_COUNTER}]")


def _check_seconds(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {value!r}")


class SubmitRequest(_Message):
    """A request handed to an engine.

    `output_token_ids` are tokens this request already produced elsewhere (and that were already
    streamed): the engine replays them into its detokenizer and stop checker without emitting them
    again. For GENERATION_ONLY submitted after its prefill finished they are required (at least the
    first token, from the prefill instance) and the KV to receive covers prompt +
    output_token_ids[:-1]. A GENERATION_ONLY request submitted while its prefill still runs (an
    early reservation, `token_with_kv`) does not know that token yet: the KV to receive covers
    prompt + output_token_ids, and the next token arrives with the KV's commit. For the other
    types, the context to compute is prompt + output_token_ids (a recomputation).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION
    output_token_ids: tuple[int, ...] = ()
    priority: float = 0.5
    token_with_kv: bool = False  # GENERATION_ONLY only: the token after the context comes with the KV

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id or len(self.request_id) > 256:
            raise EngineInputError("request_id", "must be a non-empty string of at most 256 characters")
        if not self.prompt_token_ids:
            raise EngineInputError("prompt_token_ids", "must not be empty")
        if not isinstance(self.sampling_params, SamplingParams):
            raise EngineInputError("sampling_params", f"must be SamplingParams, got {type(self.sampling_params).__name__}")
        if not isinstance(self.request_type, RequestType):
            raise EngineInputError("request_type", f"must be a RequestType, got {self.request_type!r}")
        if self.token_with_kv and self.request_type is not RequestType.GENERATION_ONLY:
            raise EngineInputError("token_with_kv", "only a GENERATION_ONLY request receives a token with its KV")
        if self.request_type is RequestType.GENERATION_ONLY and not self.output_token_ids and not self.token_with_kv:
            raise EngineInputError("output_token_ids", "a GENERATION_ONLY request needs its first token")
        if len(self.output_token_ids) >= self.sampling_params.max_tokens:
            raise EngineInputError(
                "output_token_ids",
                f"{len(self.output_token_ids)} tokens already produced, max_tokens is {self.sampling_params.max_tokens}",
            )

    @property
    def context_token_ids(self) -> tuple[int, ...]:
        """The tokens whose KV this instance needs (computed, or received for GENERATION_ONLY)."""
        if self.request_type is RequestType.GENERATION_ONLY and not self.token_with_kv:
            return self.prompt_token_ids + self.output_token_ids[:-1]
        return self.prompt_token_ids + self.output_token_ids


class RequestError(_Message):
    code: ErrorCode
    detail: str = ""
    transfer_reason: str | None = None  # FailureReason name, for TRANSFER_FAILED


class RequestOutput(_Message):
    """What one step produced for one request: new tokens, their text, and whether it ended.

    A request's outputs are emitted in order; exactly one has `finished` True. `context_done` is
    set on the output that carries a CONTEXT_ONLY request's first token: from then on the request
    waits for its KV hand-over (DISAGG_CONTEXT_TRANS_IN_PROGRESS) unless it is `finished` already.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    logprobs: tuple[SampleLogprobs | None, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: RequestError | None = None
    context_done: bool = False
    handed_over: bool = False  # CONTEXT_ONLY: the KV hand-over was acknowledged; the request is done here
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class StateEvent(_Message):
    """A local state transition (the router mirrors these in its global state machine)."""

    request_id: str
    state: LlmRequestState  # the request's local state (TensorRT-LLM's numbering, scheduler/state.py)
    time_s: float
    detail: str = ""

    def __post_init__(self) -> None:
        if not math.isfinite(self.time_s):
            raise ValueError(f"time_s: expected a finite time, got {self.time_s!r}")


class ReservationNotice(_Message):
    """A generation instance reserved blocks for a request's KV: the sender pushes to `transfer_id`."""

    request_id: str
    transfer_id: str
    num_blocks: int
    expires_at_s: float
    lease_s: float = 0.0  # how long the reservation lives without a commit or a renewal


class PushResult(_Message):
    """How a prefill instance's push of a request's KV ended."""

    request_id: str
    transfer_id: str
    ok: bool
    reason: str | None  # a FailureReason name when not ok
    detail: str
    bytes_sent: int
    elapsed_s: float


class EngineLoad(_Message):
    """The load numbers the router places by, and the prefix-cache events since the previous load.

    Block counts are in the instance's KV pool; cached-but-unreferenced prefix blocks count as free.
    `queued_prompt_tokens` is the prompt demand of requests not yet admitted by the capacity scheduler;
    `pending_context_tokens` the prompt tokens still to compute, theirs and the uncomputed rest of every
    context in progress (a long prefill admitted in one step is queued for no poll at all, but pending
    for all of its chunks); `tokens_in_flight` is prompt plus generated tokens of the running
    requests. `prefix_events` are
    the full blocks (by scheduler/block_hash.py hash) stored in or removed from the prefix cache, in
    order.
    """

    role: InstanceRole
    total_blocks: int
    free_blocks: int
    tokens_per_block: int
    queued_requests: int = 0
    running_requests: int = 0
    queued_prompt_tokens: int = 0
    tokens_in_flight: int = 0
    num_paused: int = 0
    prefix_events: tuple[PrefixEvent, ...] = ()
    num_finished: int = 0
    pending_context_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.role, InstanceRole):
            raise ValueError(f"role: expected an InstanceRole, got {self.role!r}")
        _check_counter("total_blocks", self.total_blocks, minimum=1)
        _check_counter("free_blocks", self.free_blocks)
        if self.free_blocks > self.total_blocks:
            raise ValueError(f"free_blocks: {self.free_blocks} exceeds total_blocks {self.total_blocks}")
        _check_counter("tokens_per_block", self.tokens_per_block, minimum=1)
        for name in ("queued_requests", "running_requests", "queued_prompt_tokens", "tokens_in_flight", "num_paused",
                     "num_finished", "pending_context_tokens"):
            _check_counter(name, getattr(self, name))
        if self.pending_context_tokens < self.queued_prompt_tokens:
            raise ValueError(
                f"pending_context_tokens: {self.pending_context_tokens} is less than queued_prompt_tokens "
                f"{self.queued_prompt_tokens}, which it includes"
            )
        if not isinstance(self.prefix_events, tuple):
            raise ValueError("prefix_events: expected a tuple of PrefixEvent")
        for event in self.prefix_events:
            if not isinstance(event, PrefixEvent):
                raise ValueError(f"prefix_events: expected PrefixEvent, got {type(event).__name__}")
            if type(event.block_hash) is not int or not 0 <= event.block_hash <= MAX_BLOCK_HASH:
                raise ValueError(f"prefix_events: {event.block_hash!r} is not an unsigned 64-bit block hash")

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def queued_prompt_blocks(self) -> int:
        """Blocks the queued-but-not-admitted prompts will need (rounded up)."""
        return -(-self.queued_prompt_tokens // self.tokens_per_block)


# --- replies ------------------------------------------------------------------------------------------
class _Reply(_Message, tag=True):
    """Base of the replies: tagged by class name, so a decoder tells them apart."""


class InstanceInfo(_Reply):
    instance_id: str
    role: InstanceRole
    incarnation: str  # changes on every (re)start of the instance process
    transfer_address: str  # host:port of its KV transfer server ("" if it receives none)
    layout: KvLayout
    num_blocks: int
    vocab_size: int
    max_seq_len: int
    pid: int
    device: str
    node_id: str = ""  # the Ray node hosting it (its hostname outside Ray)
    architecture: str = ""  # the model's architecture (LlamaForCausalLM, ...), for what users read


class PollBatch(_Reply):
    """Everything an instance reports since the previous poll, in order."""

    incarnation: str
    sequence: int
    outputs: tuple[RequestOutput, ...] = ()
    events: tuple[StateEvent, ...] = ()
    reservations: tuple[ReservationNotice, ...] = ()
    push_results: tuple[PushResult, ...] = ()
    load: EngineLoad | None = None


class Ack(_Reply):
    """The command was taken (submit, abort, push, release)."""


class Pong(_Reply):
    incarnation: str


class Drained(_Reply):
    unfinished: int  # requests still in the engine when the drain gave up


class Digest(_Reply):
    sha256: str


class Rejected(_Reply):
    """The instance refused the request's input: a client error, never a health signal."""

    field: str
    message: str


class Unavailable(_Reply):
    """The instance is not taking work: stopped, draining, or its engine loop died."""

    reason: str


Reply = InstanceInfo | PollBatch | Ack | Pong | Drained | Digest | Rejected | Unavailable


# --- commands -----------------------------------------------------------------------------------------
class _Command(_Message, tag=True):
    """Base of the commands: tagged by class name, so `Instance.handle` dispatches on the type."""


class Submit(_Command):
    """Queue a request (Ack, or Rejected naming the field the engine refused)."""

    request: SubmitRequest


class Abort(_Command):
    """End a request in any state and free its blocks."""

    request_id: str
    detail: str = "aborted"


class Push(_Command):
    """Push a CONTEXT_ONLY request's KV to a generation instance's reservation: at once when its KV
    is final, otherwise the moment its context completes (an early reservation, relayed while the
    prefill runs; a later Push replaces one still waiting). The commit carries the request's output
    tokens, so the receiver decodes without waiting for anyone. `target_request_id` is the
    request's id on the receiver (None: the same id)."""

    request_id: str
    target: str  # host:port of the receiver's KV transfer server
    transfer_id: str
    deadline_s: float
    target_request_id: str | None = None

    def __post_init__(self) -> None:
        _check_seconds("deadline_s", self.deadline_s)


class Renew(_Command):
    """Extend the reservations of these GENERATION_ONLY requests by their lease (early reservations
    wait for a prefill that may queue longer than one lease). Ids without a live reservation are
    skipped."""

    request_ids: tuple[str, ...]


class Release(_Command):
    """Give up a CONTEXT_ONLY request's hand-over: DISAGG_TRANS_ERROR, blocks freed."""

    request_id: str
    reason: FailureReason
    detail: str = ""


class Poll(_Command):
    """Everything reported since the last poll (a PollBatch); waits up to timeout_s for something."""

    timeout_s: float

    def __post_init__(self) -> None:
        _check_seconds("timeout_s", self.timeout_s)


class GetInfo(_Command):
    """The instance's InstanceInfo."""


class Ping(_Command):
    """Cheap liveness probe: a Pong with the incarnation (changes when the process restarts)."""


class Drain(_Command):
    """Stop taking requests, let the admitted ones finish (Drained: how many were left)."""

    timeout_s: float

    def __post_init__(self) -> None:
        _check_seconds("timeout_s", self.timeout_s)


class KvDigest(_Command):
    """sha256 of a request's KV for token positions [0, num_tokens), every layer (tests and audits)."""

    request_id: str
    num_tokens: int


class ReplaceTransferTls(_Command):
    """Use this certificate and key (reissued by the deployer's CA when the instance restarted) on
    the KV transfer path from now on, as receiver and as sender. Ack; Rejected when the instance's
    transfers are plain TCP (it has no certificate to replace)."""

    tls: TlsConfig


Command = Submit | Abort | Push | Renew | Release | Poll | GetInfo | Ping | Drain | KvDigest | ReplaceTransferTls


# --- the codec ----------------------------------------------------------------------------------------
class _Envelope(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    version: int
    body: msgspec.Raw


class _LegacyHeader(msgspec.Struct, frozen=True):
    """Version 1 sent maps with the version under "v" (poll batches only)."""

    v: int


_DECODE_ERRORS = (msgspec.DecodeError, RecursionError)  # msgspec recurses into nested unknown fields

T = TypeVar("T")


class Encoder:
    """Encodes any message of this module in its envelope; refuses one over `max_message_bytes`."""

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._max_message_bytes = max_message_bytes

    def encode(self, message: object) -> bytes:
        try:
            data = self._encoder.encode((PROTOCOL_VERSION, message))
        except (TypeError, ValueError, OverflowError) as error:
            raise ProtocolError(f"cannot encode {type(message).__name__}: {error}") from None
        if len(data) > self._max_message_bytes:
            raise MessageTooLarge(len(data), self._max_message_bytes)
        return data


class Decoder(Generic[T]):
    """Decodes and validates one expected type (a message class or a union such as `Command`)."""

    def __init__(self, message_type: Any, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._name = getattr(message_type, "__name__", None) or str(message_type)
        self._envelope = msgspec.msgpack.Decoder(_Envelope)
        self._legacy = msgspec.msgpack.Decoder(_LegacyHeader)
        self._body = msgspec.msgpack.Decoder(message_type)
        self._max_message_bytes = max_message_bytes

    def decode(self, data: bytes | bytearray | memoryview) -> T:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"expected bytes, got {type(data).__name__}")
        size = memoryview(data).nbytes
        if size > self._max_message_bytes:
            raise MessageTooLarge(size, self._max_message_bytes)
        try:
            envelope = self._envelope.decode(data)
        except _DECODE_ERRORS as error:
            legacy = self._legacy_version(data)
            if legacy is not None:
                raise ProtocolVersionMismatch(legacy) from None
            raise ProtocolError(f"not a protocol message: {error}") from None
        if envelope.version != PROTOCOL_VERSION:
            raise ProtocolVersionMismatch(envelope.version)
        try:
            return self._body.decode(envelope.body)
        except _DECODE_ERRORS as error:
            # Chained: a field check's own error (EngineInputError, InvalidSamplingParams) is the
            # cause of msgspec's ValidationError, so the receiver can name the field.
            raise ProtocolError(f"malformed {self._name}: {error}") from error

    def _legacy_version(self, data: bytes | bytearray | memoryview) -> int | None:
        try:
            return self._legacy.decode(data).v
        except _DECODE_ERRORS:
            return None
