"""What crosses between the router and an instance, as msgpack (never pickle), with size limits.

The router calls instance actors with these encoded payloads and decodes what `poll` returns; both
sides validate what they decode. No torch here: the router imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from scheduler.block_manager import PrefixEvent, PrefixEventKind
from worker.engine_types import (
    EngineLoad,
    ErrorCode,
    InstanceRole,
    RequestError,
    RequestOutput,
    RequestType,
    StateEvent,
    SubmitRequest,
)
from worker.kv_layout import KvLayout
from worker.sampler_types import SampleLogprobs, TokenLogprob
from worker.sampling import SamplingParams
from worker.stopping import FinishReason

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A payload that does not decode into the expected message."""


def _pack(value: Any) -> bytes:
    data = msgpack.packb(value, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return data


def _unpack(data: bytes) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise ProtocolError(f"undecodable message: {error}") from None


def _get(mapping: Mapping, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise ProtocolError(f"{where}: missing field {key!r}")
    value = mapping[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"{where}.{key}: expected {kind}, got {type(value).__name__}")
    return value


# --- submit -----------------------------------------------------------------------------------------
def encode_submit(submit: SubmitRequest) -> bytes:
    return _pack(
        {
            "request_id": submit.request_id,
            "prompt_token_ids": list(submit.prompt_token_ids),
            "sampling_params": submit.sampling_params.to_dict(),
            "request_type": submit.request_type.value,
            "output_token_ids": list(submit.output_token_ids),
            "priority": submit.priority,
        }
    )


def decode_submit(data: bytes) -> SubmitRequest:
    message = _unpack(data)
    where = "submit"
    try:
        request_type = RequestType(_get(message, "request_type", str, where))
    except ValueError:
        raise ProtocolError(f"{where}: unknown request_type") from None
    return SubmitRequest(
        request_id=_get(message, "request_id", str, where),
        prompt_token_ids=tuple(_get(message, "prompt_token_ids", list, where)),
        sampling_params=SamplingParams.from_dict(_get(message, "sampling_params", dict, where)),
        request_type=request_type,
        output_token_ids=tuple(_get(message, "output_token_ids", list, where)),
        priority=float(_get(message, "priority", (int, float), where)),
    )


# --- instance info ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InstanceInfo:
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


def encode_info(info: InstanceInfo) -> bytes:
    return _pack(
        {
            "instance_id": info.instance_id,
            "role": info.role.value,
            "incarnation": info.incarnation,
            "transfer_address": info.transfer_address,
            "layout": {k: getattr(info.layout, k) for k in KvLayout.__dataclass_fields__},
            "num_blocks": info.num_blocks,
            "vocab_size": info.vocab_size,
            "max_seq_len": info.max_seq_len,
            "pid": info.pid,
            "device": info.device,
            "node_id": info.node_id,
        }
    )


def decode_info(data: bytes) -> InstanceInfo:
    m = _unpack(data)
    where = "info"
    try:
        role = InstanceRole(_get(m, "role", str, where))
        layout = KvLayout(**_get(m, "layout", dict, where))
    except (ValueError, TypeError) as error:
        raise ProtocolError(f"{where}: {error}") from None
    return InstanceInfo(
        instance_id=_get(m, "instance_id", str, where),
        role=role,
        incarnation=_get(m, "incarnation", str, where),
        transfer_address=_get(m, "transfer_address", str, where),
        layout=layout,
        num_blocks=_get(m, "num_blocks", int, where),
        vocab_size=_get(m, "vocab_size", int, where),
        max_seq_len=_get(m, "max_seq_len", int, where),
        pid=_get(m, "pid", int, where),
        device=_get(m, "device", str, where),
        node_id=_get(m, "node_id", str, where),
    )


# --- poll batches -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReservationNotice:
    request_id: str
    transfer_id: str
    num_blocks: int
    expires_at_s: float


@dataclass(frozen=True)
class PushResult:
    request_id: str
    transfer_id: str
    ok: bool
    reason: str | None  # a FailureReason name when not ok
    detail: str
    bytes_sent: int
    elapsed_s: float


@dataclass(frozen=True)
class PollBatch:
    """Everything an instance reports since the previous poll, in order."""

    incarnation: str
    sequence: int
    outputs: tuple[RequestOutput, ...] = ()
    events: tuple[StateEvent, ...] = ()
    reservations: tuple[ReservationNotice, ...] = ()
    push_results: tuple[PushResult, ...] = ()
    load: EngineLoad | None = None
    rejected: tuple[tuple[str, str, str], ...] = ()  # (request_id, field, message) refused at submit
    extra: dict[str, Any] = field(default_factory=dict)


def _encode_logprobs(entry: object) -> Any:
    if entry is None:
        return None
    assert isinstance(entry, SampleLogprobs)
    return [
        entry.sampled.token_id,
        entry.sampled.logprob,
        entry.rank,
        [[t.token_id, t.logprob] for t in entry.top],
    ]


def _decode_logprobs(value: Any) -> SampleLogprobs | None:
    if value is None:
        return None
    try:
        token, logprob, rank, top = value
        return SampleLogprobs(
            TokenLogprob(int(token), float(logprob)), int(rank), tuple(TokenLogprob(int(t), float(lp)) for t, lp in top)
        )
    except (TypeError, ValueError):
        raise ProtocolError("malformed logprobs entry") from None


def _encode_output(o: RequestOutput) -> dict:
    return {
        "id": o.request_id,
        "tokens": list(o.new_token_ids),
        "text": o.text_delta,
        "logprobs": [_encode_logprobs(e) for e in o.logprobs],
        "finished": o.finished,
        "finish_reason": None if o.finish_reason is None else o.finish_reason.value,
        "stop_reason": o.stop_reason,
        "error": None
        if o.error is None
        else {"code": o.error.code.value, "detail": o.error.detail, "transfer_reason": o.error.transfer_reason},
        "context_done": o.context_done,
        "handed_over": o.handed_over,
        "counts": [o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens],
    }


def _decode_output(m: Mapping) -> RequestOutput:
    where = "output"
    error = m.get("error")
    try:
        finish = m.get("finish_reason")
        finish_reason = None if finish is None else FinishReason(finish)
        request_error = (
            None
            if error is None
            else RequestError(ErrorCode(error["code"]), str(error.get("detail", "")), error.get("transfer_reason"))
        )
        prompt, produced, cached = _get(m, "counts", list, where)
    except (ValueError, KeyError, TypeError) as failure:
        raise ProtocolError(f"{where}: {failure}") from None
    stop_reason = m.get("stop_reason")
    if stop_reason is not None and not isinstance(stop_reason, (int, str)):
        raise ProtocolError(f"{where}.stop_reason: expected int or str")
    return RequestOutput(
        request_id=_get(m, "id", str, where),
        new_token_ids=tuple(_get(m, "tokens", list, where)),
        text_delta=_get(m, "text", str, where),
        logprobs=tuple(_decode_logprobs(e) for e in _get(m, "logprobs", list, where)),
        finished=_get(m, "finished", bool, where),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        error=request_error,
        context_done=_get(m, "context_done", bool, where),
        handed_over=_get(m, "handed_over", bool, where),
        num_prompt_tokens=int(prompt),
        num_output_tokens=int(produced),
        num_cached_tokens=int(cached),
    )


def _encode_load(load: EngineLoad) -> dict:
    return {
        "role": load.role.value,
        "blocks": [load.total_blocks, load.free_blocks, load.tokens_per_block],
        "requests": [load.queued_requests, load.running_requests, load.num_paused, load.num_finished],
        "tokens": [load.queued_prompt_tokens, load.tokens_in_flight],
        "prefix": [[e.kind.value, e.block_hash] for e in load.prefix_events],
        "extra": dict(load.extra),
    }


def _decode_load(m: Mapping) -> EngineLoad:
    where = "load"
    try:
        total, free, tpb = _get(m, "blocks", list, where)
        queued, running, paused, finished = _get(m, "requests", list, where)
        queued_tokens, in_flight = _get(m, "tokens", list, where)
        events = tuple(PrefixEvent(PrefixEventKind(kind), int(h)) for kind, h in _get(m, "prefix", list, where))
        role = InstanceRole(_get(m, "role", str, where))
    except (ValueError, TypeError) as error:
        raise ProtocolError(f"{where}: {error}") from None
    return EngineLoad(
        role=role,
        total_blocks=int(total),
        free_blocks=int(free),
        tokens_per_block=int(tpb),
        queued_requests=int(queued),
        running_requests=int(running),
        queued_prompt_tokens=int(queued_tokens),
        tokens_in_flight=int(in_flight),
        num_paused=int(paused),
        prefix_events=events,
        num_finished=int(finished),
        extra={str(k): float(v) for k, v in dict(m.get("extra", {})).items()},
    )


def encode_poll(batch: PollBatch) -> bytes:
    return _pack(
        {
            "v": PROTOCOL_VERSION,
            "incarnation": batch.incarnation,
            "seq": batch.sequence,
            "outputs": [_encode_output(o) for o in batch.outputs],
            "events": [[e.request_id, e.state, e.time_s, e.detail] for e in batch.events],
            "reservations": [[r.request_id, r.transfer_id, r.num_blocks, r.expires_at_s] for r in batch.reservations],
            "push_results": [
                [p.request_id, p.transfer_id, p.ok, p.reason, p.detail, p.bytes_sent, p.elapsed_s]
                for p in batch.push_results
            ],
            "load": None if batch.load is None else _encode_load(batch.load),
            "rejected": [list(r) for r in batch.rejected],
            "extra": batch.extra,
        }
    )


def decode_poll(data: bytes) -> PollBatch:
    m = _unpack(data)
    where = "poll"
    if _get(m, "v", int, where) != PROTOCOL_VERSION:
        raise ProtocolError(f"{where}: unsupported protocol version {m.get('v')!r}")
    try:
        events = tuple(StateEvent(str(r), str(s), float(t), str(d)) for r, s, t, d in _get(m, "events", list, where))
        reservations = tuple(
            ReservationNotice(str(r), str(t), int(n), float(e)) for r, t, n, e in _get(m, "reservations", list, where)
        )
        pushes = tuple(
            PushResult(str(r), str(t), bool(ok), None if reason is None else str(reason), str(d), int(b), float(s))
            for r, t, ok, reason, d, b, s in _get(m, "push_results", list, where)
        )
        rejected = tuple((str(a), str(b), str(c)) for a, b, c in _get(m, "rejected", list, where))
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"{where}: {error}") from None
    load = m.get("load")
    for event in events:
        if not math.isfinite(event.time_s):
            raise ProtocolError(f"{where}: non-finite event time")
    return PollBatch(
        incarnation=_get(m, "incarnation", str, where),
        sequence=_get(m, "seq", int, where),
        outputs=tuple(_decode_output(o) for o in _get(m, "outputs", list, where)),
        events=events,
        reservations=reservations,
        push_results=pushes,
        load=None if load is None else _decode_load(load),
        rejected=rejected,
        extra=dict(m.get("extra", {})),
    )
