"""Chunk framing, header checks, chunk planning, failure-reason mapping, ids, buffers and config."""

from __future__ import annotations

import random
import zlib

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from duet_wire.v1 import kv_transfer_pb2 as pb
from worker.kv_layout import KvLayout
from worker.kv_transfer import codec
from worker.kv_transfer.auth import TokenError, check_token
from worker.kv_transfer.buffers import BufferRangeError, LinearKvBuffer
from worker.kv_transfer.config import ReceiverConfig, SenderConfig, TransferConfigError, TransportSecurity
from worker.kv_transfer.failures import (
    FAILURE_METADATA_KEY,
    FailureReason,
    TransferFailure,
    TransferRejected,
    reason_from_grpc,
    reason_to_grpc_code,
)
from worker.kv_transfer.ids import InvalidIdentifier, check_request_id, check_transfer_id, new_transfer_id
from worker.kv_transfer.plan import ChunkPlanError, ChunkSpec, assign_streams, plan_chunks

LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, tokens_per_block=2, dtype="float16", model_fingerprint="m")


def _header(spec: ChunkSpec, data: bytes, layout: KvLayout = LAYOUT) -> pb.KvChunkHeader:
    return codec.make_header("t" * 20, "req-1", spec, layout, zlib.crc32(data))


# -- framing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 127, 128, 300, 70_000])
def test_encoded_chunk_is_a_valid_kvchunk_and_decodes_without_copying(size: int) -> None:
    data = random.Random(size).randbytes(size)
    header = _header(ChunkSpec(3, 0, 1, 0, 1), data)
    raw = codec.encode_chunk(header, memoryview(data))
    assert pb.KvChunk.FromString(raw) == pb.KvChunk(header=header, data=data)
    decoded = codec.decode_chunk(raw)
    assert isinstance(decoded, codec.DecodedChunk)
    assert decoded.header == header
    assert bytes(decoded.data) == data
    assert decoded.data.obj is raw  # a slice of the received message, not a copy


def test_other_valid_encodings_fall_back_to_protobuf_parsing() -> None:
    data = b"\x01\x02\x03\x04"
    header = _header(ChunkSpec(0, 0, 1, 0, 1), data)
    reordered = pb.KvChunk(data=data).SerializeToString() + pb.KvChunk(header=header).SerializeToString()
    decoded = codec.decode_chunk(reordered)
    assert isinstance(decoded, codec.DecodedChunk)
    assert decoded.header == header and bytes(decoded.data) == data


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x0a",  # header tag, no length
        b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # varint longer than 10 bytes
        b"\x0a\x05ab",  # header length beyond the message
        b"\x0a\x00\x12\x10abc",  # data length beyond the message
        b"\x0a\x00\x12\x01abc",  # trailing bytes after the data
        b"\xff\xff\xff",  # not protobuf
    ],
)
def test_malformed_messages_become_malformedchunk_never_an_exception(raw: bytes) -> None:
    assert isinstance(codec.decode_chunk(raw), codec.MalformedChunk)


def test_oversized_header_is_refused() -> None:
    big = pb.KvChunkHeader(transfer_id="x" * (codec.MAX_HEADER_BYTES + 10))
    raw = codec.encode_chunk(big, b"abcd")
    result = codec.decode_chunk(raw)
    assert isinstance(result, codec.MalformedChunk) and "exceeds" in result.detail


@given(st.binary(max_size=64))
def test_decoder_never_raises_on_arbitrary_bytes(raw: bytes) -> None:
    assert isinstance(codec.decode_chunk(raw), codec.DecodedChunk | codec.MalformedChunk)


# -- header checks ----------------------------------------------------------------------------------


def _valid_header_and_length(spec: ChunkSpec) -> tuple[pb.KvChunkHeader, int]:
    data = bytes(spec.size_bytes(LAYOUT))
    return _header(spec, data), len(data)


def test_a_valid_header_has_no_problem() -> None:
    header, length = _valid_header_and_length(ChunkSpec(0, 1, 3, 2, 5))
    assert codec.header_problem(header, length, LAYOUT, num_blocks=5, max_chunk_bytes=1 << 20) is None


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda h: setattr(h, "layer_end", 4), "layer range"),
        (lambda h: setattr(h, "layer_start", 3), "layer range"),
        (lambda h: setattr(h, "block_end", 6), "block range"),
        (lambda h: setattr(h, "block_start", 5), "block range"),
        (lambda h: setattr(h, "dtype", "float32"), "dtype"),
        (lambda h: h.shape.__setitem__(3, 99), "shape"),
        (lambda h: setattr(h, "byte_length", h.byte_length + 2), "byte_length"),
        (lambda h: setattr(h, "checksum_algorithm", pb.CHECKSUM_ALGORITHM_UNSPECIFIED), "checksum algorithm"),
        (lambda h: setattr(h, "sequence", 10**9), "sequence"),
    ],
)
def test_header_problems_are_named(mutate, expected: str) -> None:
    header, length = _valid_header_and_length(ChunkSpec(0, 1, 3, 2, 5))
    mutate(header)
    problem = codec.header_problem(header, length, LAYOUT, num_blocks=5, max_chunk_bytes=1 << 20)
    assert problem is not None and expected in problem


def test_data_shorter_than_the_header_says_is_a_problem() -> None:
    header, length = _valid_header_and_length(ChunkSpec(0, 0, 1, 0, 1))
    assert "data length" in codec.header_problem(header, length - 1, LAYOUT, 5, 1 << 20)


def test_chunk_over_the_negotiated_limit_is_a_problem() -> None:
    header, length = _valid_header_and_length(ChunkSpec(0, 0, 3, 0, 5))
    assert "limit" in codec.header_problem(header, length, LAYOUT, 5, max_chunk_bytes=length - 1)


def test_layout_round_trips_through_proto() -> None:
    assert codec.layout_from_proto(codec.layout_to_proto(LAYOUT)) == LAYOUT


def test_checksum_negotiation_picks_the_first_common_algorithm() -> None:
    xxh3, crc32 = pb.CHECKSUM_ALGORITHM_XXH3_64, pb.CHECKSUM_ALGORITHM_CRC32
    assert codec.choose_checksum([]) == crc32  # a peer from before the negotiation
    assert codec.choose_checksum([99, crc32]) == crc32
    assert codec.choose_checksum([99]) is None
    # The sender's preference wins among the common ones.
    assert codec.choose_checksum([xxh3, crc32]) == xxh3
    assert codec.choose_checksum([crc32, xxh3]) == crc32
    assert codec.choose_checksum([99, xxh3]) == xxh3
    # This side prefers XXH3-64 and still speaks CRC-32.
    assert codec.SUPPORTED_CHECKSUMS == (xxh3, crc32)
    assert SenderConfig().checksum_algorithm_values == (xxh3, crc32)


# -- checksums ---------------------------------------------------------------------------------------


def test_checksums_match_the_reference_algorithms() -> None:
    # XXH3-64 with seed 0 (xxHash's published values), and zlib's CRC-32.
    assert codec.checksum(b"", pb.CHECKSUM_ALGORITHM_XXH3_64) == 0x2D06800538D394C2
    assert codec.checksum(b"hello world", pb.CHECKSUM_ALGORITHM_XXH3_64) == 0xD447B1EA40E6988B
    assert codec.checksum(b"hello world", pb.CHECKSUM_ALGORITHM_CRC32) == zlib.crc32(b"hello world") == 0x0D4A1185
    assert codec.checksum_name(pb.CHECKSUM_ALGORITHM_XXH3_64) == "XXH3_64"


@pytest.mark.parametrize("algorithm", [pb.CHECKSUM_ALGORITHM_XXH3_64, pb.CHECKSUM_ALGORITHM_CRC32])
@given(parts=st.lists(st.binary(max_size=3000), max_size=5))
def test_checksum_of_parts_equals_checksum_of_their_concatenation(algorithm: int, parts: list[bytes]) -> None:
    views = [memoryview(part) for part in parts]
    expected = codec.checksum(b"".join(parts), algorithm)
    assert codec.checksum_parts(views, algorithm) == expected
    if any(parts):
        flipped = bytearray(b"".join(parts))
        flipped[len(flipped) // 2] ^= 0x01
        assert codec.checksum(flipped, algorithm) != expected


@pytest.mark.parametrize("algorithm", [pb.CHECKSUM_ALGORITHM_UNSPECIFIED, 99])
def test_unsupported_checksum_algorithms_raise(algorithm: int) -> None:
    with pytest.raises(codec.UnsupportedChecksum):
        codec.checksum(b"abc", algorithm)
    with pytest.raises(codec.UnsupportedChecksum):
        codec.checksum_parts([b"a", b"bc"], algorithm)


def test_encoding_from_parts_equals_encoding_of_the_joined_data() -> None:
    parts = [random.Random(index).randbytes(size) for index, size in enumerate((0, 5, 200, 70_000))]
    joined = b"".join(parts)
    header = _header(ChunkSpec(1, 0, 1, 0, 1), joined)
    raw = codec.encode_chunk_parts(header, [memoryview(part) for part in parts])
    assert raw == codec.encode_chunk(header, joined)
    decoded = codec.decode_chunk(raw)
    assert isinstance(decoded, codec.DecodedChunk) and bytes(decoded.data) == joined


# -- planning ----------------------------------------------------------------------------------------


@given(
    num_layers=st.integers(1, 6),
    num_blocks=st.integers(1, 40),
    max_blocks_per_chunk=st.integers(1, 300),
)
def test_plan_covers_every_cell_exactly_once_within_the_limit(num_layers: int, num_blocks: int, max_blocks_per_chunk: int) -> None:
    layout = KvLayout(num_layers, 1, 2, 2, "float32", "m")
    limit = max_blocks_per_chunk * layout.block_bytes_per_layer
    chunks = plan_chunks(layout, num_blocks, limit)
    seen = [[0] * num_blocks for _ in range(num_layers)]
    for index, chunk in enumerate(chunks):
        assert chunk.sequence == index
        assert chunk.size_bytes(layout) <= limit
        for layer in range(chunk.layer_start, chunk.layer_end):
            for block in range(chunk.block_start, chunk.block_end):
                seen[layer][block] += 1
    assert all(count == 1 for row in seen for count in row)
    streams = assign_streams(chunks, 3)
    assert sorted(c.sequence for stream in streams for c in stream) == list(range(len(chunks)))
    assert all(streams) and len(streams) == min(3, len(chunks))


def test_plan_prefers_whole_layers() -> None:
    layout = KvLayout(8, 1, 2, 2, "float32", "m")
    chunks = plan_chunks(layout, 4, max_chunk_bytes=3 * 4 * layout.block_bytes_per_layer)
    assert all(c.block_start == 0 and c.block_end == 4 for c in chunks)
    assert [c.num_layers for c in chunks] == [3, 3, 2]


def test_plan_refuses_a_block_bigger_than_the_limit() -> None:
    with pytest.raises(ChunkPlanError):
        plan_chunks(LAYOUT, 2, max_chunk_bytes=LAYOUT.block_bytes_per_layer - 1)


# -- failures ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reason", list(FailureReason))
def test_every_reason_round_trips_through_status_and_metadata(reason: FailureReason) -> None:
    code = reason_to_grpc_code(reason)
    assert code != grpc.StatusCode.OK
    assert reason_from_grpc(code, [(FAILURE_METADATA_KEY, reason.value)]) is reason
    assert codec.reason_from_proto(codec.reason_to_proto(reason)) is reason


def test_without_metadata_the_code_decides() -> None:
    assert reason_from_grpc(grpc.StatusCode.DATA_LOSS) is FailureReason.CHECKSUM_MISMATCH
    assert reason_from_grpc(grpc.StatusCode.UNAVAILABLE) is FailureReason.PEER_UNAVAILABLE
    assert reason_from_grpc(grpc.StatusCode.FAILED_PRECONDITION) is FailureReason.INCOMPATIBLE
    assert reason_from_grpc(grpc.StatusCode.NOT_FOUND, [(FAILURE_METADATA_KEY, "from-the-future")]) is (
        FailureReason.UNKNOWN_TRANSFER
    )
    with pytest.raises(ValueError):
        reason_from_grpc(grpc.StatusCode.OK)


def test_every_proto_reason_has_a_python_reason() -> None:
    for name in pb.TransferFailureReason.keys():
        value = pb.TransferFailureReason.Value(name)
        mapped = codec.reason_from_proto(value)
        assert (mapped is None) == name.endswith("UNSPECIFIED")


def test_typed_failures_and_rejections() -> None:
    failure = TransferFailure(FailureReason.INCOMPLETE, "3 cells missing")
    assert failure.grpc_code == grpc.StatusCode.ABORTED and str(failure) == "INCOMPLETE: 3 cells missing"
    rejected = TransferRejected(FailureReason.RESOURCE_EXHAUSTED, "full")
    assert rejected.failure == TransferFailure(FailureReason.RESOURCE_EXHAUSTED, "full")
    with pytest.raises(TypeError):
        TransferRejected("RESOURCE_EXHAUSTED")  # type: ignore[arg-type]


# -- ids, tokens, config -----------------------------------------------------------------------------


def test_transfer_ids_are_unguessable_and_validated() -> None:
    ids = {new_transfer_id() for _ in range(100)}
    assert len(ids) == 100 and all(check_transfer_id(i) == i and len(i) == 32 for i in ids)
    for bad in ["", "short", "a" * 65, "has space 1234567890", "é" * 20, None, 12345678901234567890]:
        with pytest.raises(InvalidIdentifier):
            check_transfer_id(bad)
    assert check_request_id("req-1") == "req-1"
    # The one request-id rule: printable ASCII 0x20-0x7E, spaces included (a client's id crosses
    # the KV path as it is).
    for good in ["a b", " lead and trail ", "".join(map(chr, range(0x20, 0x7F))), "x" * 256]:
        assert check_request_id(good) == good
    for bad in ["", "x" * 257, "tab\there", "del\x7f", "é", 7, None]:
        with pytest.raises(InvalidIdentifier):
            check_request_id(bad)


def test_tokens_must_be_long_printable_ascii() -> None:
    assert check_token("a" * 16) == "a" * 16
    for bad in ["short", "a" * 15, " " + "a" * 20, "ü" * 20, "a\nb" * 10, None]:
        with pytest.raises(TokenError):
            check_token(bad)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(TransferConfigError, match="max_chunk_bytes"):
        ReceiverConfig(max_chunk_bytes=10)
    with pytest.raises(TransferConfigError, match="port"):
        ReceiverConfig(port=70000)
    with pytest.raises(TransferConfigError, match="unknown ReceiverConfig field"):
        ReceiverConfig.from_mapping({"max_chunk_byte": 1 << 20})
    with pytest.raises(TransferConfigError, match="num_streams"):
        SenderConfig.from_mapping({"num_streams": 0})
    with pytest.raises(TransferConfigError, match="token"):
        TransportSecurity(token="short")
    assert "secret" not in repr(TransportSecurity(token="secret-token-0123456789"))
    assert SenderConfig.from_mapping({"num_streams": 3}).num_streams == 3


@pytest.mark.parametrize("bad", [(), ("MD5",), ("CRC32", "CRC32"), "CRC32", ("UNSPECIFIED",), (1,)])
def test_sender_checksum_algorithms_are_validated(bad) -> None:
    with pytest.raises(TransferConfigError, match="checksum_algorithms"):
        SenderConfig(checksum_algorithms=bad)


def test_sender_checksum_algorithms_keep_their_order_and_load_from_lists() -> None:
    config = SenderConfig.from_mapping({"checksum_algorithms": ["CRC32", "XXH3_64"]})
    assert config.checksum_algorithms == ("CRC32", "XXH3_64")
    assert config.checksum_algorithm_values == (pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_XXH3_64)


# -- buffers -----------------------------------------------------------------------------------------


def _reference_read(layout: KvLayout, num_blocks: int, storage: bytes, l0: int, l1: int, b0: int, b1: int) -> bytes:
    half = layout.block_bytes_per_layer // 2
    out = b""
    for layer in range(l0, l1):
        for kv in (0, 1):
            for block in range(b0, b1):
                start = ((layer * 2 + kv) * num_blocks + block) * half
                out += storage[start : start + half]
    return out


@given(st.data())
def test_linear_buffer_reads_and_writes_ranges_in_chunk_layout(data: st.DataObject) -> None:
    num_blocks = data.draw(st.integers(1, 6))
    l0 = data.draw(st.integers(0, LAYOUT.num_layers - 1))
    l1 = data.draw(st.integers(l0 + 1, LAYOUT.num_layers))
    b0 = data.draw(st.integers(0, num_blocks - 1))
    b1 = data.draw(st.integers(b0 + 1, num_blocks))
    storage = bytearray(random.Random(num_blocks).randbytes(LAYOUT.run_bytes(LAYOUT.num_layers, num_blocks)))
    source = LinearKvBuffer(LAYOUT, num_blocks, storage)
    expected = _reference_read(LAYOUT, num_blocks, bytes(storage), l0, l1, b0, b1)
    assert bytes(source.read(l0, l1, b0, b1)) == expected
    parts = source.read_parts(l0, l1, b0, b1)
    assert b"".join(parts) == expected
    assert all(isinstance(part, memoryview) and part.obj is storage for part in parts)  # views, not copies
    # One part for a run of whole layers (contiguous), else one per (layer, K|V) row.
    assert len(parts) == (1 if (b0, b1) == (0, num_blocks) else 2 * (l1 - l0))
    target = LinearKvBuffer(LAYOUT, num_blocks)
    target.write(l0, l1, b0, b1, expected)
    assert _reference_read(LAYOUT, num_blocks, bytes(target.view), l0, l1, b0, b1) == expected


def test_linear_buffer_rejects_bad_ranges_and_lengths() -> None:
    buffer = LinearKvBuffer(LAYOUT, 2)
    with pytest.raises(BufferRangeError):
        buffer.read(0, 4, 0, 1)
    with pytest.raises(BufferRangeError):
        buffer.write(0, 1, 0, 1, b"short")
    with pytest.raises(BufferRangeError):
        LinearKvBuffer(LAYOUT, 2, bytearray(3))
