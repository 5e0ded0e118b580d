"""Protobuf <-> router types, on the server side of the client API.

Inbound, `client_request_from_proto` turns a `GenerateRequest` into a validated `ClientRequest`
or raises `RequestValidationError` naming the offending field by its protobuf path
("sampling.temperature", "token_ids", "timeout"), so the front end can reply INVALID_ARGUMENT
before the router sees anything. Outbound, the `*_to_proto` functions render router events and
views as wire messages. No grpc here: the front end owns statuses and calls.

Floats arrive as float32 on the wire (`optional float temperature`); they are widened to the
shortest decimal that round-trips through float32, so `temperature=0.7` sent over gRPC samples
exactly like `SamplingParams(temperature=0.7)` given to the offline API.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from cluster.router.api import (
    ClientRequest,
    ClusterView,
    FinalEvent,
    InstanceHealthView,
    InstanceUse,
    RequestView,
    TimelineEntry,
    TokenEvent,
    Usage,
)
from duet_wire.v1 import client_pb2 as pb
from worker.kv_transfer.ids import MAX_CLIENT_REQUEST_ID_CHARS, request_id_problem
from worker.protocol import InstanceRole
from worker.sampler_types import SampleLogprobs
from worker.sampling import InvalidSamplingParams, SamplingParams
from worker.tokenizer import ChatTemplateError

# (messages, add_generation_prompt) -> prompt token ids: worker/tokenizer.py's chat_prompt_ids with
# the served model's tokenizer and template.
ChatEncoder = Callable[[list[dict[str, str]], bool], list[int]]

DEFAULT_MAX_TOKENS = 16  # as vLLM
DEFAULT_PRIORITY = 0.5  # as TensorRT-LLM
MAX_PROMPT_TEXT_BYTES = 1 << 20
MAX_TIMEOUT_S = 3600.0
MAX_REQUEST_ID_CHARS = 128  # a router's id in a RequestRef: a client's id, or one the router made

_FLOAT_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_OPTIONAL_INT_SAMPLING_FIELDS = ("top_k", "seed", "logprobs", "min_tokens")

_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_ROLES = {
    InstanceRole.PREFILL: pb.INSTANCE_ROLE_PREFILL,
    InstanceRole.GENERATION: pb.INSTANCE_ROLE_GENERATION,
    InstanceRole.MIXED: pb.INSTANCE_ROLE_MIXED,
}
_HEALTH = {
    InstanceHealthView.HEALTHY: pb.INSTANCE_HEALTH_HEALTHY,
    InstanceHealthView.DEGRADED: pb.INSTANCE_HEALTH_DEGRADED,
    InstanceHealthView.UNHEALTHY: pb.INSTANCE_HEALTH_UNHEALTHY,
    InstanceHealthView.DRAINING: pb.INSTANCE_HEALTH_DRAINING,
}


class RequestValidationError(ValueError):
    """A client request that breaks a rule; `field` is the protobuf path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ModelLimits:
    """What a prompt is checked against: the served model's vocabulary and context length."""

    vocab_size: int
    max_seq_len: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must leave room for a prompt and one token, got {self.max_seq_len}")


# ---- inbound ---------------------------------------------------------------------------------


def widen_float32(value: float) -> float:
    """The shortest decimal that float32-rounds to `value` (0.699999988 -> 0.7); NaN/inf unchanged."""
    if not math.isfinite(value):
        return value
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value


def check_request_id(value: str, field: str, limit: int = MAX_CLIENT_REQUEST_ID_CHARS) -> str:
    """An id follows the one request-id rule (worker/kv_transfer/ids.py): 1..limit printable
    ASCII characters, spaces included, so that it crosses every hop and the KV path as it is."""
    problem = request_id_problem(value, limit)
    if problem is not None:
        raise RequestValidationError(field, problem)
    return value


def sampling_from_proto(message: pb.SamplingParams, max_tokens_default: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults; range errors name "sampling.<field>"."""
    kwargs: dict[str, object] = {
        "max_tokens": message.max_tokens if message.HasField("max_tokens") else max_tokens_default,
        "stop": tuple(message.stop),
        "stop_token_ids": tuple(message.stop_token_ids),
        "ignore_eos": message.ignore_eos,
        "include_stop_str_in_output": message.include_stop_str_in_output,
    }
    for name in _FLOAT_SAMPLING_FIELDS:
        if message.HasField(name):
            kwargs[name] = widen_float32(getattr(message, name))
    for name in _OPTIONAL_INT_SAMPLING_FIELDS:
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    if message.HasField("skip_special_tokens"):
        kwargs["skip_special_tokens"] = message.skip_special_tokens
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except InvalidSamplingParams as error:
        raise RequestValidationError(f"sampling.{error.field}", error.message) from None


_NANOS_PER_SECOND = 1_000_000_000


def timeout_from_proto(request: pb.GenerateRequest) -> float | None:
    if not request.HasField("timeout"):
        return None
    seconds, nanos = request.timeout.seconds, request.timeout.nanos
    # Only protobuf's normal form (|nanos| below one second, and nanos never of the other sign than
    # seconds) is taken: summing any other form would accept a value a stricter peer refuses.
    if not -_NANOS_PER_SECOND < nanos < _NANOS_PER_SECOND:
        raise RequestValidationError("timeout", f"nanos must be within +-999999999, got {nanos}")
    if (seconds > 0 and nanos < 0) or (seconds < 0 and nanos > 0):
        raise RequestValidationError("timeout", f"seconds ({seconds}) and nanos ({nanos}) must not differ in sign")
    timeout_s = seconds + nanos / 1e9
    if not timeout_s > 0.0:
        raise RequestValidationError("timeout", f"must be > 0, got {timeout_s:g} s")
    if timeout_s > MAX_TIMEOUT_S:
        raise RequestValidationError("timeout", f"must be at most {MAX_TIMEOUT_S:g} s, got {timeout_s:g} s")
    return timeout_s


def client_request_from_proto(
    request: pb.GenerateRequest,
    limits: ModelLimits,
    tokenize: Callable[[str], list[int]],
    *,
    call_time_remaining_s: float | None = None,
    chat: ChatEncoder | None = None,
) -> ClientRequest:
    """Validate every rule of the client API and build the router's request.

    `call_time_remaining_s` is what is left of the gRPC deadline; the request's timeout becomes the
    smaller of it and the request's own. Cheap checks run before tokenizing (which is O(prompt)).
    `chat` renders a conversation (`messages`) into prompt ids with the served model's chat
    template; without it, `messages` is refused.
    """
    prompt_kind = request.WhichOneof("prompt")
    if prompt_kind is None:
        raise RequestValidationError("prompt", "exactly one of text / token_ids / messages is required")
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    if prompt_kind == "messages":
        prompt_ids = chat_prompt_from_proto(request.messages, limits, chat)
    elif prompt_kind == "text":
        prompt_text = request.text
        if not prompt_text:
            raise RequestValidationError("text", "must not be empty")
        size_bytes = len(prompt_text.encode("utf-8"))
        if size_bytes > MAX_PROMPT_TEXT_BYTES:
            raise RequestValidationError(
                "text", f"must be at most {MAX_PROMPT_TEXT_BYTES} bytes of UTF-8, got {size_bytes}"
            )
    else:
        prompt_ids = tuple(request.token_ids.ids)
        if not prompt_ids:
            raise RequestValidationError("token_ids", "must not be empty")
        check_prompt_length(len(prompt_ids), "token_ids", limits)
        largest = max(prompt_ids)
        if largest >= limits.vocab_size:
            raise RequestValidationError(
                "token_ids", f"id {largest} is outside the vocabulary of {limits.vocab_size}"
            )

    sampling = sampling_from_proto(request.sampling)
    try:
        sampling.validate_against(limits.vocab_size)
    except InvalidSamplingParams as error:
        raise RequestValidationError(f"sampling.{error.field}", error.message) from None

    client_request_id = None
    if request.HasField("client_request_id"):
        client_request_id = check_request_id(request.client_request_id, "client_request_id")

    timeout_s = timeout_from_proto(request)
    if call_time_remaining_s is not None:
        timeout_s = call_time_remaining_s if timeout_s is None else min(timeout_s, call_time_remaining_s)

    priority = DEFAULT_PRIORITY
    if request.HasField("priority"):
        priority = widen_float32(request.priority)
        if not 0.0 <= priority <= 1.0:  # False for NaN too
            raise RequestValidationError("priority", f"must be in [0, 1], got {priority}")

    if prompt_text is not None:
        # Tokenized once, here: the router gets the token ids.
        prompt_ids = tuple(tokenize(prompt_text))
        if not prompt_ids:
            raise RequestValidationError("text", "tokenizes to no tokens")
        check_prompt_length(len(prompt_ids), "text", limits)
    assert prompt_ids is not None
    prompt_length = len(prompt_ids)
    if prompt_length + sampling.max_tokens > limits.max_seq_len:
        raise RequestValidationError(
            "sampling.max_tokens",
            f"prompt ({prompt_length} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
            f"model's context of {limits.max_seq_len} tokens",
        )
    return ClientRequest(
        prompt_text=None,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        client_request_id=client_request_id,
        timeout_s=timeout_s,
        priority=priority,
        validated=True,
    )


def chat_prompt_from_proto(messages: pb.ChatMessages, limits: ModelLimits, chat: ChatEncoder | None) -> tuple[int, ...]:
    """A conversation's prompt ids, checked like a prompt's; template errors name "messages"."""
    if chat is None:
        raise RequestValidationError("messages", "this server does not render chat templates")
    if not messages.messages:
        raise RequestValidationError("messages.messages", "must not be empty")
    size_bytes = sum(len(m.content.encode("utf-8")) + len(m.role.encode("utf-8")) for m in messages.messages)
    if size_bytes > MAX_PROMPT_TEXT_BYTES:
        raise RequestValidationError("messages", f"must be at most {MAX_PROMPT_TEXT_BYTES} bytes of UTF-8, got {size_bytes}")
    add_generation_prompt = messages.add_generation_prompt if messages.HasField("add_generation_prompt") else True
    try:
        ids = tuple(chat([{"role": m.role, "content": m.content} for m in messages.messages], add_generation_prompt))
    except ChatTemplateError as error:
        raise RequestValidationError("messages", str(error)) from None
    if not ids:
        raise RequestValidationError("messages", "render to no tokens")
    check_prompt_length(len(ids), "messages", limits)
    if max(ids) >= limits.vocab_size:
        raise RequestValidationError("messages", f"id {max(ids)} is outside the vocabulary of {limits.vocab_size}")
    return ids


def check_prompt_length(length: int, field: str, limits: ModelLimits) -> None:
    if length > limits.max_seq_len - 1:
        raise RequestValidationError(
            field,
            f"prompt is {length} tokens; the model's context of {limits.max_seq_len} tokens allows at "
            f"most {limits.max_seq_len - 1}",
        )


def request_ref_from_proto(ref: pb.RequestRef, field: str = "request") -> tuple[str | None, str | None]:
    """(request_id, client_request_id), exactly one set."""
    kind = ref.WhichOneof("id")
    if kind == "request_id":
        return check_request_id(ref.request_id, f"{field}.request_id", MAX_REQUEST_ID_CHARS), None
    if kind == "client_request_id":
        return None, check_request_id(ref.client_request_id, f"{field}.client_request_id")
    raise RequestValidationError(field, "exactly one of request_id / client_request_id is required")


# ---- outbound --------------------------------------------------------------------------------


def timestamp(time_s: float) -> Timestamp:
    seconds = math.floor(time_s)
    nanos = min(int(round((time_s - seconds) * 1e9)), 999_999_999)
    return Timestamp(seconds=seconds, nanos=nanos)


def _token_logprob(entry: SampleLogprobs | None, token_id: int) -> pb.TokenLogprob:
    if entry is None:
        # A position without logprobs inside a delta that has some: keep the one-per-token shape.
        return pb.TokenLogprob(token_id=token_id, logprob=float("nan"))
    return pb.TokenLogprob(
        token_id=entry.sampled.token_id,
        logprob=entry.sampled.logprob,
        top=[pb.TopLogprob(token_id=top.token_id, logprob=top.logprob) for top in entry.top],
    )


def token_event_to_proto(request_id: str, event: TokenEvent) -> pb.GenerateResponse:
    delta = pb.TokenDelta(token_ids=event.token_ids, text=event.text)
    if event.logprobs and any(entry is not None for entry in event.logprobs):
        delta.logprobs.extend(
            _token_logprob(entry, token_id) for entry, token_id in zip(event.logprobs, event.token_ids, strict=False)
        )
    return pb.GenerateResponse(request_id=request_id, delta=delta)


def timeline_to_proto(entries: tuple[TimelineEntry, ...]) -> list[pb.StateEvent]:
    return [
        pb.StateEvent(
            state=entry.state, timestamp=timestamp(entry.time_s), instance_id=entry.instance_id, detail=entry.detail
        )
        for entry in entries
    ]


def instances_to_proto(uses: tuple[InstanceUse, ...]) -> list[pb.InstanceUse]:
    return [
        pb.InstanceUse(instance_id=use.instance_id, role=_ROLES[use.role], phase=use.phase, attempt=use.attempt)
        for use in uses
    ]


def usage_to_proto(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )


def final_event_to_result(event: FinalEvent) -> pb.GenerateResult:
    result = pb.GenerateResult(
        finish_reason=_FINISH_REASONS.get(event.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
        usage=usage_to_proto(event.usage),
        timeline=timeline_to_proto(event.timeline),
        instances=instances_to_proto(event.instances),
    )
    # bool is an int: never let True pass as token id 1.
    if isinstance(event.stop_reason, str):
        result.stop_string = event.stop_reason
    elif isinstance(event.stop_reason, int) and not isinstance(event.stop_reason, bool):
        result.stop_token_id = event.stop_reason
    return result


def final_event_to_proto(request_id: str, event: FinalEvent) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id, result=final_event_to_result(event))


def request_view_to_proto(view: RequestView) -> pb.GetRequestResponse:
    response = pb.GetRequestResponse(
        request_id=view.request_id,
        state=view.state,
        timeline=timeline_to_proto(view.timeline),
        instances=instances_to_proto(view.instances),
        error=view.error,
    )
    if view.client_request_id is not None:
        response.client_request_id = view.client_request_id
    if view.final is not None:
        response.result.CopyFrom(final_event_to_result(view.final))
    return response


def cluster_view_to_proto(view: ClusterView) -> pb.ClusterStatusResponse:
    return pb.ClusterStatusResponse(
        instances=[
            pb.InstanceStatus(
                instance_id=instance.instance_id,
                role=_ROLES[instance.role],
                address=instance.address,
                health=_HEALTH[instance.health],
                load=pb.InstanceLoad(
                    free_blocks=instance.free_blocks,
                    total_blocks=instance.total_blocks,
                    cached_blocks=instance.cached_blocks,
                    queued_requests=instance.queued_requests,
                    running_requests=instance.running_requests,
                    active_transfers=instance.active_transfers,
                ),
                last_report=timestamp(instance.last_report_s),
            )
            for instance in view.instances
        ],
        queue_depth=view.queue_depth,
        requests_by_state=dict(view.requests_by_state),
        requests_by_outcome=dict(view.requests_by_outcome),
        fallbacks=list(view.fallbacks),
        max_recovery_attempts=view.max_recovery_attempts,
        placement_policy=view.placement_policy,
        timestamp=timestamp(view.timestamp_s),
        model=None if view.model is None else pb.ModelStatus(
            name=view.model.model,
            architecture=view.model.architecture,
            dtype=view.model.dtype,
            max_model_len=view.model.max_model_len,
            kv_capacity_tokens=view.model.kv_capacity_tokens,
        ),
    )
