"""The router/instance protocol (worker/protocol.py): every message round-trips, and what a peer
sends is checked before it is used (size, version, types, unknown fields, ranges)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.block_hash import PrefixEvent, PrefixEventKind
from scheduler.state import LlmRequestState
from worker.kv_layout import KvLayout
from worker.kv_transfer.certificates import DeploymentCa
from worker.kv_transfer.failures import FailureReason
from worker.protocol import (
    MAX_BLOCK_HASH,
    MAX_COUNTER,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Command,
    Decoder,
    Digest,
    Drain,
    Drained,
    Encoder,
    EngineInputError,
    EngineLoad,
    ErrorCode,
    GetInfo,
    InstanceInfo,
    InstanceRole,
    KvDigest,
    MessageTooLarge,
    Ping,
    Poll,
    PollBatch,
    Pong,
    ProtocolError,
    ProtocolVersionMismatch,
    Push,
    PushResult,
    Rejected,
    Release,
    Renew,
    ReplaceTransferTls,
    Reply,
    RequestError,
    RequestOutput,
    RequestType,
    ReservationNotice,
    StateEvent,
    Submit,
    SubmitRequest,
    Unavailable,
)
from worker.sampler_types import SampleLogprobs, TokenLogprob
from worker.sampling import InvalidSamplingParams, SamplingParams
from worker.stopping import FinishReason

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32", model_fingerprint="fp")
PARAMS = SamplingParams(max_tokens=8, temperature=0.7, top_k=5, seed=3, stop=("end",), stop_token_ids=(2,), logprobs=2)


def make_load(**overrides) -> EngineLoad:
    fields = dict(
        role=InstanceRole.PREFILL,
        total_blocks=100,
        free_blocks=40,
        tokens_per_block=16,
        queued_requests=2,
        running_requests=5,
        queued_prompt_tokens=300,
        tokens_in_flight=900,
        num_paused=1,
        prefix_events=(
            PrefixEvent(PrefixEventKind.STORED, 1),
            PrefixEvent(PrefixEventKind.STORED, 2),
            PrefixEvent(PrefixEventKind.REMOVED, 2),
        ),
        num_finished=7,
        pending_context_tokens=500,
    )
    fields.update(overrides)
    return EngineLoad(**fields)


OUTPUT = RequestOutput(
    "r.p1",
    (5, 6),
    "ab",
    logprobs=(SampleLogprobs(TokenLogprob(5, -0.5), 1, (TokenLogprob(5, -0.5), TokenLogprob(9, -1.5))), None),
    finished=True,
    finish_reason=FinishReason.STOP,
    stop_reason="end",
    error=RequestError(ErrorCode.TRANSFER_FAILED, "boom", "CHECKSUM_MISMATCH"),
    context_done=True,
    handed_over=True,
    num_prompt_tokens=3,
    num_output_tokens=2,
    num_cached_tokens=1,
)
SUBMIT = SubmitRequest("r.g1", (1, 2, 3), PARAMS, RequestType.GENERATION_ONLY, (7,), priority=0.25)
INFO = InstanceInfo("g0", InstanceRole.GENERATION, "inc", "127.0.0.1:5", LAYOUT, 64, 264, 4096, 11, "cpu", "node")
BATCH = PollBatch(
    incarnation="inc",
    sequence=9,
    outputs=(OUTPUT, RequestOutput("r.c1", (), "")),
    events=(StateEvent("r.p1", LlmRequestState.CONTEXT_INIT, 1.5, "prefill started"),),
    reservations=(ReservationNotice("r.g1", "t-1", 4, 99.0),),
    push_results=(PushResult("r.p1", "t-1", False, "INTERNAL", "boom", 10, 0.5),),
    load=make_load(),
)

COMMANDS = [
    Submit(SUBMIT),
    Abort("r", "client went away"),
    Push("r", "127.0.0.1:5", "t-1", 2.5, "r.g1"),
    Push("r", "127.0.0.1:5", "t-1", 2.5),
    Release("r", FailureReason.CANCELLED, "gave up"),
    Poll(0.25),
    GetInfo(),
    Ping(),
    Drain(5.0),
    KvDigest("r", 16),
    Renew(("r.g1", "r.g2")),
    ReplaceTransferTls(DeploymentCa("d1").issue("g0")),
]
REPLIES = [INFO, BATCH, PollBatch("inc", 0), Ack(), Pong("inc"), Drained(2), Digest("ab" * 32), Rejected("prompt", "empty"),
           Unavailable("draining")]


def wire(message: object) -> list:
    return msgpack.unpackb(Encoder().encode(message), raw=False)


def pack(body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: type(c).__name__)
def test_every_command_round_trips(command):
    assert Decoder(Command).decode(Encoder().encode(command)) == command


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_every_reply_round_trips(reply):
    assert Decoder(Reply).decode(Encoder().encode(reply)) == reply


@pytest.mark.parametrize(
    "message", [SUBMIT, OUTPUT, BATCH.events[0], BATCH.reservations[0], BATCH.push_results[0], make_load(), INFO, BATCH],
    ids=lambda m: type(m).__name__,
)
def test_every_message_round_trips_as_its_own_type(message):
    decoded = Decoder(type(message)).decode(Encoder().encode(message))
    assert decoded == message
    assert type(decoded) is type(message)


def test_sampling_params_travel_as_a_typed_field_and_are_validated_again():
    decoded = Decoder(Submit).decode(Encoder().encode(Submit(SUBMIT))).request
    assert decoded.sampling_params == PARAMS and type(decoded.sampling_params) is SamplingParams
    body = wire(Submit(SUBMIT))
    body[1]["request"]["sampling_params"]["top_p"] = 1.5
    with pytest.raises(ProtocolError, match="top_p") as info:
        Decoder(Command).decode(pack(body))
    # The field check's own error is kept as the cause: the instance answers Rejected("top_p", ...).
    assert isinstance(info.value.__cause__.__cause__, InvalidSamplingParams)


def test_submit_request_checks_run_on_decode():
    body = wire(Submit(SUBMIT))
    body[1]["request"]["output_token_ids"] = []  # GENERATION_ONLY without its first token
    with pytest.raises(ProtocolError, match="output_token_ids") as info:
        Decoder(Command).decode(pack(body))
    assert isinstance(info.value.__cause__.__cause__, EngineInputError)


def test_the_envelope_carries_the_protocol_version():
    version, body = wire(Ping())
    assert version == PROTOCOL_VERSION
    assert body == {"type": "Ping"}


@pytest.mark.parametrize("version", [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 99])
def test_another_protocol_version_is_refused_naming_both(version):
    body = wire(BATCH)
    body[0] = version
    with pytest.raises(ProtocolVersionMismatch) as info:
        Decoder(Reply).decode(pack(body))
    assert info.value.peer_version == version
    assert f"version {version}" in str(info.value) and f"version {PROTOCOL_VERSION}" in str(info.value)


def test_a_version_1_poll_batch_is_refused_as_another_version():
    # Version 1 (hand-written msgpack maps) put the version under "v".
    legacy = pack({"v": 1, "incarnation": "inc", "seq": 3, "outputs": [], "events": []})
    with pytest.raises(ProtocolVersionMismatch, match="version 1"):
        Decoder(Reply).decode(legacy)


def test_version_is_checked_before_the_body():
    # A body this side cannot read is reported as a version problem, not as a malformed field.
    with pytest.raises(ProtocolVersionMismatch):
        Decoder(Reply).decode(pack([PROTOCOL_VERSION + 1, {"type": "PollBatch", "novel_field": [1, 2]}]))


def test_size_limit_on_encode_and_decode():
    load = make_load(prefix_events=tuple(PrefixEvent(PrefixEventKind.STORED, h) for h in range(1000)))
    data = Encoder().encode(load)
    with pytest.raises(MessageTooLarge) as info:
        Decoder(EngineLoad, max_message_bytes=len(data) - 1).decode(data)
    assert info.value.size_bytes == len(data) and info.value.limit_bytes == len(data) - 1
    assert Decoder(EngineLoad, max_message_bytes=len(data)).decode(data) == load
    with pytest.raises(MessageTooLarge):
        Encoder(max_message_bytes=len(data) - 1).encode(load)
    assert Encoder(max_message_bytes=len(data)).encode(load) == data


def test_oversized_input_is_refused_before_parsing():
    with pytest.raises(MessageTooLarge):
        Decoder(Reply).decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_what_msgpack_cannot_carry_is_refused_on_encode_never_pickled():
    with pytest.raises(ProtocolError, match="cannot encode"):
        Encoder().encode(object())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        pack([1, 2, 3]),
        pack("poll"),
        pack(None),
        pack({1: 2}),
        pack([PROTOCOL_VERSION]),  # no body
        pack([PROTOCOL_VERSION, {"type": "PollBatch", "incarnation": "x", "sequence": 1}, "extra"]),
        pack(["2", {"type": "Ping"}]),  # the version is not an integer
        Encoder().encode(BATCH)[:-3],  # truncated
        Encoder().encode(BATCH) + b"\x00",  # trailing bytes
        msgpack.packb([PROTOCOL_VERSION, msgpack.ExtType(5, b"xx")]),
        msgpack.packb([PROTOCOL_VERSION, msgpack.Timestamp(1)]),
        pack([PROTOCOL_VERSION, {"type": "Launch"}]),  # no such message
        pack([PROTOCOL_VERSION, {"type": "Ping", "extra": 1}]),  # unknown field
        b"\x92\x02" + b"\x91" * 5000 + b"\x00",  # deep nesting
        b"\x92\x02" + b"\x91" * 100_000 + b"\x00",  # deeper than the decoder recurses
    ],
)
def test_non_messages_are_refused(data):
    with pytest.raises(ProtocolError):
        Decoder(Reply).decode(data)


def test_non_bytes_input_is_refused():
    with pytest.raises(ProtocolError, match="expected bytes"):
        Decoder(Reply).decode("not bytes")  # type: ignore[arg-type]


def test_bytearray_and_memoryview_decode():
    data = Encoder().encode(BATCH)
    assert Decoder(Reply).decode(bytearray(data)) == BATCH
    assert Decoder(Reply).decode(memoryview(data)) == BATCH


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_protocol_errors(data):
    for expected in (Command, Reply):
        try:
            Decoder(expected).decode(data)
        except ProtocolError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupted_messages_raise_only_protocol_errors(data):
    raw = bytearray(Encoder().encode(BATCH))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        Decoder(Reply).decode(bytes(raw))
    except ProtocolError:
        pass


@pytest.mark.parametrize(
    ("message", "where"),
    [
        (Ping(), []),
        (BATCH, []),
        (BATCH, ["outputs", 0]),
        (BATCH, ["outputs", 0, "error"]),
        (BATCH, ["events", 0]),
        (BATCH, ["reservations", 0]),
        (BATCH, ["push_results", 0]),
        (BATCH, ["load"]),
        (INFO, []),
        (Submit(SUBMIT), ["request"]),
        (Release("r", FailureReason.CANCELLED), []),
    ],
)
def test_unknown_fields_are_refused(message, where):
    body = wire(message)
    node = body[1]
    for key in where:
        node = node[key]
    node["added_later"] = 0
    with pytest.raises(ProtocolError, match="unknown field `added_later`"):
        Decoder(Reply if isinstance(message, (PollBatch, InstanceInfo)) else Command).decode(pack(body))


@pytest.mark.parametrize("key", ["role", "total_blocks", "free_blocks", "tokens_per_block"])
def test_every_required_load_field_is_required(key):
    body = wire(make_load())
    del body[1][key]
    with pytest.raises(ProtocolError, match=f"missing required field `{key}`"):
        Decoder(EngineLoad).decode(pack(body))


COUNTERS = ["total_blocks", "free_blocks", "tokens_per_block", "queued_requests", "running_requests",
            "queued_prompt_tokens", "tokens_in_flight", "num_paused", "num_finished", "pending_context_tokens"]


@pytest.mark.parametrize("key", COUNTERS)
@pytest.mark.parametrize("bad", [True, 1.0, "3", None, -1, [1], MAX_COUNTER + 1])
def test_load_counters_refuse_wrong_types_and_ranges(key, bad):
    body = wire(make_load())
    body[1][key] = bad
    with pytest.raises(ProtocolError, match=key):  # a wrong type "at `$.key`", a range "key: ..."
        Decoder(EngineLoad).decode(pack(body))


@pytest.mark.parametrize(
    ("key", "bad", "match"),
    [
        ("total_blocks", 0, "total_blocks"),
        ("tokens_per_block", 0, "tokens_per_block"),
        ("free_blocks", 101, "exceeds total_blocks"),
        ("role", "decoder", "Invalid enum value 'decoder'"),
        ("role", 1, "Expected `str`"),
        ("prefix_events", {"kind": "stored"}, "Expected `array`"),
        ("prefix_events", None, "Expected `array`"),
    ],
)
def test_load_values_out_of_range_are_refused(key, bad, match):
    body = wire(make_load())
    body[1][key] = bad
    with pytest.raises(ProtocolError, match=match):
        Decoder(EngineLoad).decode(pack(body))


@pytest.mark.parametrize(
    "event",
    [
        "stored",
        {"kind": "stored"},
        {"kind": "evicted", "block_hash": 1},
        {"kind": 1, "block_hash": 1},
        {"kind": "stored", "block_hash": -1},
        {"kind": "stored", "block_hash": 1.5},
        {"kind": "stored", "block_hash": "ab"},
        {"kind": "stored", "block_hash": True},
        {"kind": "stored", "block_hash": [1]},
    ],
)
def test_malformed_prefix_events_are_refused(event):
    body = wire(make_load())
    body[1]["prefix_events"] = [event]
    with pytest.raises(ProtocolError, match=r"prefix_events"):
        Decoder(EngineLoad).decode(pack(body))


def test_largest_block_hash_round_trips():
    load = make_load(prefix_events=(PrefixEvent(PrefixEventKind.STORED, MAX_BLOCK_HASH), PrefixEvent(PrefixEventKind.REMOVED, 0)))
    assert Decoder(EngineLoad).decode(Encoder().encode(load)) == load


@pytest.mark.parametrize(
    ("message", "path", "bad", "match"),
    [
        (BATCH, ["sequence"], "9", r"Expected `int`, got `str` - at `\$.sequence`"),
        (BATCH, ["outputs", 0, "new_token_ids"], [1, "2"], r"at `\$.outputs\[0\].new_token_ids\[1\]`"),
        (BATCH, ["outputs", 0, "finish_reason"], "tired", r"Invalid enum value 'tired'"),
        (BATCH, ["outputs", 0, "stop_reason"], 1.5, r"at `\$.outputs\[0\].stop_reason`"),
        (BATCH, ["outputs", 0, "logprobs"], [[1, 2]], r"at `\$.outputs\[0\].logprobs\[0\]`"),
        (BATCH, ["events", 0, "time_s"], float("nan"), "finite"),
        (BATCH, ["events", 0, "time_s"], float("inf"), "finite"),
        (BATCH, ["push_results", 0, "ok"], 1, r"Expected `bool`"),
        (INFO, ["layout", "num_layers"], 0, "num_layers must be a positive integer"),
        (INFO, ["role"], "WORKER", "Invalid enum value 'WORKER'"),
        (Poll(1.0), ["timeout_s"], float("nan"), "timeout_s"),
        (Drain(1.0), ["timeout_s"], -1.0, "timeout_s"),
        (Push("r", "t", "x", 1.0), ["deadline_s"], float("inf"), "deadline_s"),
        (Release("r", FailureReason.CANCELLED), ["reason"], "BORED", "Invalid enum value 'BORED'"),
    ],
)
def test_wrong_values_are_refused_naming_where(message, path, bad, match):
    body = wire(message)
    node = body[1]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(ProtocolError, match=match):
        Decoder(Reply if isinstance(message, (PollBatch, InstanceInfo)) else Command).decode(pack(body))


def test_an_integer_time_is_read_as_a_float():
    body = wire(BATCH.events[0])
    body[1]["time_s"] = 12
    event = Decoder(StateEvent).decode(pack(body))
    assert event.time_s == 12.0 and type(event.time_s) is float


def test_a_reply_of_another_kind_is_told_apart_by_its_tag():
    assert wire(Ack())[1] == {"type": "Ack"}
    assert isinstance(Decoder(Reply).decode(Encoder().encode(Rejected("prompt", "empty"))), Rejected)


# --- the load type, in process ------------------------------------------------------------------------
def test_derived_block_counts():
    load = make_load(total_blocks=100, free_blocks=40, queued_prompt_tokens=33, tokens_per_block=16)
    assert load.used_blocks == 60
    assert load.queued_prompt_blocks == 3


def test_in_process_construction_is_validated_too():
    with pytest.raises(ValueError, match="free_blocks"):
        make_load(free_blocks=101)
    with pytest.raises(ValueError, match="role"):
        make_load(role="prefill")
    with pytest.raises(ValueError, match="num_paused"):
        make_load(num_paused=True)
    with pytest.raises(ValueError, match="pending_context_tokens: 299 is less than queued_prompt_tokens 300"):
        make_load(pending_context_tokens=299)
    with pytest.raises(ValueError, match="prefix_events"):
        make_load(prefix_events=[PrefixEvent(PrefixEventKind.STORED, 1)])
    with pytest.raises(ValueError, match="block hash"):
        make_load(prefix_events=(PrefixEvent(PrefixEventKind.STORED, MAX_BLOCK_HASH + 1),))


def test_messages_are_immutable():
    with pytest.raises(AttributeError):
        make_load().free_blocks = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        BATCH.sequence = 1  # type: ignore[misc]


counters = st.integers(min_value=0, max_value=MAX_COUNTER)


@st.composite
def loads(draw) -> EngineLoad:
    total = draw(st.integers(1, MAX_COUNTER))
    return EngineLoad(
        role=draw(st.sampled_from(InstanceRole)),
        total_blocks=total,
        free_blocks=draw(st.integers(0, total)),
        tokens_per_block=draw(st.integers(1, MAX_COUNTER)),
        queued_requests=draw(counters),
        running_requests=draw(counters),
        queued_prompt_tokens=(queued := draw(counters)),
        tokens_in_flight=draw(counters),
        num_paused=draw(counters),
        prefix_events=tuple(
            draw(st.lists(st.builds(PrefixEvent, st.sampled_from(PrefixEventKind), st.integers(0, MAX_BLOCK_HASH)), max_size=8))
        ),
        num_finished=draw(counters),
        pending_context_tokens=draw(st.integers(queued, MAX_COUNTER)),  # it includes the queue
    )


@settings(max_examples=100, deadline=None)
@given(loads(), st.integers(0, MAX_COUNTER), st.text(max_size=40))
def test_poll_batches_round_trip(load, sequence, text):
    batch = PollBatch("inc", sequence, outputs=(RequestOutput("r", (1,), text),), load=load)
    assert Decoder(Reply).decode(Encoder().encode(batch)) == batch
