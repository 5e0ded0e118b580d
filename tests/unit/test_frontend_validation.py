"""Every Generate validation rule: INVALID_ARGUMENT naming the field, decided before the router is
called (docs/architecture.md, "Invariants"); and what a valid request becomes (defaults, floats,
deadlines)."""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from test_frontend_support import MAX_SEQ_LEN, VOCAB_SIZE, FakeRouter, ServerThread

from cluster.frontend.convert import (
    MAX_PROMPT_TEXT_BYTES,
    ModelLimits,
    RequestValidationError,
    client_request_from_proto,
    widen_float32,
)
from duet_wire.v1 import client_pb2 as pb
from duet_wire.v1 import client_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)
RPC_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def served():
    with ServerThread(FakeRouter()) as server:
        with grpc.insecure_channel(server.target) as channel:
            yield server, pb_grpc.DuetStub(channel), channel


def _ids(*ids: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(ids)))


def _sampled(**sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))


def _with(**fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", **fields)


INVALID = [
    ("no prompt", pb.GenerateRequest(), "prompt: exactly one of text / token_ids"),
    ("empty text", pb.GenerateRequest(text=""), "text: must not be empty"),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids: must not be empty"),
    ("text over 1 MiB", pb.GenerateRequest(text="x" * (MAX_PROMPT_TEXT_BYTES + 1)), "text: must be at most 1048576 bytes"),
    ("multi-byte text over 1 MiB", pb.GenerateRequest(text="é" * (MAX_PROMPT_TEXT_BYTES // 2 + 1)), "text: must be at most"),
    ("token id outside vocab", _ids(1, VOCAB_SIZE), f"token_ids: id {VOCAB_SIZE} is outside the vocabulary"),
    ("token ids too long", _ids(*([1] * MAX_SEQ_LEN)), f"token_ids: prompt is {MAX_SEQ_LEN} tokens"),
    ("text tokenizes too long", pb.GenerateRequest(text="a" * MAX_SEQ_LEN), f"text: prompt is {MAX_SEQ_LEN} tokens"),
    ("max_tokens 0", _sampled(max_tokens=0), "sampling.max_tokens: must be >= 1"),
    (
        "prompt + max_tokens over context",
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 10), sampling=pb.SamplingParams(max_tokens=MAX_SEQ_LEN - 9)),
        "sampling.max_tokens: prompt (10 tokens) + max_tokens (55)",
    ),
    ("default max_tokens over context", _ids(*([1] * (MAX_SEQ_LEN - 10))), "sampling.max_tokens: prompt (54 tokens) + max_tokens (16)"),
    ("max_tokens above limit", _sampled(max_tokens=(1 << 24) + 1), "sampling.max_tokens: must be <="),
    ("negative temperature", _sampled(temperature=-0.5), "sampling.temperature: must be >= 0"),
    ("NaN temperature", _sampled(temperature=math.nan), "sampling.temperature: must be finite"),
    ("infinite temperature", _sampled(temperature=math.inf), "sampling.temperature: must be finite"),
    ("top_p 0", _sampled(top_p=0.0), "sampling.top_p: must be in (0, 1]"),
    ("top_p above 1", _sampled(top_p=1.5), "sampling.top_p: must be in (0, 1]"),
    ("top_k -2", _sampled(top_k=-2), "sampling.top_k"),
    ("min_p above 1", _sampled(min_p=2.0), "sampling.min_p: must be in [0, 1]"),
    ("repetition_penalty 0", _sampled(repetition_penalty=0.0), "sampling.repetition_penalty: must be > 0"),
    ("presence_penalty 3", _sampled(presence_penalty=3.0), "sampling.presence_penalty: must be in [-2, 2]"),
    ("frequency_penalty -3", _sampled(frequency_penalty=-3.0), "sampling.frequency_penalty: must be in [-2, 2]"),
    ("seed above int63", _sampled(seed=2**63), "sampling.seed: must be <="),
    ("empty stop string", _sampled(stop=[""]), "sampling.stop: stop strings must not be empty"),
    ("too many stop strings", _sampled(stop=[f"s{i}" for i in range(33)]), "sampling.stop: at most 32"),
    ("stop token outside vocab", _sampled(stop_token_ids=[VOCAB_SIZE]), "sampling.stop_token_ids: id 300 is outside"),
    ("logprobs above 20", _sampled(logprobs=21), "sampling.logprobs: must be <= 20"),
    ("min_tokens above max_tokens", _sampled(max_tokens=4, min_tokens=5), "sampling.min_tokens: must be <= max_tokens"),
    ("empty client_request_id", _with(client_request_id=""), "client_request_id: must not be empty"),
    ("long client_request_id", _with(client_request_id="x" * 129), "client_request_id: must be at most 128"),
    ("non-ASCII client_request_id", _with(client_request_id="café"), "client_request_id: must be printable ASCII"),
    ("control char in client_request_id", _with(client_request_id="a\nb"), "client_request_id: must be printable ASCII"),
    ("zero timeout", _with(timeout=Duration()), "timeout: must be > 0"),
    ("negative timeout", _with(timeout=Duration(seconds=-1)), "timeout: must be > 0"),
    ("timeout over 1 h", _with(timeout=Duration(seconds=3600, nanos=1)), "timeout: must be at most 3600"),
    ("timeout nanos of 2 s", _with(timeout=Duration(seconds=0, nanos=2_000_000_000)), "timeout: nanos must be within"),
    ("timeout nanos below -1 s", _with(timeout=Duration(seconds=5, nanos=-1_000_000_000)), "timeout: nanos must be within"),
    ("timeout signs differ", _with(timeout=Duration(seconds=2, nanos=-1)), "timeout: seconds (2) and nanos (-1) must not differ"),
    ("timeout signs differ, negative", _with(timeout=Duration(seconds=-1, nanos=5)), "timeout: seconds (-1) and nanos (5)"),
    ("negative priority", _with(priority=-0.1), "priority: must be in [0, 1]"),
    ("priority above 1", _with(priority=1.5), "priority: must be in [0, 1]"),
    ("NaN priority", _with(priority=math.nan), "priority: must be in [0, 1]"),
]


@pytest.mark.parametrize(("request_", "expected"), [(r, e) for _, r, e in INVALID], ids=[name for name, _, _ in INVALID])
def test_invalid_requests_are_refused_before_the_router(served, request_, expected) -> None:
    server, stub, _ = served
    submitted = len(server.router.submitted)
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(request_, timeout=RPC_TIMEOUT_S))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in raised.value.details()
    assert len(server.router.submitted) == submitted, "an invalid request reached the router"


def test_cheap_checks_run_before_the_prompt_is_tokenized(served) -> None:
    server, stub, _ = served
    tokenized = len(server.router.tokenized)
    request = pb.GenerateRequest(text="a fine prompt", sampling=pb.SamplingParams(top_p=7.0))
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(request, timeout=RPC_TIMEOUT_S))
    assert len(server.router.tokenized) == tokenized


def test_a_request_that_does_not_parse_is_invalid_argument(served) -> None:
    _, _, channel = served
    raw_generate = channel.unary_stream("/duet_wire.v1.Duet/Generate", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as raised:
        list(raw_generate(b"\x0a\xff\xff\xff\xff\x0f", timeout=RPC_TIMEOUT_S))  # a length past the end
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request: not a valid GenerateRequest" in raised.value.details()


def test_invalid_abort_and_get_request_refs(served) -> None:
    server, stub, _ = served
    for call, message in ((stub.Abort, pb.AbortRequest), (stub.GetRequest, pb.GetRequestRequest)):
        with pytest.raises(grpc.RpcError) as raised:
            call(message(), timeout=RPC_TIMEOUT_S)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request: exactly one of request_id / client_request_id" in raised.value.details()
        with pytest.raises(grpc.RpcError) as raised:
            call(message(request=pb.RequestRef(client_request_id="x" * 200)), timeout=RPC_TIMEOUT_S)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request.client_request_id: must be at most 128" in raised.value.details()
    assert server.router.aborts == []


# ---- what valid requests become ---------------------------------------------------------------

LIMITS = ModelLimits(vocab_size=VOCAB_SIZE, max_seq_len=MAX_SEQ_LEN)


def _tokenize(text: str) -> list[int]:
    return list(text.encode())


def test_defaults_of_an_unset_sampling_message() -> None:
    request = client_request_from_proto(pb.GenerateRequest(text="hi"), LIMITS, _tokenize)
    # Tokenized and validated once, here: the router gets token ids.
    assert request.prompt_token_ids == tuple(b"hi") and request.prompt_text is None and request.validated
    assert request.sampling.max_tokens == 16 and request.sampling.temperature == 1.0
    assert request.sampling.top_k == -1 and request.sampling.seed is None and request.sampling.skip_special_tokens
    assert request.priority == 0.5 and request.timeout_s is None and request.client_request_id is None


def test_every_sampling_field_is_carried_over() -> None:
    sampling = pb.SamplingParams(
        max_tokens=5, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.3, frequency_penalty=-0.2, seed=2**63 - 1, stop=["\n\n", "END"], stop_token_ids=[2, 3],
        ignore_eos=True, include_stop_str_in_output=True, logprobs=0, min_tokens=0, skip_special_tokens=False,
    )  # fmt: skip
    request = client_request_from_proto(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]), sampling=sampling, client_request_id="mine-1", priority=0.8),
        LIMITS,
        _tokenize,
    )
    s = request.sampling
    # float32 on the wire, widened back to the decimal the client wrote
    assert (s.temperature, s.top_p, s.min_p, s.repetition_penalty) == (0.7, 0.9, 0.05, 1.1)
    assert (s.presence_penalty, s.frequency_penalty, request.priority) == (0.3, -0.2, 0.8)
    assert (s.max_tokens, s.top_k, s.seed, s.logprobs, s.min_tokens) == (5, 40, 2**63 - 1, 0, 0)
    assert s.stop == ("\n\n", "END") and s.stop_token_ids == (2, 3)
    assert s.ignore_eos and s.include_stop_str_in_output and not s.skip_special_tokens
    assert request.prompt_token_ids == (5, 6) and request.prompt_text is None and request.client_request_id == "mine-1"


def test_timeout_is_the_smaller_of_the_request_and_the_call_deadline() -> None:
    own = pb.GenerateRequest(text="hi", timeout=Duration(seconds=2, nanos=500_000_000))
    assert client_request_from_proto(own, LIMITS, _tokenize).timeout_s == 2.5
    assert client_request_from_proto(own, LIMITS, _tokenize, call_time_remaining_s=1.0).timeout_s == 1.0
    assert client_request_from_proto(own, LIMITS, _tokenize, call_time_remaining_s=9.0).timeout_s == 2.5
    plain = pb.GenerateRequest(text="hi")
    assert client_request_from_proto(plain, LIMITS, _tokenize, call_time_remaining_s=4.0).timeout_s == 4.0


def test_the_call_deadline_reaches_the_router(served) -> None:
    server, stub, _ = served
    before = len(server.router.submitted)
    list(stub.Generate(pb.GenerateRequest(text="deadline"), timeout=7.0))
    list(stub.Generate(pb.GenerateRequest(text="deadline", timeout=Duration(seconds=3)), timeout=7.0))
    first, second = server.router.submitted[before:]
    # gRPC rounds the deadline it sends up to a unit of its timeout header: allow a little over.
    assert first.timeout_s is not None and 6.0 < first.timeout_s <= 7.5
    assert second.timeout_s == 3.0


def test_largest_prompt_and_budget_that_fit_are_accepted() -> None:
    request = client_request_from_proto(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[VOCAB_SIZE - 1] * (MAX_SEQ_LEN - 1)), sampling=pb.SamplingParams(max_tokens=1)),
        LIMITS,
        _tokenize,
    )
    assert len(request.prompt_token_ids or ()) == MAX_SEQ_LEN - 1
    edge = pb.GenerateRequest(text="é" * (MAX_PROMPT_TEXT_BYTES // 2))  # exactly 1 MiB
    with pytest.raises(RequestValidationError) as raised:  # fits in bytes, too long in tokens
        client_request_from_proto(edge, LIMITS, _tokenize)
    assert raised.value.field == "text" and "prompt is" in raised.value.message


@pytest.mark.parametrize("value", [0.7, 0.9, 0.05, 1.1, 0.1, 1e-3, 0.0, 1.0, -2.0, 123.456, 3.4e38])
def test_widen_float32_recovers_the_decimal_that_was_sent(value: float) -> None:
    import struct

    as_float32 = struct.unpack("<f", struct.pack("<f", value))[0]
    assert widen_float32(as_float32) == value
    assert math.isnan(widen_float32(math.nan))
