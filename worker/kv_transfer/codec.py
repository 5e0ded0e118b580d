"""The wire form of chunks and layouts, chunk checksums, and the checks a receiver applies to every
chunk header.

A chunk is a `duet_wire.v1.KvChunk` protobuf message, but it is (de)serialized by hand so that the
raw KV bytes are never parsed or copied by protobuf: the encoder writes field 1 (the header) and
then field 2 (the data) with their length prefixes, which is exactly the protobuf encoding, in one
join straight from the source's buffers (the only copy this side makes; gRPC Python needs the
message as one `bytes` object); the decoder reads the two prefixes and takes the data as a
memoryview slice of the received message. Any other valid encoding of KvChunk (fields reordered,
say) falls back to a regular protobuf parse.

Checksums: XXH3-64 (xxhash) is preferred, CRC-32 (zlib) is the fallback every peer supports. Both
release the GIL on large buffers, so the checksums of parallel streams run on separate cores.
Measured on the 2-core development machine (bench/transfer_bench.py prints both): XXH3-64 about
10-14 GB/s per core, zlib CRC-32 about 1.3-2.7 GB/s, which made CRC-32 a third of each side's CPU
time per transferred byte.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash
from google.protobuf.message import DecodeError

from duet_wire.v1 import kv_transfer_pb2 as pb
from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason
from worker.kv_transfer.frames import join_frame
from worker.kv_transfer.plan import ChunkSpec

MAX_HEADER_BYTES = 4096
# Room for the header and the length prefixes on top of the chunk payload, in message limits.
FRAME_OVERHEAD_BYTES = MAX_HEADER_BYTES + 64

_HEADER_TAG = 0x0A  # field 1, wire type 2 (length-delimited)
_DATA_TAG = 0x12  # field 2, wire type 2
_MAX_VARINT_BYTES = 10


@dataclass(frozen=True)
class DecodedChunk:
    header: pb.KvChunkHeader
    data: memoryview


@dataclass(frozen=True)
class MalformedChunk:
    """What the decoder returns instead of raising (grpc would turn a raise into INTERNAL)."""

    detail: str


# Checksum algorithms this side computes and verifies, most preferred first (the order a sender
# offers them in).
SUPPORTED_CHECKSUMS: tuple[int, ...] = (pb.CHECKSUM_ALGORITHM_XXH3_64, pb.CHECKSUM_ALGORITHM_CRC32)
# What a sender that offers no algorithm speaks: peers from before the negotiation knew only CRC-32.
LEGACY_CHECKSUM = pb.CHECKSUM_ALGORITHM_CRC32

Buffer = memoryview | bytes | bytearray


_CHECKSUM_PREFIX = "CHECKSUM_ALGORITHM_"


def checksum_name(algorithm: int) -> str:
    """A ChecksumAlgorithm value's short name ("XXH3_64", "CRC32"); raises ValueError for unknown values."""
    return pb.ChecksumAlgorithm.Name(algorithm).removeprefix(_CHECKSUM_PREFIX)


class UnsupportedChecksum(ValueError):
    """A checksum algorithm this side does not implement (the negotiation should have excluded it)."""


def checksum(data: Buffer, algorithm: int) -> int:
    """The checksum of one buffer under `algorithm` (a ChecksumAlgorithm value)."""
    if algorithm == pb.CHECKSUM_ALGORITHM_XXH3_64:
        return xxhash.xxh3_64_intdigest(data)
    if algorithm == pb.CHECKSUM_ALGORITHM_CRC32:
        return zlib.crc32(data)
    raise UnsupportedChecksum(f"unsupported checksum algorithm {algorithm}")


def checksum_parts(parts: Sequence[Buffer], algorithm: int) -> int:
    """The checksum of the concatenation of `parts`, without concatenating them."""
    if len(parts) == 1:
        return checksum(parts[0], algorithm)
    if algorithm == pb.CHECKSUM_ALGORITHM_XXH3_64:
        state = xxhash.xxh3_64()
        for part in parts:
            state.update(part)
        return state.intdigest()
    if algorithm == pb.CHECKSUM_ALGORITHM_CRC32:
        value = 0
        for part in parts:
            value = zlib.crc32(part, value)
        return value
    raise UnsupportedChecksum(f"unsupported checksum algorithm {algorithm}")


def choose_checksum(offered: list[int] | tuple[int, ...]) -> int | None:
    """The receiver's pick: the sender's most preferred algorithm that this side supports (a sender
    that offers none predates the negotiation and speaks LEGACY_CHECKSUM); None if there is no
    common one."""
    for algorithm in offered or (LEGACY_CHECKSUM,):
        if algorithm in SUPPORTED_CHECKSUMS:
            return algorithm
    return None


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _decode_varint(buffer: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    for offset in range(_MAX_VARINT_BYTES):
        byte = buffer[position + offset]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position + offset + 1
        shift += 7
    raise ValueError("varint longer than 10 bytes")


def encode_chunk(header: pb.KvChunkHeader, data: Buffer) -> bytes:
    """The KvChunk message as bytes: one copy of the data, none by protobuf."""
    return encode_chunk_parts(header, (data,))


def encode_chunk_parts(header: pb.KvChunkHeader, parts: Sequence[Buffer]) -> bytes:
    """The KvChunk message whose data is the concatenation of `parts`, built with one copy of each
    part (a range gathered from several places of the source is not joined twice)."""
    header_bytes = header.SerializeToString()
    data_length = sum(len(part) for part in parts)
    return join_frame(
        (
            bytes((_HEADER_TAG,)),
            _encode_varint(len(header_bytes)),
            header_bytes,
            bytes((_DATA_TAG,)),
            _encode_varint(data_length),
            *parts,
        )
    )


def decode_chunk(raw: bytes) -> DecodedChunk | MalformedChunk:
    """Never raises: a malformed message becomes MalformedChunk (the handler answers INVALID_ARGUMENT)."""
    if not raw:
        return MalformedChunk("empty chunk message")
    try:
        if raw[0] == _HEADER_TAG:
            header_length, position = _decode_varint(raw, 1)
            if header_length > MAX_HEADER_BYTES:
                return MalformedChunk(f"chunk header of {header_length} bytes exceeds {MAX_HEADER_BYTES}")
            header_end = position + header_length
            if header_end < len(raw) and raw[header_end] == _DATA_TAG:
                data_length, data_start = _decode_varint(raw, header_end + 1)
                if data_start + data_length != len(raw):
                    return MalformedChunk(
                        f"chunk data field says {data_length} bytes but the message holds "
                        f"{len(raw) - data_start}"
                    )
                header = pb.KvChunkHeader.FromString(raw[position:header_end])
                return DecodedChunk(header, memoryview(raw)[data_start:])
        # Any other (valid) encoding: let protobuf parse it; the data is copied once here.
        message = pb.KvChunk.FromString(raw)
    except (IndexError, ValueError, DecodeError) as error:
        return MalformedChunk(f"undecodable chunk message: {error}")
    if message.header.ByteSize() > MAX_HEADER_BYTES:
        return MalformedChunk(f"chunk header exceeds {MAX_HEADER_BYTES} bytes")
    return DecodedChunk(message.header, memoryview(message.data))


def make_header(
    transfer_id: str,
    request_id: str,
    spec: ChunkSpec,
    layout: KvLayout,
    data_checksum: int,
    checksum_algorithm: int = LEGACY_CHECKSUM,
) -> pb.KvChunkHeader:
    return pb.KvChunkHeader(
        transfer_id=transfer_id,
        request_id=request_id,
        sequence=spec.sequence,
        layer_start=spec.layer_start,
        layer_end=spec.layer_end,
        block_start=spec.block_start,
        block_end=spec.block_end,
        dtype=layout.dtype,
        shape=chunk_shape(layout, spec.num_layers, spec.num_blocks),
        byte_length=spec.size_bytes(layout),
        checksum=data_checksum,
        checksum_algorithm=checksum_algorithm,
    )


def encode_end_of_stream(transfer_id: str, request_id: str, commit: pb.KvCommitRequest | None = None) -> bytes:
    """The marker that ends a Push stream (a stream without an end was cut off); on the push's last
    stream it may carry the commit."""
    return encode_chunk(mark_end_of_stream(pb.KvChunkHeader(transfer_id=transfer_id, request_id=request_id), commit), b"")


def mark_end_of_stream(header: pb.KvChunkHeader, commit: pb.KvCommitRequest | None = None) -> pb.KvChunkHeader:
    """Make `header` (a marker's, or the last chunk's when the receiver accepts that) end its
    stream, with the push's commit when given."""
    header.end_of_stream = True
    if commit is not None:
        header.commit.CopyFrom(commit)
    return header


def chunk_shape(layout: KvLayout, num_layers: int, num_blocks: int) -> list[int]:
    return [num_layers, 2, num_blocks, layout.tokens_per_block, layout.num_kv_heads, layout.head_dim]


def spec_of(header: pb.KvChunkHeader) -> ChunkSpec:
    return ChunkSpec(header.sequence, header.layer_start, header.layer_end, header.block_start, header.block_end)


def header_problem(
    header: pb.KvChunkHeader,
    data_length: int,
    layout: KvLayout,
    num_blocks: int,
    max_chunk_bytes: int,
    checksum_algorithm: int = LEGACY_CHECKSUM,
) -> str | None:
    """Why this header cannot describe a chunk of a transfer with this layout (None if it can)."""
    if header.checksum_algorithm != checksum_algorithm:
        return f"checksum algorithm {header.checksum_algorithm} differs from the negotiated {checksum_algorithm}"
    if header.sequence >= layout.num_layers * num_blocks:
        return f"sequence {header.sequence} exceeds the most chunks this transfer can have"
    if not 0 <= header.layer_start < header.layer_end <= layout.num_layers:
        return f"layer range [{header.layer_start}, {header.layer_end}) outside [0, {layout.num_layers})"
    if not 0 <= header.block_start < header.block_end <= num_blocks:
        return f"block range [{header.block_start}, {header.block_end}) outside [0, {num_blocks})"
    if header.dtype != layout.dtype:
        return f"dtype {header.dtype!r} differs from the transfer's {layout.dtype!r}"
    num_layers = header.layer_end - header.layer_start
    chunk_blocks = header.block_end - header.block_start
    expected_shape = chunk_shape(layout, num_layers, chunk_blocks)
    if list(header.shape) != expected_shape:
        return f"shape {list(header.shape)} differs from the expected {expected_shape}"
    expected_bytes = layout.run_bytes(num_layers, chunk_blocks)
    if header.byte_length != expected_bytes or data_length != expected_bytes:
        return (
            f"byte_length {header.byte_length} and data length {data_length} must both be {expected_bytes} "
            "for this range"
        )
    if expected_bytes > max_chunk_bytes:
        return f"chunk of {expected_bytes} bytes exceeds the negotiated limit of {max_chunk_bytes}"
    return None


def layout_to_proto(layout: KvLayout) -> pb.KvLayoutSpec:
    return pb.KvLayoutSpec(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        tokens_per_block=layout.tokens_per_block,
        dtype=layout.dtype,
        model_fingerprint=layout.model_fingerprint,
        layout_name=layout.layout_name,
    )


def layout_from_proto(spec: pb.KvLayoutSpec) -> KvLayout:
    """Raises KvLayoutError for a missing or invalid layout."""
    return KvLayout(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        tokens_per_block=spec.tokens_per_block,
        dtype=spec.dtype,
        model_fingerprint=spec.model_fingerprint,
        layout_name=spec.layout_name,
    )


_PROTO_PREFIX = "TRANSFER_FAILURE_REASON_"


def reason_to_proto(reason: FailureReason) -> int:
    return pb.TransferFailureReason.Value(_PROTO_PREFIX + reason.value)


def reason_from_proto(value: int) -> FailureReason | None:
    """None for UNSPECIFIED; PROTOCOL_ERROR's caller decides about unknown values."""
    try:
        name = pb.TransferFailureReason.Name(value)
    except ValueError:
        return None
    if name == _PROTO_PREFIX + "UNSPECIFIED":
        return None
    return FailureReason(name.removeprefix(_PROTO_PREFIX))

