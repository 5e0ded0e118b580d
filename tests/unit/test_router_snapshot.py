"""Load snapshots: msgpack round trip, strict validation, size limit."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.router.snapshot import (
    DEFAULT_MAX_SNAPSHOT_BYTES,
    MAX_BLOCK_HASH,
    MAX_COUNTER,
    SCHEMA_VERSION,
    InstanceLoad,
    InstanceRole,
    InvalidSnapshot,
    PrefixEvent,
    PrefixEventKind,
    SnapshotError,
    SnapshotTooLarge,
    UnsupportedSchemaVersion,
    decode,
    encode,
)


def make_load(**overrides) -> InstanceLoad:
    fields = dict(
        instance_id="prefill-0",
        role=InstanceRole.PREFILL,
        sequence=3,
        timestamp_s=12.5,
        total_blocks=100,
        free_blocks=40,
        tokens_per_block=16,
        queued_requests=2,
        running_requests=5,
        queued_prompt_tokens=300,
        tokens_in_flight=900,
        num_paused=1,
        prefix_events=(
            PrefixEvent(PrefixEventKind.STORED, (1, 2, 3)),
            PrefixEvent(PrefixEventKind.REMOVED, (2,)),
        ),
        reset=False,
    )
    fields.update(overrides)
    return InstanceLoad(**fields)


def wire(load: InstanceLoad | None = None) -> dict:
    return msgpack.unpackb(encode(load or make_load()), raw=False)


def pack(body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


counters = st.integers(min_value=0, max_value=MAX_COUNTER)
events = st.builds(
    PrefixEvent,
    kind=st.sampled_from(PrefixEventKind),
    block_hashes=st.lists(st.integers(0, MAX_BLOCK_HASH), min_size=1, max_size=8).map(tuple),
)


@st.composite
def loads(draw) -> InstanceLoad:
    total = draw(st.integers(1, MAX_COUNTER))
    return InstanceLoad(
        instance_id=draw(
            st.text(st.characters(categories=["L", "N", "P", "Zs"]), min_size=1, max_size=128).filter(
                str.isprintable
            )
        ),
        role=draw(st.sampled_from(InstanceRole)),
        sequence=draw(counters),
        timestamp_s=draw(st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)),
        total_blocks=total,
        free_blocks=draw(st.integers(0, total)),
        tokens_per_block=draw(st.integers(1, MAX_COUNTER)),
        queued_requests=draw(counters),
        running_requests=draw(counters),
        queued_prompt_tokens=draw(counters),
        tokens_in_flight=draw(counters),
        num_paused=draw(counters),
        prefix_events=tuple(draw(st.lists(events, max_size=5))),
        reset=draw(st.booleans()),
    )


@settings(max_examples=100, deadline=None)
@given(loads())
def test_round_trip(load):
    assert decode(encode(load)) == load


def test_round_trip_accepts_bytearray_and_memoryview():
    data = encode(make_load())
    assert decode(bytearray(data)) == make_load()
    assert decode(memoryview(data)) == make_load()


def test_wire_carries_the_schema_version():
    assert wire()["schema_version"] == SCHEMA_VERSION


def test_derived_block_counts():
    load = make_load(total_blocks=100, free_blocks=40, queued_prompt_tokens=33, tokens_per_block=16)
    assert load.used_blocks == 60
    assert load.queued_prompt_blocks == 3


# --- malformed input ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_snapshot_errors(data):
    try:
        decode(data)
    except SnapshotError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupted_snapshots_raise_only_snapshot_errors(data):
    raw = bytearray(encode(make_load()))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(raw))
    except SnapshotError:
        pass


@pytest.mark.parametrize("key", sorted(wire()))
def test_every_missing_key_is_rejected_by_name(key):
    body = wire()
    del body[key]
    with pytest.raises(InvalidSnapshot) as info:
        decode(pack(body))
    assert info.value.field == key


def test_unknown_key_is_rejected():
    body = wire()
    body["free_blocks_ratio"] = 0.4
    with pytest.raises(InvalidSnapshot) as info:
        decode(pack(body))
    assert info.value.field == "free_blocks_ratio"


INT_FIELDS = [
    "sequence",
    "total_blocks",
    "free_blocks",
    "tokens_per_block",
    "queued_requests",
    "running_requests",
    "queued_prompt_tokens",
    "tokens_in_flight",
    "num_paused",
]


@pytest.mark.parametrize("key", INT_FIELDS)
@pytest.mark.parametrize("bad", [True, 1.0, "3", None, -1, [1], MAX_COUNTER + 1])
def test_integer_fields_reject_wrong_types_and_ranges(key, bad):
    body = wire()
    body[key] = bad
    with pytest.raises(InvalidSnapshot) as info:
        decode(pack(body))
    assert info.value.field == key


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("total_blocks", 0),
        ("tokens_per_block", 0),
        ("free_blocks", 101),  # above total_blocks
        ("timestamp_s", -1.0),
        ("timestamp_s", float("nan")),
        ("timestamp_s", float("inf")),
        ("timestamp_s", "now"),
        ("timestamp_s", True),
        ("instance_id", ""),
        ("instance_id", 7),
        ("instance_id", "x" * 129),
        ("instance_id", "bad\nid"),
        ("role", "decoder"),
        ("role", 1),
        ("reset", 1),
        ("reset", "yes"),
        ("prefix_events", {"kind": "stored"}),
        ("prefix_events", None),
    ],
)
def test_field_values_out_of_range_are_rejected(key, bad):
    body = wire()
    body[key] = bad
    with pytest.raises(InvalidSnapshot) as info:
        decode(pack(body))
    assert info.value.field == key


def test_integer_timestamp_is_accepted_as_float():
    body = wire()
    body["timestamp_s"] = 12
    load = decode(pack(body))
    assert load.timestamp_s == 12.0 and type(load.timestamp_s) is float


@pytest.mark.parametrize(
    ("event", "field"),
    [
        ("stored", "prefix_events[0]"),
        ({"kind": "stored"}, "prefix_events[0].block_hashes"),
        ({"kind": "stored", "block_hashes": [1], "parent": 0}, "prefix_events[0].parent"),
        ({"kind": "evicted", "block_hashes": [1]}, "prefix_events[0].kind"),
        ({"kind": 1, "block_hashes": [1]}, "prefix_events[0].kind"),
        ({"kind": "stored", "block_hashes": []}, "prefix_events[0].block_hashes"),
        ({"kind": "stored", "block_hashes": [-1]}, "prefix_events[0].block_hashes"),
        ({"kind": "stored", "block_hashes": [1.5]}, "prefix_events[0].block_hashes"),
        ({"kind": "stored", "block_hashes": ["ab"]}, "prefix_events[0].block_hashes"),
        ({"kind": "stored", "block_hashes": [True]}, "prefix_events[0].block_hashes"),
        ({"kind": "stored", "block_hashes": 5}, "prefix_events[0].block_hashes"),
    ],
)
def test_malformed_prefix_events_are_rejected(event, field):
    body = wire()
    body["prefix_events"] = [event]
    with pytest.raises(InvalidSnapshot) as info:
        decode(pack(body))
    assert info.value.field == field


def test_largest_block_hash_round_trips():
    load = make_load(prefix_events=(PrefixEvent(PrefixEventKind.STORED, (MAX_BLOCK_HASH, 0)),))
    assert decode(encode(load)) == load


@pytest.mark.parametrize("version", [0, 2, 99])
def test_other_schema_versions_are_rejected(version):
    body = wire()
    body["schema_version"] = version
    with pytest.raises(UnsupportedSchemaVersion):
        decode(pack(body))


@pytest.mark.parametrize("version", [None, "1", 1.0])
def test_schema_version_must_be_an_integer(version):
    body = wire()
    body["schema_version"] = version
    with pytest.raises(InvalidSnapshot) as info:
        decode(pack(body))
    assert info.value.field == "schema_version"


@pytest.mark.parametrize(
    "data",
    [
        pack([1, 2, 3]),
        pack("snapshot"),
        pack(None),
        encode(make_load())[:-3],  # truncated
        encode(make_load()) + b"\x00",  # trailing bytes
        pack({1: 2}),  # integer map key
        pack({b"schema_version": 1}),  # binary map key
        msgpack.packb(msgpack.ExtType(5, b"xx")),
        msgpack.packb(msgpack.Timestamp(1)),
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x91" * 5000 + b"\x00",  # deep nesting
    ],
)
def test_non_snapshot_documents_are_rejected(data):
    with pytest.raises(InvalidSnapshot):
        decode(data)


def test_non_bytes_input_is_rejected():
    with pytest.raises(InvalidSnapshot):
        decode("not bytes")  # type: ignore[arg-type]


def test_size_limit_on_decode_and_encode():
    load = make_load(prefix_events=(PrefixEvent(PrefixEventKind.STORED, tuple(range(1000))),))
    data = encode(load)
    with pytest.raises(SnapshotTooLarge) as info:
        decode(data, max_size_bytes=len(data) - 1)
    assert info.value.size_bytes == len(data)
    assert decode(data, max_size_bytes=len(data)) == load
    with pytest.raises(SnapshotTooLarge):
        encode(load, max_size_bytes=len(data) - 1)


def test_oversized_input_is_rejected_before_parsing():
    with pytest.raises(SnapshotTooLarge):
        decode(b"\x00" * (DEFAULT_MAX_SNAPSHOT_BYTES + 1))


def test_in_process_construction_is_validated_too():
    with pytest.raises(InvalidSnapshot) as info:
        make_load(free_blocks=101)
    assert info.value.field == "free_blocks"
    with pytest.raises(InvalidSnapshot):
        make_load(role="prefill")
    with pytest.raises(InvalidSnapshot):
        make_load(timestamp_s=1)  # in process, a float field takes a float
    with pytest.raises(InvalidSnapshot):
        make_load(prefix_events=[PrefixEvent(PrefixEventKind.STORED, (1,))])
    with pytest.raises(InvalidSnapshot):
        PrefixEvent(PrefixEventKind.STORED, (MAX_BLOCK_HASH + 1,))


def test_snapshots_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_load().free_blocks = 3  # type: ignore[misc]
