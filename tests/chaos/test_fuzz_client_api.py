"""Property-based fuzzing of the client API (docs/architecture.md, "Invariants": bad input is
rejected at the edge): random and malformed Generate requests against a real cluster (1 PREFILL + 1
GENERATION on a local Ray), sent as raw bytes through a generic channel call so that the server sees
exactly what a hostile client could send.

Each request is classified here, from the documented rules (cluster/frontend/convert.py, worker/sampling.py),
before it is sent: valid -> it completes; invalid -> INVALID_ARGUMENT whose message starts with the
offending field's protobuf path ("sampling.top_p: ..."), with no message streamed before it;
bytes that do not parse (invalid UTF-8 in a string field, a truncated field) -> INVALID_ARGUMENT
naming "request" (the parser does not say which field). Unknown fields, top level or inside
`sampling`, are ignored as protobuf does. Afterwards: every instance HEALTHY with the incarnation
and pid it started with, a normal request still succeeds, and every block is free.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from cluster_harness import ClusterHarness
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cluster.client import DuetClient, DuetError
from cluster.deploy.config import ClusterConfig
from cluster.frontend.convert import MAX_CLIENT_REQUEST_ID_CHARS, MAX_PROMPT_TEXT_BYTES, MAX_TIMEOUT_S
from duet_wire.v1 import client_pb2 as pb
from worker.sampling import (
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_LIMIT,
)

pytestmark = pytest.mark.timeout(600)

MAX_SEQ_LEN = 384  # small, so that prompts near and over the limit stay cheap
VOCAB_SIZE = 264  # the built-in model's
GENERATE_METHOD = "/duet_wire.v1.Duet/Generate"
GET_REQUEST_METHOD = "/duet_wire.v1.Duet/GetRequest"
ABORT_METHOD = "/duet_wire.v1.Duet/Abort"
CALL_TIMEOUT_S = 60.0
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # the front end's default receive limit
# A request whose own timeout is shorter than this may end with DEADLINE_EXCEEDED legitimately.
SURE_TO_FINISH_S = 30.0
_unique = itertools.count(1)


def cluster_config() -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "dtype": "float32",
            "device": "cpu",
            "instances": [
                {"role": "PREFILL", "count": 1, "num_cpus": 0.5},
                {"role": "GENERATION", "count": 1, "num_cpus": 0.5},
            ],
            "engine": {"num_blocks": 256, "tokens_per_block": 16, "max_seq_len": MAX_SEQ_LEN},
            "router": {
                "health": {"heartbeat_interval_s": 0.25, "dead_after_s": 5.0},
                "timeouts": {"context_s": 60.0, "reservation_s": 30.0, "transfer_s": 30.0, "generation_s": 60.0},
            },
            "frontend": {"port": 0, "metrics_port": None, "http_port": 0},
            "seed": 3,
        }
    )


@dataclass(frozen=True)
class Started:
    harness: ClusterHarness
    channel: grpc.Channel
    processes: dict[str, tuple[str, int]]  # instance id -> (incarnation, pid) at the start


def _processes(harness: ClusterHarness) -> dict[str, tuple[str, int]]:
    return harness.call(lambda: {iid: (i.info.incarnation, i.info.pid) for iid, i in harness.router.instances.items()})


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    harness = ClusterHarness(cluster_config()).start()
    assert harness.router.vocab_size == VOCAB_SIZE and harness.router.max_seq_len == MAX_SEQ_LEN
    channel = grpc.insecure_channel(harness.target)
    try:
        yield Started(harness, channel, _processes(harness))
    finally:
        channel.close()
        harness.stop()


# ---- sending raw bytes -------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    code: str  # "OK" or the status name
    details: str
    responses: tuple[pb.GenerateResponse, ...]

    @property
    def field(self) -> str:
        """What an INVALID_ARGUMENT names: the text before the first ': '."""
        return self.details.split(": ", 1)[0]


def send(channel: grpc.Channel, raw: bytes) -> Reply:
    call = channel.unary_stream(GENERATE_METHOD, request_serializer=None, response_deserializer=pb.GenerateResponse.FromString)
    responses = []
    try:
        for response in call(raw, timeout=CALL_TIMEOUT_S):
            responses.append(response)
    except grpc.RpcError as error:
        return Reply(error.code().name, error.details() or "", tuple(responses))
    return Reply("OK", "", tuple(responses))


def unary(channel: grpc.Channel, method: str, raw: bytes, response_type) -> tuple[str, str]:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=response_type.FromString)
    try:
        call(raw, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        return error.code().name, error.details() or ""
    return "OK", ""


# ---- the wire format, by hand ------------------------------------------------------------------


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field_bytes(number: int, wire_type: int, payload: bytes | int) -> bytes:
    key = varint((number << 3) | wire_type)
    if wire_type == 0:
        return key + varint(int(payload))
    if wire_type == 1:
        return key + struct.pack("<Q", int(payload))
    if wire_type == 5:
        return key + struct.pack("<I", int(payload))
    assert isinstance(payload, bytes)
    return key + varint(len(payload)) + payload


TEXT_FIELD, SAMPLING_FIELD, CLIENT_ID_FIELD = 1, 3, 4
STOP_FIELD = 10  # inside SamplingParams
KNOWN_TOP_LEVEL = set(range(1, 8))  # 7: messages
KNOWN_SAMPLING = set(range(1, 17))


@st.composite
def unknown_fields(draw, known: set[int]) -> bytes:
    number = draw(st.integers(1, 2**29 - 1).filter(lambda n: n not in known and not 19000 <= n <= 19999))
    wire_type = draw(st.sampled_from([0, 1, 2, 5]))
    if wire_type == 0:
        payload: bytes | int = draw(st.integers(0, 2**64 - 1))
    elif wire_type == 1:
        payload = draw(st.integers(0, 2**64 - 1))
    elif wire_type == 5:
        payload = draw(st.integers(0, 2**32 - 1))
    else:
        payload = draw(st.binary(max_size=64))
    return field_bytes(number, wire_type, payload)


INVALID_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"ok\x80"])


# ---- the request generator ---------------------------------------------------------------------
# A valid request, then zero, one or two mutations that each break one rule (so that the field a
# rejection names is checked exactly), plus neutral additions (unknown fields).

PRINTABLE_ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def f32(**kwargs) -> st.SearchStrategy[float]:
    return st.floats(width=32, allow_nan=False, allow_infinity=False, **kwargs)


@st.composite
def valid_sampling(draw) -> pb.SamplingParams:
    """Every field unset or in range (extremes included: subnormal penalties, huge temperatures)."""
    sampling = pb.SamplingParams()
    optional = {
        "max_tokens": st.integers(1, 4),
        "temperature": st.one_of(st.sampled_from([0.0, 0.005, 0.7, 1.0]), f32(min_value=0.0)),
        "top_p": f32(min_value=0.0, max_value=1.0, exclude_min=True),
        "min_p": f32(min_value=0.0, max_value=1.0),
        "repetition_penalty": f32(min_value=0.0, exclude_min=True),
        "presence_penalty": f32(min_value=-2.0, max_value=2.0),
        "frequency_penalty": f32(min_value=-2.0, max_value=2.0),
        "top_k": st.integers(-1, 2**31 - 1),
        "seed": st.integers(0, MAX_SEED),
        "logprobs": st.integers(0, MAX_LOGPROBS),
        "skip_special_tokens": st.booleans(),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            setattr(sampling, name, draw(strategy))
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
    if draw(st.booleans()):
        sampling.min_tokens = draw(st.integers(0, max_tokens))
    sampling.stop.extend(draw(st.lists(st.text(min_size=1, max_size=4), max_size=3)))
    sampling.stop_token_ids.extend(draw(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=4)))
    sampling.ignore_eos = draw(st.booleans())
    sampling.include_stop_str_in_output = draw(st.booleans())
    return sampling


@st.composite
def valid_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    if draw(st.booleans()):
        request.text = draw(st.text(min_size=1, max_size=60))
    else:
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=60)))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(valid_sampling()))
    if draw(st.booleans()):
        # Unique, so that a valid id is never "in use" by a live request of an earlier example.
        text = draw(st.text(PRINTABLE_ASCII, max_size=MAX_CLIENT_REQUEST_ID_CHARS))
        request.client_request_id = f"f{next(_unique)}~{text}"[:MAX_CLIENT_REQUEST_ID_CHARS]
    timeout = draw(st.one_of(st.none(), st.floats(60.0, MAX_TIMEOUT_S), st.floats(1e-9, 2.0)))
    if timeout is not None:
        request.timeout.seconds = int(timeout)
        request.timeout.nanos = int((timeout - int(timeout)) * 1e9)
    if draw(st.booleans()):
        request.priority = draw(f32(min_value=0.0, max_value=1.0))
    return request


def _set_length(request: pb.GenerateRequest, length: int) -> None:
    if request.WhichOneof("prompt") == "text":
        request.text = "x" * max(0, length - 1)  # + BOS
    else:
        del request.token_ids.ids[:]
        request.token_ids.ids.extend([7] * length)


def _out_of(low: float, high: float) -> st.SearchStrategy[float]:
    """Float32 values outside [low, high], and non-finite ones."""
    return st.one_of(NOT_FINITE, f32(max_value=low, exclude_max=True), f32(min_value=high, exclude_min=True))


def _mutate_field(draw, request: pb.GenerateRequest, name: str) -> None:
    """Break the rule of one field of a (so far valid) request."""
    sampling = request.sampling
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
    if name == "prompt_unset":
        if request.WhichOneof("prompt") is not None:
            request.ClearField(request.WhichOneof("prompt"))
    elif name == "prompt_empty":
        if request.WhichOneof("prompt") == "text":
            request.text = ""
        else:
            del request.token_ids.ids[:]
    elif name == "prompt_too_long":
        _set_length(request, draw(st.integers(MAX_SEQ_LEN, MAX_SEQ_LEN * 12)))
    elif name == "prompt_plus_max_tokens_too_long":
        _set_length(request, draw(st.integers(MAX_SEQ_LEN - max_tokens + 1, MAX_SEQ_LEN - 1)))
    elif name == "token_id_outside_vocab":
        request.token_ids.ids.append(draw(st.sampled_from([VOCAB_SIZE, 2**31, 2**32 - 1])))
    elif name == "max_tokens":
        sampling.max_tokens = draw(st.sampled_from([0, MAX_TOKENS_LIMIT + 1, 2**32 - 1]))
        sampling.ClearField("min_tokens")
    elif name == "temperature":
        sampling.temperature = draw(st.one_of(NOT_FINITE, f32(max_value=0.0, exclude_max=True)))
    elif name == "top_p":
        sampling.top_p = draw(st.one_of(_out_of(0.0, 1.0), st.just(0.0)))
    elif name == "min_p":
        sampling.min_p = draw(_out_of(0.0, 1.0))
    elif name == "repetition_penalty":
        sampling.repetition_penalty = draw(st.one_of(NOT_FINITE, f32(max_value=0.0)))
    elif name in ("presence_penalty", "frequency_penalty"):
        setattr(sampling, name, draw(_out_of(-2.0, 2.0)))
    elif name == "top_k":
        sampling.top_k = draw(st.integers(-(2**31), -2))
    elif name == "seed":
        sampling.seed = draw(st.integers(MAX_SEED + 1, 2**64 - 1))
    elif name == "logprobs":
        sampling.logprobs = draw(st.integers(MAX_LOGPROBS + 1, 2**32 - 1))
    elif name == "min_tokens":
        sampling.min_tokens = draw(st.integers(max_tokens + 1, 2**32 - 1))
    elif name == "stop":
        how = draw(st.sampled_from(["empty", "long", "many"]))
        del sampling.stop[:]
        sampling.stop.extend({"empty": [""], "long": ["x" * (MAX_STOP_STRING_CHARS + 1)], "many": ["z"] * (MAX_STOP_STRINGS + 1)}[how])
    elif name == "stop_token_ids":
        if draw(st.booleans()):
            sampling.stop_token_ids.append(draw(st.integers(VOCAB_SIZE, 2**32 - 1)))
        else:
            sampling.stop_token_ids.extend([1] * (MAX_STOP_TOKEN_IDS + 1))
    elif name == "client_request_id":
        request.client_request_id = draw(
            st.one_of(
                st.just(""),
                st.text(PRINTABLE_ASCII, min_size=MAX_CLIENT_REQUEST_ID_CHARS + 1, max_size=MAX_CLIENT_REQUEST_ID_CHARS + 40),
                st.text(min_size=1, max_size=20).filter(lambda s: not (s.isascii() and s.isprintable())),
                st.sampled_from(["tab\tid", "new\nline", "nul\x00", "é", "🦆", "\x7f"]),
            )
        )
    elif name == "timeout":
        seconds, nanos = draw(
            st.one_of(
                st.tuples(st.integers(-(2**40), 0), st.integers(-999_999_999, 0)),  # <= 0
                st.tuples(st.integers(int(MAX_TIMEOUT_S) + 1, 2**40), st.integers(0, 999_999_999)),
                st.tuples(st.integers(-3, -1), st.integers(0, 999_999_999)),  # nanos cannot save it
            )
        )
        request.timeout.seconds, request.timeout.nanos = seconds, nanos
    elif name == "priority":
        request.priority = draw(_out_of(0.0, 1.0))
    else:  # pragma: no cover - a typo in FIELD_MUTATIONS
        raise AssertionError(name)


FIELD_MUTATIONS = (
    "prompt_unset", "prompt_empty", "prompt_too_long", "prompt_plus_max_tokens_too_long", "token_id_outside_vocab",
    "max_tokens", "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "top_k", "seed", "logprobs", "min_tokens", "stop", "stop_token_ids", "client_request_id", "timeout", "priority",
)
WIRE_MUTATIONS = ("bad_utf8_text", "bad_utf8_client_request_id", "bad_utf8_stop", "truncated")


def _damage(draw, raw: bytes, name: str) -> bytes:
    """Wire-level damage the protobuf API cannot express."""
    if name == "bad_utf8_text":
        return raw + field_bytes(TEXT_FIELD, 2, b"prompt " + draw(INVALID_UTF8))
    if name == "bad_utf8_client_request_id":
        return raw + field_bytes(CLIENT_ID_FIELD, 2, b"id-" + draw(INVALID_UTF8))
    if name == "bad_utf8_stop":
        return raw + field_bytes(SAMPLING_FIELD, 2, field_bytes(STOP_FIELD, 2, draw(INVALID_UTF8)))
    return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]


@st.composite
def generate_requests(draw) -> tuple[bytes, tuple[str, ...]]:
    """(serialized GenerateRequest, the mutations applied to it)."""
    request = draw(valid_requests())
    mutations = draw(
        st.one_of(
            st.just(()),
            st.tuples(st.sampled_from(FIELD_MUTATIONS)),
            st.tuples(st.sampled_from(FIELD_MUTATIONS), st.sampled_from(FIELD_MUTATIONS)),
            st.tuples(st.sampled_from(WIRE_MUTATIONS)),
        )
    )
    for name in mutations:
        if name in FIELD_MUTATIONS:
            if name == "token_id_outside_vocab" and request.WhichOneof("prompt") != "token_ids":
                request.token_ids.ids.extend([1, 2])
            if name in ("prompt_empty", "prompt_too_long", "prompt_plus_max_tokens_too_long") and request.WhichOneof("prompt") is None:
                request.text = "restored"
            _mutate_field(draw, request, name)
    raw = request.SerializeToString()
    # Neutral: unknown fields, top level or inside `sampling` (a second occurrence of a message
    # field merges into the first).
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.booleans()):
            raw += draw(unknown_fields(KNOWN_TOP_LEVEL))
        else:
            raw += field_bytes(SAMPLING_FIELD, 2, draw(unknown_fields(KNOWN_SAMPLING)))
    for name in mutations:
        if name in WIRE_MUTATIONS:
            raw = _damage(draw, raw, name)
    return raw, mutations


# ---- the classifier: the documented rules, written out again -----------------------------------


def _widen(value: float) -> float:
    """What the server compares: the float32 value, as the shortest decimal (cluster/frontend/convert.py);
    the comparisons below give the same answer for either."""
    return struct.unpack("<f", struct.pack("<f", value))[0] if math.isfinite(value) else value


def _bad_float(value: float, ok: Callable[[float], bool]) -> bool:
    return not math.isfinite(value) or not ok(_widen(value))


@dataclass(frozen=True)
class Expectation:
    invalid: frozenset[str]  # the fields a rejection may name; empty: the request is valid
    may_time_out: bool = False  # valid, with an own timeout too short to be sure it finishes
    # Valid as far as the rules here can tell, but the server may still refuse it naming one of
    # these: a conversation (`messages`) is rendered by the served model's chat template, whose
    # verdict and token count are the template's to give.
    may_be_refused: frozenset[str] = frozenset()


def expect(raw: bytes, tokenize: Callable[[str], list[int]]) -> Expectation:
    try:
        request = pb.GenerateRequest.FromString(raw)
    except DecodeError:
        return Expectation(frozenset({"request"}))
    bad: set[str] = set()
    kind = request.WhichOneof("prompt")
    prompt_length = 0
    if kind is None:
        bad.add("prompt")
    elif kind == "text":
        text = request.text
        if not text or len(text.encode("utf-8")) > MAX_PROMPT_TEXT_BYTES:
            bad.add("text")
        else:
            prompt_length = len(tokenize(text))
            if prompt_length == 0 or prompt_length > MAX_SEQ_LEN - 1:
                bad.add("text")
    elif kind == "messages":
        pass  # judged by the template (Expectation.may_be_refused)
    else:
        ids = list(request.token_ids.ids)
        prompt_length = len(ids)
        if not ids or len(ids) > MAX_SEQ_LEN - 1 or max(ids) >= VOCAB_SIZE:
            bad.add("token_ids")
    sampling = request.sampling
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        bad.add("sampling.max_tokens")
    checks: dict[str, Callable[[float], bool]] = {
        "temperature": lambda v: v >= 0.0,
        "top_p": lambda v: 0.0 < v <= 1.0,
        "min_p": lambda v: 0.0 <= v <= 1.0,
        "repetition_penalty": lambda v: v > 0.0,
        "presence_penalty": lambda v: -2.0 <= v <= 2.0,
        "frequency_penalty": lambda v: -2.0 <= v <= 2.0,
    }
    for name, ok in checks.items():
        if sampling.HasField(name) and _bad_float(getattr(sampling, name), ok):
            bad.add(f"sampling.{name}")
    if sampling.HasField("top_k") and sampling.top_k < -1:
        bad.add("sampling.top_k")
    if sampling.HasField("seed") and sampling.seed > MAX_SEED:
        bad.add("sampling.seed")
    stops = list(sampling.stop)
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
        bad.add("sampling.stop")
    stop_ids = list(sampling.stop_token_ids)
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(i >= VOCAB_SIZE for i in stop_ids):
        bad.add("sampling.stop_token_ids")
    if sampling.HasField("logprobs") and sampling.logprobs > MAX_LOGPROBS:
        bad.add("sampling.logprobs")
    if sampling.HasField("min_tokens") and sampling.min_tokens > max_tokens:
        bad.add("sampling.min_tokens")
    if request.HasField("client_request_id"):
        value = request.client_request_id
        if not value or len(value) > MAX_CLIENT_REQUEST_ID_CHARS or not (value.isascii() and value.isprintable()):
            bad.add("client_request_id")
    may_time_out = False
    if request.HasField("timeout"):
        timeout_s = request.timeout.seconds + request.timeout.nanos / 1e9
        if not 0.0 < timeout_s <= MAX_TIMEOUT_S:
            bad.add("timeout")
        may_time_out = timeout_s < SURE_TO_FINISH_S
    if request.HasField("priority") and _bad_float(request.priority, lambda v: 0.0 <= v <= 1.0):
        bad.add("priority")
    if kind == "messages":
        template = frozenset({"messages", "messages.messages", "sampling.max_tokens"})
        return Expectation(frozenset(bad) | template if bad else frozenset(), may_time_out, template)
    prompt_ok = not bad & {"prompt", "text", "token_ids"}
    if prompt_ok and 1 <= max_tokens and prompt_length + max_tokens > MAX_SEQ_LEN:
        bad.add("sampling.max_tokens")
    return Expectation(frozenset(bad), may_time_out)


def check_reply(raw: bytes, reply: Reply, expected: Expectation) -> None:
    if expected.invalid:
        if reply.code == "RESOURCE_EXHAUSTED":
            return
        assert reply.code == "INVALID_ARGUMENT", (reply, expected)
        assert reply.field in expected.invalid, (reply.details, sorted(expected.invalid))
        assert reply.responses == (), "a rejected request streamed messages"
        return
    if expected.may_time_out and reply.code == "DEADLINE_EXCEEDED":
        return
    if expected.may_be_refused and reply.code == "INVALID_ARGUMENT":
        assert reply.field in expected.may_be_refused, (reply.details, sorted(expected.may_be_refused))
        assert reply.responses == (), "a rejected request streamed messages"
        return
    assert reply.code == "OK", (reply.code, reply.details, pb.GenerateRequest.FromString(raw))
    *deltas, last = reply.responses
    assert last.WhichOneof("event") == "result", reply.responses
    assert all(r.WhichOneof("event") == "delta" for r in deltas)
    request = pb.GenerateRequest.FromString(raw)
    max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
    generated = sum(len(r.delta.token_ids) for r in deltas)
    assert last.result.usage.completion_tokens == generated <= max_tokens
    assert last.result.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    if request.HasField("client_request_id"):
        assert last.request_id == request.client_request_id


# ---- the properties ----------------------------------------------------------------------------

FUZZ_SETTINGS = settings(max_examples=120, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ_SETTINGS
@given(case=generate_requests())
def test_every_generate_request_completes_or_is_rejected_naming_its_field(cluster, case) -> None:
    raw, mutations = case
    expected = expect(raw, cluster.harness.router.tokenize)
    event("valid" if not expected.invalid else f"{len(mutations)} mutation(s)")
    if not mutations:
        assert not expected.invalid, expected  # the generator's valid requests are valid
    check_reply(raw, send(cluster.channel, raw), expected)
    cluster.harness.assert_no_router_bug()


@settings(max_examples=40)
@given(raw=st.binary(max_size=64))
def test_arbitrary_bytes_are_classified_like_any_request(cluster, raw) -> None:
    expected = expect(raw, cluster.harness.router.tokenize)
    check_reply(raw, send(cluster.channel, raw), expected)


@st.composite
def request_refs(draw) -> tuple[bytes, frozenset[str]]:
    """(serialized RequestRef inside a GetRequest/Abort request, the fields a rejection may name;
    empty: well formed, so NOT_FOUND for an id nobody used)."""
    kind = draw(st.sampled_from(["none", "request_id", "client_request_id", "bad_utf8"]))
    if kind == "none":
        return b"", frozenset({"request"})
    if kind == "bad_utf8":
        return field_bytes(1, 2, field_bytes(2, 2, draw(INVALID_UTF8))), frozenset({"request"})
    value = draw(st.one_of(st.text(max_size=MAX_CLIENT_REQUEST_ID_CHARS + 20), st.text(PRINTABLE_ASCII, min_size=1, max_size=40)))
    ref = pb.RequestRef(**{kind: value})
    good = bool(value) and len(value) <= MAX_CLIENT_REQUEST_ID_CHARS and value.isascii() and value.isprintable()
    name = f"request.{kind}"
    return field_bytes(1, 2, ref.SerializeToString()), frozenset() if good else frozenset({name})


@settings(max_examples=40)
@given(ref=request_refs(), method=st.sampled_from([GET_REQUEST_METHOD, ABORT_METHOD]))
def test_request_refs_are_validated(cluster, ref, method) -> None:
    raw, invalid = ref
    response_type = pb.GetRequestResponse if method == GET_REQUEST_METHOD else pb.AbortResponse
    code, details = unary(cluster.channel, method, raw, response_type)
    if invalid:
        assert code == "INVALID_ARGUMENT", (code, details)
        assert details.split(": ", 1)[0] in invalid, (details, invalid)
    else:
        # Nobody uses ids made of these strings, except by a vanishingly rare accident.
        assert code in ("NOT_FOUND", "OK"), (code, details)


def test_a_message_over_the_size_limit_is_resource_exhausted(cluster) -> None:
    raw = pb.GenerateRequest(text="a" * (MAX_MESSAGE_BYTES + 16)).SerializeToString()
    reply = send(cluster.channel, raw)
    assert reply.code == "RESOURCE_EXHAUSTED", reply.code


def test_a_text_over_the_prompt_byte_limit_is_invalid(cluster) -> None:
    raw = pb.GenerateRequest(text="é" * (MAX_PROMPT_TEXT_BYTES // 2 + 1)).SerializeToString()
    reply = send(cluster.channel, raw)
    assert (reply.code, reply.field) == ("INVALID_ARGUMENT", "text"), reply.details
    assert "bytes" in reply.details


def test_unknown_fields_change_nothing(cluster) -> None:
    base = pb.GenerateRequest(text="unknown fields are ignored", sampling=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    plain = send(cluster.channel, base.SerializeToString())
    extended = base.SerializeToString() + b"".join(
        [
            field_bytes(99, 0, 12345),
            field_bytes(8, 2, b"a newer client's field"),
            field_bytes(1000, 1, 2**64 - 1),
            field_bytes(536_870_911, 5, 7),  # the largest field number
            field_bytes(SAMPLING_FIELD, 2, field_bytes(17, 0, 1) + field_bytes(200, 2, b"\xff\xfe")),
        ]
    )
    ignored = send(cluster.channel, extended)
    assert plain.code == ignored.code == "OK", (plain.details, ignored.details)
    # Deltas may be cut differently (the front end merges tokens that pile up): compare tokens.
    tokens = [t for r in plain.responses[:-1] for t in r.delta.token_ids]
    assert [t for r in ignored.responses[:-1] for t in r.delta.token_ids] == tokens
    assert len(tokens) == 6


def test_a_client_request_id_can_be_used_again_once_its_request_ended(cluster) -> None:
    # The contract (client.proto): unique among the client's *live* requests.
    with DuetClient(cluster.harness.target, timeout_s=CALL_TIMEOUT_S) as client:
        first = client.complete("once", max_tokens=2, temperature=0.0, client_request_id="reused-id")
        again = client.complete("twice", max_tokens=2, temperature=0.0, client_request_id="reused-id")
        assert first.request_id == again.request_id == "reused-id"
        assert client.get_request(client_request_id="reused-id").state == "COMPLETE"


def test_the_cluster_is_unharmed(cluster) -> None:
    """Runs last in this module: no instance crashed or restarted, a normal request succeeds, and
    every block is free again."""
    harness = cluster.harness
    with DuetClient(harness.target, timeout_s=CALL_TIMEOUT_S) as client:
        done = client.complete([256, 1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(done.token_ids) == 4
        status = client.cluster_status()
        assert [i.health for i in status.instances] == ["HEALTHY", "HEALTHY"], status.instances
        with pytest.raises(DuetError) as missing:
            client.get_request(client_request_id="never-sent")
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert _processes(harness) == cluster.processes
    free = harness.settle()
    assert free and all(f == t for f, t in free.values()), free
    harness.assert_no_router_bug()
    extra = harness.status().extra
    assert extra["illegal_transitions"] == 0 and extra["inconsistent_reports"] == 0, extra


def test_the_classifier_knows_the_rules() -> None:
    """The expectations themselves, on hand-made cases (no cluster)."""

    def tokenize(text: str) -> list[int]:
        return [256, *text.encode("utf-8")]

    def invalid(request: pb.GenerateRequest) -> frozenset[str]:
        return expect(request.SerializeToString(), tokenize).invalid

    assert invalid(pb.GenerateRequest(text="hi")) == frozenset()
    assert invalid(pb.GenerateRequest()) == {"prompt"}
    assert invalid(pb.GenerateRequest(text="")) == {"text"}
    assert invalid(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2**32 - 1]))) == {"token_ids"}
    assert invalid(pb.GenerateRequest(text="x" * MAX_SEQ_LEN)) == {"text"}
    assert invalid(pb.GenerateRequest(text="x" * (MAX_SEQ_LEN - 10))) == {"sampling.max_tokens"}  # + 16 default
    assert invalid(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=float("nan")))) == {"sampling.temperature"}
    assert invalid(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0.0, max_tokens=0))) == {"sampling.top_p", "sampling.max_tokens"}
    assert invalid(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(min_tokens=17))) == {"sampling.min_tokens"}
    assert invalid(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(seed=2**63))) == {"sampling.seed"}
    assert invalid(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=[""]))) == {"sampling.stop"}
    assert invalid(pb.GenerateRequest(text="hi", client_request_id="tab\there")) == {"client_request_id"}
    assert invalid(pb.GenerateRequest(text="hi", priority=1.5)) == {"priority"}
    late = pb.GenerateRequest(text="hi")
    late.timeout.seconds = 3601
    assert invalid(late) == {"timeout"}
    assert expect(b"\x0a\x01\xff", tokenize).invalid == {"request"}
    conversation = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]))
    judged_by_template = expect(conversation.SerializeToString(), tokenize)
    assert judged_by_template.invalid == frozenset() and "messages" in judged_by_template.may_be_refused
    conversation.sampling.temperature = -1.0
    assert {"sampling.temperature", "messages"} <= expect(conversation.SerializeToString(), tokenize).invalid
    assert expect(pb.GenerateRequest(text="hi").SerializeToString() + field_bytes(77, 0, 1), tokenize).invalid == frozenset()
