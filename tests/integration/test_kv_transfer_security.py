"""Hostile and broken peers get the proper gRPC status and never take the receiver down: malformed,
oversized and mismatched messages, unknown or forged transfer ids, missing or wrong credentials,
checksum mismatches, incompatible layouts, and limits on concurrent transfers."""

from __future__ import annotations

import dataclasses
import datetime
import random
from concurrent import futures

import grpc
import pytest

from duet_wire.v1 import kv_transfer_pb2 as pb
from worker.kv_layout import KvLayout
from worker.kv_transfer import codec
from worker.kv_transfer.auth import bearer_metadata
from worker.kv_transfer.buffers import LinearKvBuffer
from worker.kv_transfer.config import ReceiverConfig, SenderConfig, TransferConfigError, TransportSecurity
from worker.kv_transfer.failures import FAILURE_METADATA_KEY, FailureReason
from worker.kv_transfer.ids import new_transfer_id
from worker.kv_transfer.plan import ChunkSpec
from worker.kv_transfer.receiver import REQUEST_ID_METADATA_KEY, SERVICE_NAME, TRANSFER_ID_METADATA_KEY
from worker.kv_transfer.sender import KvSender
from worker.kv_transfer.testing import ReceiverProcess
from worker.kv_transfer.tls import TlsConfig, TlsConfigError

pytestmark = pytest.mark.timeout(120)

TOKEN = "cluster-token-0123456789abcdef"
AUTH = bearer_metadata(TOKEN)
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_block=16, dtype="bfloat16", model_fingerprint="m")
NUM_BLOCKS = 4
MAX_OPEN_TRANSFERS = 3
CHUNK_LIMIT = 64 * 1024
RPC_TIMEOUT_S = 10.0


def _identity(raw: bytes) -> bytes:
    return raw


@pytest.fixture(scope="module")
def receiver():
    with ReceiverProcess(config={"max_chunk_bytes": CHUNK_LIMIT, "max_open_transfers": MAX_OPEN_TRANSFERS}, token=TOKEN) as process:
        yield process
        assert process.is_alive(), "the receiver died"


@pytest.fixture(scope="module")
def channel(receiver):
    with grpc.insecure_channel(
        receiver.address, options=[("grpc.max_send_message_length", 8 * CHUNK_LIMIT)]
    ) as opened:
        yield opened


def _unary(channel, method: str, response_type):
    return channel.unary_unary(f"/{SERVICE_NAME}/{method}", request_serializer=_identity, response_deserializer=response_type.FromString)


def _push_raw(channel, frames: list[bytes], transfer_id: str, request_id: str, metadata=AUTH, *, end: bool = True):
    push = channel.stream_unary(f"/{SERVICE_NAME}/Push", request_serializer=_identity, response_deserializer=pb.KvPushResponse.FromString)
    stream_metadata = (*metadata, (TRANSFER_ID_METADATA_KEY, transfer_id), (REQUEST_ID_METADATA_KEY, request_id))
    if end:
        frames = [*frames, codec.encode_end_of_stream(transfer_id, request_id)]
    return push(iter(frames), timeout=RPC_TIMEOUT_S, metadata=stream_metadata)


def _status(error: grpc.RpcError) -> tuple[grpc.StatusCode, str | None]:
    reason = dict(error.trailing_metadata() or ()).get(FAILURE_METADATA_KEY)
    return error.code(), reason


def _open(channel, receiver, checksum_algorithms=(pb.CHECKSUM_ALGORITHM_CRC32,)):
    """Prepare a transfer by hand, offering `checksum_algorithms`; returns its ids and the answer."""
    transfer_id, request_id = new_transfer_id(), f"req-{random.random()}"
    receiver.expect(transfer_id, request_id, LAYOUT, NUM_BLOCKS)
    request = pb.KvPrepareRequest(
        transfer_id=transfer_id,
        request_id=request_id,
        layout=codec.layout_to_proto(LAYOUT),
        num_blocks=NUM_BLOCKS,
        num_streams=1,
        max_chunk_bytes=CHUNK_LIMIT,
        timeout_s=30.0,
        checksum_algorithms=list(checksum_algorithms),
    )
    prepare = _unary(channel, "Prepare", pb.KvPrepareResponse)
    answer = prepare(request.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH)
    return transfer_id, request_id, answer


def _prepare(channel, receiver, *, layout: KvLayout = LAYOUT, num_blocks: int = NUM_BLOCKS, expect: bool = True):
    transfer_id, request_id = new_transfer_id(), f"req-{random.random()}"
    if expect:
        receiver.expect(transfer_id, request_id, LAYOUT, NUM_BLOCKS)
    request = pb.KvPrepareRequest(
        transfer_id=transfer_id,
        request_id=request_id,
        layout=codec.layout_to_proto(layout),
        num_blocks=num_blocks,
        num_streams=1,
        max_chunk_bytes=CHUNK_LIMIT,
        timeout_s=30.0,
        checksum_algorithms=[pb.CHECKSUM_ALGORITHM_CRC32],
    )
    _unary(channel, "Prepare", pb.KvPrepareResponse)(request.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH)
    return transfer_id, request_id


def _chunk(
    transfer_id: str,
    request_id: str,
    spec: ChunkSpec,
    *,
    corrupt: bool = False,
    mutate=None,
    algorithm: int = pb.CHECKSUM_ALGORITHM_CRC32,
) -> bytes:
    data = bytearray(random.Random(spec.sequence).randbytes(spec.size_bytes(LAYOUT)))
    header = codec.make_header(transfer_id, request_id, spec, LAYOUT, codec.checksum(data, algorithm), algorithm)
    if mutate is not None:
        mutate(header)
    if corrupt:
        data[7] ^= 0x01
    return codec.encode_chunk(header, data)


def _assert_receiver_still_serves(receiver) -> None:
    source = LinearKvBuffer(LAYOUT, NUM_BLOCKS, bytearray(random.Random(5).randbytes(LAYOUT.run_bytes(2, NUM_BLOCKS))))
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, "healthy", LAYOUT, NUM_BLOCKS)
    with KvSender(SenderConfig(max_chunk_bytes=CHUNK_LIMIT), security=TransportSecurity(token=TOKEN)) as sender:
        outcome = sender.push(receiver.address, transfer_id, "healthy", source, 10.0)
    assert outcome.ok, outcome.failure
    assert receiver.received_bytes(transfer_id)[1] == bytes(source.view)


# -- authentication ----------------------------------------------------------------------------------


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-token-0123456789"),), (("authorization", TOKEN),)])
def test_every_method_requires_the_cluster_token(channel, receiver, metadata) -> None:
    for method, response in (("Prepare", pb.KvPrepareResponse), ("Commit", pb.KvCommitResponse), ("Abort", pb.KvAbortResponse)):
        with pytest.raises(grpc.RpcError) as raised:
            _unary(channel, method, response)(b"", timeout=RPC_TIMEOUT_S, metadata=metadata)
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as raised:
        _push_raw(channel, [b"garbage"], "x" * 20, "r", metadata=metadata)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_sender_without_the_token_gets_a_typed_failure(receiver) -> None:
    source = LinearKvBuffer(LAYOUT, NUM_BLOCKS)
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, "no-token", LAYOUT, NUM_BLOCKS)
    with KvSender(SenderConfig(max_chunk_bytes=CHUNK_LIMIT)) as sender:
        outcome = sender.push(receiver.address, transfer_id, "no-token", source, 10.0)
    assert outcome.failure is not None and outcome.failure.reason is FailureReason.UNAUTHENTICATED
    assert receiver.result(transfer_id, wait_s=0.0).state == "UNOPENED"


# -- malformed and oversized input -------------------------------------------------------------------


@pytest.mark.parametrize("method", ["Prepare", "Commit", "Abort"])
def test_undecodable_and_oversized_control_messages_are_refused(channel, method) -> None:
    for raw in (b"\xff\xff\xff\xff", b"\x0a" + b"\x80" * 12):
        with pytest.raises(grpc.RpcError) as raised:
            _unary(channel, method, pb.KvPrepareResponse)(raw, timeout=RPC_TIMEOUT_S, metadata=AUTH)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Over the control-message limit (64 KiB): refused by our decoder (INVALID_ARGUMENT) or, past the
    # server's message limit (chunk limit plus header room), by gRPC itself (RESOURCE_EXHAUSTED).
    for size in (66 * 1024, 80 * 1024):
        with pytest.raises(grpc.RpcError) as raised:
            _unary(channel, method, pb.KvPrepareResponse)(b"\x00" * size, timeout=RPC_TIMEOUT_S, metadata=AUTH)
        expected = grpc.StatusCode.INVALID_ARGUMENT if size < CHUNK_LIMIT + 4096 else grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raised.value.code() == expected


def test_invalid_prepare_fields_are_invalid_argument(channel, receiver) -> None:
    bad_requests = [
        pb.KvPrepareRequest(transfer_id="bad id", request_id="r", layout=codec.layout_to_proto(LAYOUT), num_blocks=1, timeout_s=1),
        pb.KvPrepareRequest(transfer_id=new_transfer_id(), request_id="r", num_blocks=1, timeout_s=1),  # no layout
        pb.KvPrepareRequest(transfer_id=new_transfer_id(), request_id="r", layout=codec.layout_to_proto(LAYOUT), num_blocks=0, timeout_s=1),
        pb.KvPrepareRequest(
            transfer_id=new_transfer_id(), request_id="r", layout=codec.layout_to_proto(LAYOUT), num_blocks=1, timeout_s=float("nan")
        ),
    ]
    for request in bad_requests:
        with pytest.raises(grpc.RpcError) as raised:
            _unary(channel, "Prepare", pb.KvPrepareResponse)(request.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH)
        assert _status(raised.value) == (grpc.StatusCode.INVALID_ARGUMENT, "PROTOCOL_ERROR")


def test_push_without_stream_metadata_is_invalid_argument(channel) -> None:
    push = channel.stream_unary(f"/{SERVICE_NAME}/Push", request_serializer=_identity, response_deserializer=pb.KvPushResponse.FromString)
    with pytest.raises(grpc.RpcError) as raised:
        push(iter([b"x"]), timeout=RPC_TIMEOUT_S, metadata=AUTH)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_garbage_chunk_is_invalid_argument_and_fails_the_transfer(channel, receiver) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    with pytest.raises(grpc.RpcError) as raised:
        _push_raw(channel, [b"\xff\x00garbage"], transfer_id, request_id)
    assert _status(raised.value) == (grpc.StatusCode.INVALID_ARGUMENT, "PROTOCOL_ERROR")
    assert receiver.result(transfer_id).failure_reason == "PROTOCOL_ERROR"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: setattr(h, "block_end", NUM_BLOCKS + 1),
        lambda h: setattr(h, "dtype", "float32"),
        lambda h: setattr(h, "byte_length", 3),
        lambda h: setattr(h, "transfer_id", "y" * 20),
    ],
)
def test_headers_that_do_not_fit_the_transfer_are_invalid_argument(channel, receiver, mutate) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    frame = _chunk(transfer_id, request_id, ChunkSpec(0, 0, 1, 0, NUM_BLOCKS), mutate=mutate)
    with pytest.raises(grpc.RpcError) as raised:
        _push_raw(channel, [frame], transfer_id, request_id)
    assert _status(raised.value) == (grpc.StatusCode.INVALID_ARGUMENT, "PROTOCOL_ERROR")
    result = receiver.result(transfer_id)
    assert result.state == "FAILED" and result.writes == 0


def test_message_over_the_size_limit_is_resource_exhausted(channel, receiver) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    huge = b"\x0a\x00\x12" + bytes(4 * CHUNK_LIMIT)
    with pytest.raises(grpc.RpcError) as raised:
        _push_raw(channel, [huge], transfer_id, request_id)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _assert_receiver_still_serves(receiver)


def test_stream_without_its_end_marker_counts_as_cut_off(channel, receiver) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    frame = _chunk(transfer_id, request_id, ChunkSpec(0, 0, 1, 0, NUM_BLOCKS))
    with pytest.raises(grpc.RpcError) as raised:
        _push_raw(channel, [frame], transfer_id, request_id, end=False)
    assert _status(raised.value) == (grpc.StatusCode.UNAVAILABLE, "PEER_UNAVAILABLE")
    assert receiver.result(transfer_id).events == ("fail:PEER_UNAVAILABLE",)


def test_message_after_the_end_marker_is_invalid_argument(channel, receiver) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    frames = [codec.encode_end_of_stream(transfer_id, request_id), _chunk(transfer_id, request_id, ChunkSpec(0, 0, 1, 0, NUM_BLOCKS))]
    with pytest.raises(grpc.RpcError) as raised:
        _push_raw(channel, frames, transfer_id, request_id, end=False)
    assert _status(raised.value) == (grpc.StatusCode.INVALID_ARGUMENT, "PROTOCOL_ERROR")


def _push_response(channel, frames: list[bytes], transfer_id: str, request_id: str) -> pb.KvPushResponse:
    return _push_raw(channel, frames, transfer_id, request_id, end=False)


def test_the_last_chunk_can_end_the_stream_with_the_commit(channel, receiver) -> None:
    transfer_id, request_id, answer = _open(channel, receiver)
    assert answer.last_chunk_ends_stream
    specs = (ChunkSpec(0, 0, 1, 0, NUM_BLOCKS), ChunkSpec(1, 1, 2, 0, NUM_BLOCKS))
    size = sum(spec.size_bytes(LAYOUT) for spec in specs)
    commit = pb.KvCommitRequest(transfer_id=transfer_id, request_id=request_id, chunks_sent=2, bytes_sent=size, output_token_ids=[7])
    frames = [
        _chunk(transfer_id, request_id, specs[0]),
        _chunk(transfer_id, request_id, specs[1], mutate=lambda header: codec.mark_end_of_stream(header, commit)),
    ]
    response = _push_response(channel, frames, transfer_id, request_id)
    assert response.committed and response.chunks_accepted == 2 and response.bytes_received == size
    result = receiver.result(transfer_id)
    assert result.state == "COMMITTED" and result.events == ("commit",) and result.writes == 2


def test_a_last_chunk_that_ends_the_stream_is_checked_like_any_chunk(channel, receiver) -> None:
    transfer_id, request_id, _ = _open(channel, receiver)
    commit = pb.KvCommitRequest(transfer_id=transfer_id, request_id=request_id, chunks_sent=1, bytes_sent=1)
    frame = _chunk(
        transfer_id, request_id, ChunkSpec(0, 0, 1, 0, NUM_BLOCKS), corrupt=True,
        mutate=lambda header: codec.mark_end_of_stream(header, commit),
    )
    with pytest.raises(grpc.RpcError) as raised:
        _push_response(channel, [frame], transfer_id, request_id)
    assert _status(raised.value) == (grpc.StatusCode.DATA_LOSS, "CHECKSUM_MISMATCH")
    assert receiver.result(transfer_id).events == ("fail:CHECKSUM_MISMATCH",)  # never committed


def test_a_marker_that_names_no_chunk_carries_no_data_and_nothing_follows_an_end(channel, receiver) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    marker = codec.mark_end_of_stream(pb.KvChunkHeader(transfer_id=transfer_id, request_id=request_id))
    with pytest.raises(grpc.RpcError) as raised:
        _push_response(channel, [codec.encode_chunk(marker, b"stray bytes")], transfer_id, request_id)
    assert _status(raised.value) == (grpc.StatusCode.INVALID_ARGUMENT, "PROTOCOL_ERROR")
    transfer_id, request_id = _prepare(channel, receiver)
    frames = [
        _chunk(transfer_id, request_id, ChunkSpec(0, 0, 1, 0, NUM_BLOCKS), mutate=codec.mark_end_of_stream),
        _chunk(transfer_id, request_id, ChunkSpec(1, 1, 2, 0, NUM_BLOCKS)),
    ]
    with pytest.raises(grpc.RpcError) as raised:
        _push_response(channel, frames, transfer_id, request_id)
    assert _status(raised.value) == (grpc.StatusCode.INVALID_ARGUMENT, "PROTOCOL_ERROR")


# -- ids ---------------------------------------------------------------------------------------------


def test_unknown_and_forged_transfer_ids_are_not_found(channel, receiver) -> None:
    with pytest.raises(grpc.RpcError) as raised:  # well-formed, but nobody reserved it
        _prepare(channel, receiver, expect=False)
    assert _status(raised.value) == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_TRANSFER")
    transfer_id, request_id = _prepare(channel, receiver)
    for forged_id, forged_request in ((new_transfer_id(), request_id), (transfer_id, "someone-else")):
        frame = _chunk(forged_id, forged_request, ChunkSpec(0, 0, 1, 0, NUM_BLOCKS))
        with pytest.raises(grpc.RpcError) as raised:
            _push_raw(channel, [frame], forged_id, forged_request)
        assert _status(raised.value) == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_TRANSFER")
        commit = pb.KvCommitRequest(transfer_id=forged_id, request_id=forged_request)
        with pytest.raises(grpc.RpcError) as raised:
            _unary(channel, "Commit", pb.KvCommitResponse)(commit.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert receiver.result(transfer_id).state == "OPEN"  # the real transfer is untouched


# -- integrity ---------------------------------------------------------------------------------------


def test_checksum_mismatch_is_data_loss_and_nothing_is_committed(channel, receiver) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    frames = [
        _chunk(transfer_id, request_id, ChunkSpec(0, 0, 1, 0, NUM_BLOCKS)),
        _chunk(transfer_id, request_id, ChunkSpec(1, 1, 2, 0, NUM_BLOCKS), corrupt=True),
    ]
    with pytest.raises(grpc.RpcError) as raised:
        _push_raw(channel, frames, transfer_id, request_id)
    assert _status(raised.value) == (grpc.StatusCode.DATA_LOSS, "CHECKSUM_MISMATCH")
    commit = pb.KvCommitRequest(transfer_id=transfer_id, request_id=request_id, chunks_sent=2, bytes_sent=1)
    with pytest.raises(grpc.RpcError) as raised:
        _unary(channel, "Commit", pb.KvCommitResponse)(commit.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH)
    assert _status(raised.value) == (grpc.StatusCode.DATA_LOSS, "CHECKSUM_MISMATCH")
    result = receiver.result(transfer_id)
    assert result.events == ("fail:CHECKSUM_MISMATCH",)


@pytest.mark.parametrize(
    ("offered", "chosen"),
    [
        ((pb.CHECKSUM_ALGORITHM_XXH3_64, pb.CHECKSUM_ALGORITHM_CRC32), pb.CHECKSUM_ALGORITHM_XXH3_64),
        ((pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_XXH3_64), pb.CHECKSUM_ALGORITHM_CRC32),
        ((pb.CHECKSUM_ALGORITHM_CRC32,), pb.CHECKSUM_ALGORITHM_CRC32),
        ((), pb.CHECKSUM_ALGORITHM_CRC32),  # a sender from before the negotiation
        ((99, pb.CHECKSUM_ALGORITHM_XXH3_64), pb.CHECKSUM_ALGORITHM_XXH3_64),
    ],
)
def test_receiver_picks_the_senders_first_supported_checksum(channel, receiver, offered, chosen) -> None:
    transfer_id, request_id, answer = _open(channel, receiver, offered)
    assert answer.checksum_algorithm == chosen
    other = next(a for a in codec.SUPPORTED_CHECKSUMS if a != chosen)
    spec = ChunkSpec(0, 0, 1, 0, NUM_BLOCKS)
    # A chunk under the other algorithm is refused before its checksum is even computed ...
    with pytest.raises(grpc.RpcError) as raised:
        _push_raw(channel, [_chunk(transfer_id, request_id, spec, algorithm=other)], transfer_id, request_id)
    assert _status(raised.value) == (grpc.StatusCode.INVALID_ARGUMENT, "PROTOCOL_ERROR")
    assert receiver.result(transfer_id).writes == 0
    # ... and one under the chosen algorithm is verified and written.
    transfer_id, request_id, answer = _open(channel, receiver, offered)
    accepted = _push_raw(channel, [_chunk(transfer_id, request_id, spec, algorithm=chosen)], transfer_id, request_id)
    assert accepted.chunks_accepted == 1 and receiver.result(transfer_id).writes == 1
    abort = pb.KvAbortRequest(transfer_id=transfer_id, request_id=request_id, reason=pb.TRANSFER_FAILURE_REASON_CANCELLED)
    assert _unary(channel, "Abort", pb.KvAbortResponse)(abort.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH).aborted


def test_no_common_checksum_is_refused_as_incompatible(channel, receiver) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _open(channel, receiver, (99,))
    assert _status(raised.value) == (grpc.StatusCode.FAILED_PRECONDITION, "INCOMPATIBLE")


def test_xxh3_checksum_mismatch_is_data_loss(channel, receiver) -> None:
    transfer_id, request_id, _ = _open(channel, receiver, (pb.CHECKSUM_ALGORITHM_XXH3_64,))
    frame = _chunk(transfer_id, request_id, ChunkSpec(0, 0, 1, 0, NUM_BLOCKS), corrupt=True, algorithm=pb.CHECKSUM_ALGORITHM_XXH3_64)
    with pytest.raises(grpc.RpcError) as raised:
        _push_raw(channel, [frame], transfer_id, request_id)
    assert _status(raised.value) == (grpc.StatusCode.DATA_LOSS, "CHECKSUM_MISMATCH")
    result = receiver.result(transfer_id)
    assert result.events == ("fail:CHECKSUM_MISMATCH",) and result.writes == 0


def test_replayed_chunks_and_commit_are_idempotent_and_late_chunks_dropped(channel, receiver) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    frames = [_chunk(transfer_id, request_id, ChunkSpec(index, index, index + 1, 0, NUM_BLOCKS)) for index in range(2)]
    answer = _push_raw(channel, frames + frames[::-1], transfer_id, request_id)
    assert (answer.chunks_accepted, answer.chunks_duplicate) == (2, 2)
    size = 2 * LAYOUT.run_bytes(1, NUM_BLOCKS)
    commit = pb.KvCommitRequest(transfer_id=transfer_id, request_id=request_id, chunks_sent=2, bytes_sent=size)
    commit_call = _unary(channel, "Commit", pb.KvCommitResponse)
    first = commit_call(commit.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH)
    again = commit_call(commit.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH)
    assert first == again and first.bytes_received == size
    late = _push_raw(channel, frames, transfer_id, request_id)
    assert late.chunks_accepted == 0
    result = receiver.result(transfer_id)
    assert result.events == ("commit",) and result.writes == 2


def test_other_contents_into_a_committed_transfer_are_failed_precondition(channel, receiver) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    specs = [ChunkSpec(index, index, index + 1, 0, NUM_BLOCKS) for index in range(2)]
    frames = [_chunk(transfer_id, request_id, spec) for spec in specs]
    _push_raw(channel, frames, transfer_id, request_id)
    size = 2 * LAYOUT.run_bytes(1, NUM_BLOCKS)
    commit = pb.KvCommitRequest(transfer_id=transfer_id, request_id=request_id, chunks_sent=2, bytes_sent=size)
    commit_call = _unary(channel, "Commit", pb.KvCommitResponse)
    receipt = commit_call(commit.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH)
    # The same range under the same sequence number, other bytes with their own valid checksum.
    other = bytes(random.Random(99).randbytes(specs[1].size_bytes(LAYOUT)))
    header = codec.make_header(
        transfer_id, request_id, specs[1], LAYOUT, codec.checksum(other, pb.CHECKSUM_ALGORITHM_CRC32), pb.CHECKSUM_ALGORITHM_CRC32
    )
    different = codec.encode_chunk(header, other)
    # A sequence number the transfer never had is other contents too.
    unknown = _chunk(transfer_id, request_id, ChunkSpec(5, 0, 1, 0, NUM_BLOCKS))
    for forged in ([frames[0], different], [unknown]):
        with pytest.raises(grpc.RpcError) as raised:
            _push_raw(channel, forged, transfer_id, request_id)
        assert _status(raised.value) == (grpc.StatusCode.FAILED_PRECONDITION, "PROTOCOL_ERROR")
    # The committed transfer is untouched: an exact replay and a repeated commit are still OK.
    assert _push_raw(channel, frames, transfer_id, request_id).chunks_accepted == 0
    assert commit_call(commit.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH) == receipt
    result = receiver.result(transfer_id)
    assert result.events == ("commit",) and result.writes == 2


def test_a_push_into_an_aborted_transfer_is_failed_precondition(channel, receiver) -> None:
    transfer_id, request_id = _prepare(channel, receiver)
    abort = pb.KvAbortRequest(transfer_id=transfer_id, request_id=request_id, reason=pb.TRANSFER_FAILURE_REASON_CANCELLED)
    assert _unary(channel, "Abort", pb.KvAbortResponse)(abort.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH).aborted
    frame = _chunk(transfer_id, request_id, ChunkSpec(0, 0, 1, 0, NUM_BLOCKS))
    for frames in ([frame], []):  # with a chunk, and with only the end-of-stream marker
        with pytest.raises(grpc.RpcError) as raised:
            _push_raw(channel, frames, transfer_id, request_id)
        # The metadata still names why the transfer ended, which is what a sender reads.
        assert _status(raised.value) == (grpc.StatusCode.FAILED_PRECONDITION, "CANCELLED")
    result = receiver.result(transfer_id)
    assert result.events == ("fail:CANCELLED",) and result.writes == 0


# -- compatibility and limits ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "num_blocks", "field"),
    [
        (KvLayout(2, 2, 64, 16, "bfloat16", "other-model"), NUM_BLOCKS, "model_fingerprint"),
        (KvLayout(2, 2, 64, 16, "float16", "m"), NUM_BLOCKS, "dtype"),
        (KvLayout(2, 2, 64, 32, "bfloat16", "m"), NUM_BLOCKS, "tokens_per_block"),
        (KvLayout(3, 2, 64, 16, "bfloat16", "m"), NUM_BLOCKS, "num_layers"),
        (LAYOUT, NUM_BLOCKS + 1, "num_blocks"),
    ],
)
def test_incompatible_senders_are_refused_before_any_byte_moves(receiver, layout, num_blocks, field) -> None:
    source = LinearKvBuffer(layout, num_blocks)
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, "mismatch", LAYOUT, NUM_BLOCKS)
    with KvSender(SenderConfig(max_chunk_bytes=CHUNK_LIMIT), security=TransportSecurity(token=TOKEN)) as sender:
        outcome = sender.push(receiver.address, transfer_id, "mismatch", source, 10.0)
    assert outcome.failure is not None and outcome.failure.reason is FailureReason.INCOMPATIBLE
    assert field in outcome.failure.detail and outcome.chunks_sent == 0
    result = receiver.result(transfer_id)
    assert result.events == ("fail:INCOMPATIBLE",) and result.writes == 0


def test_open_transfers_are_bounded(channel, receiver) -> None:
    # Open transfers until the receiver refuses. Earlier tests' transfers may still be open, and may
    # expire meanwhile, so how many this test gets is not fixed: never more than the limit.
    opened = []
    refusal = None
    for _ in range(MAX_OPEN_TRANSFERS + 1):
        try:
            opened.append(_prepare(channel, receiver))
        except grpc.RpcError as error:
            refusal = error
            break
    assert refusal is not None, f"{len(opened)} transfers opened, the limit is {MAX_OPEN_TRANSFERS}"
    assert _status(refusal) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED")
    assert receiver.stats()["open_transfers"] <= MAX_OPEN_TRANSFERS
    abort = _unary(channel, "Abort", pb.KvAbortResponse)
    for transfer_id, request_id in opened:
        request = pb.KvAbortRequest(transfer_id=transfer_id, request_id=request_id, reason=pb.TRANSFER_FAILURE_REASON_CANCELLED)
        assert abort(request.SerializeToString(), timeout=RPC_TIMEOUT_S, metadata=AUTH).aborted
        assert receiver.result(transfer_id).events == ("fail:CANCELLED",)
    _assert_receiver_still_serves(receiver)


def _push_to_a_foreign_receiver(layout: KvLayout, checksum_algorithm: int, sender_config: SenderConfig):
    """Push to a receiver that is not ours: it answers Prepare with `layout` and
    `checksum_algorithm` whatever it was offered, and fails the test if a chunk arrives. Returns the
    outcome, the algorithms each Prepare offered and the aborts received."""
    offered: list[list[int]] = []
    aborts: list[pb.KvAbortRequest] = []

    def prepare(request: pb.KvPrepareRequest, context) -> pb.KvPrepareResponse:
        offered.append(list(request.checksum_algorithms))
        return pb.KvPrepareResponse(
            layout=codec.layout_to_proto(layout),
            expected_num_blocks=request.num_blocks,
            max_chunk_bytes=CHUNK_LIMIT,
            max_streams=1,
            timeout_s=10,
            checksum_algorithm=checksum_algorithm,
        )

    def abort(request: pb.KvAbortRequest, context) -> pb.KvAbortResponse:
        aborts.append(request)
        return pb.KvAbortResponse(aborted=True)

    def push(request_iterator, context) -> pb.KvPushResponse:
        raise AssertionError("no chunk may be sent")

    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Prepare": grpc.unary_unary_rpc_method_handler(prepare, pb.KvPrepareRequest.FromString, pb.KvPrepareResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(abort, pb.KvAbortRequest.FromString, pb.KvAbortResponse.SerializeToString),
            "Push": grpc.stream_unary_rpc_method_handler(push, codec.decode_chunk, pb.KvPushResponse.SerializeToString),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with KvSender(sender_config) as sender:
            outcome = sender.push(f"127.0.0.1:{port}", new_transfer_id(), "r", LinearKvBuffer(LAYOUT, NUM_BLOCKS), 10.0)
    finally:
        server.stop(0)
    return outcome, offered, aborts


def test_sender_checks_the_receivers_layout_too() -> None:
    """A receiver (not ours) that accepts anything still gets nothing from an incompatible sender."""
    other = KvLayout(2, 2, 64, 16, "bfloat16", "some-other-model")
    outcome, _, aborts = _push_to_a_foreign_receiver(other, pb.CHECKSUM_ALGORITHM_CRC32, SenderConfig(max_chunk_bytes=CHUNK_LIMIT))
    assert outcome.failure is not None and outcome.failure.reason is FailureReason.INCOMPATIBLE
    assert "model_fingerprint" in outcome.failure.detail and outcome.chunks_sent == 0
    assert [a.reason for a in aborts] == [pb.TRANSFER_FAILURE_REASON_INCOMPATIBLE]


def test_sender_refuses_a_checksum_it_did_not_offer() -> None:
    """A receiver (not ours) that answers with an algorithm the sender did not offer gets no chunk."""
    config = SenderConfig(max_chunk_bytes=CHUNK_LIMIT, checksum_algorithms=("CRC32",))
    outcome, offered, _ = _push_to_a_foreign_receiver(LAYOUT, pb.CHECKSUM_ALGORITHM_XXH3_64, config)
    assert offered == [[pb.CHECKSUM_ALGORITHM_CRC32]]
    assert outcome.failure is not None and outcome.failure.reason is FailureReason.INCOMPATIBLE
    assert "checksum" in outcome.failure.detail and outcome.chunks_sent == 0


# -- mutual TLS --------------------------------------------------------------------------------------


def _certificates():
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    def certificate(subject: str, key, issuer_name, issuer_key, *, ca: bool, san: bool):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            import ipaddress

            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    def authority(name: str):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = certificate(name, key, subject, key, ca=True, san=False)
        return key, cert

    def leaf(name: str, ca_key, ca_cert) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = certificate(name, key, ca_cert.subject, ca_key, ca=False, san=True)
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    ca_key, ca_cert = authority("duet test CA")
    rogue_key, rogue_cert = authority("rogue CA")
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    return {
        "ca": ca_pem,
        "server": leaf("receiver", ca_key, ca_cert),
        "client": leaf("sender", ca_key, ca_cert),
        "rogue": leaf("intruder", rogue_key, rogue_cert),
    }


def test_mutual_tls_admits_only_peers_signed_by_the_cluster_ca() -> None:
    certs = _certificates()
    server_tls = TlsConfig(certs["server"][0], certs["server"][1], certs["ca"], require_client_auth=True)
    with ReceiverProcess(config={"max_chunk_bytes": CHUNK_LIMIT}, tls=server_tls) as receiver:
        source = LinearKvBuffer(LAYOUT, NUM_BLOCKS, bytearray(random.Random(9).randbytes(LAYOUT.run_bytes(2, NUM_BLOCKS))))
        address = f"localhost:{receiver.port}"

        def push(client_cert: tuple[bytes, bytes]) -> tuple:
            transfer_id = new_transfer_id()
            receiver.expect(transfer_id, "tls", LAYOUT, NUM_BLOCKS)
            tls = TlsConfig(client_cert[0], client_cert[1], certs["ca"])
            with KvSender(SenderConfig(max_chunk_bytes=CHUNK_LIMIT), security=TransportSecurity(tls=tls)) as sender:
                return sender.push(address, transfer_id, "tls", source, 5.0), transfer_id

        outcome, transfer_id = push(certs["client"])
        assert outcome.ok, outcome.failure
        assert receiver.received_bytes(transfer_id)[1] == bytes(source.view)
        outcome, transfer_id = push(certs["rogue"])
        assert outcome.failure is not None and outcome.failure.reason in (
            FailureReason.PEER_UNAVAILABLE,
            FailureReason.UNAUTHENTICATED,
        )
        assert receiver.result(transfer_id, wait_s=0.0).state == "UNOPENED"
        with grpc.insecure_channel(address) as plain:  # no TLS at all
            with pytest.raises(grpc.RpcError) as raised:
                _unary(plain, "Prepare", pb.KvPrepareResponse)(b"", timeout=2.0)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert receiver.is_alive()


def test_deployment_ca_certificates_carry_a_push_and_another_deployments_do_not() -> None:
    from worker.kv_transfer.certificates import DeploymentCa

    ca, other = DeploymentCa("d1"), DeploymentCa("d2")
    with ReceiverProcess(config={"max_chunk_bytes": CHUNK_LIMIT}, tls=ca.issue("generation-0")) as receiver:
        source = LinearKvBuffer(LAYOUT, NUM_BLOCKS, bytearray(random.Random(11).randbytes(LAYOUT.run_bytes(2, NUM_BLOCKS))))

        def push(tls: TlsConfig) -> tuple:
            transfer_id = new_transfer_id()
            receiver.expect(transfer_id, "ca", LAYOUT, NUM_BLOCKS)
            with KvSender(SenderConfig(max_chunk_bytes=CHUNK_LIMIT), security=TransportSecurity(tls=tls)) as sender:
                # The receiver's address is an IP: the certificate names TRANSFER_SERVER_NAME instead.
                return sender.push(receiver.address, transfer_id, "ca", source, 5.0), transfer_id

        outcome, transfer_id = push(ca.issue("prefill-0"))
        assert outcome.ok, outcome.failure
        assert receiver.received_bytes(transfer_id)[1] == bytes(source.view)
        outcome, transfer_id = push(other.issue("prefill-0"))
        assert outcome.failure is not None and outcome.failure.reason is FailureReason.PEER_UNAVAILABLE
        assert receiver.result(transfer_id, wait_s=0.0).state == "UNOPENED"
        assert receiver.is_alive()


def _served_certificate_serial(address: str, tls: TlsConfig) -> int:
    """The serial number of the certificate a TLS server presents to a new connection (the client
    authenticates with `tls`, as a peer would)."""
    import socket
    import ssl
    import tempfile

    from cryptography import x509

    from worker.kv_transfer.certificates import TRANSFER_SERVER_NAME

    context = ssl.create_default_context(cadata=tls.root_certificates_pem.decode("ascii"))
    context.set_alpn_protocols(["h2"])
    with tempfile.NamedTemporaryFile() as chain, tempfile.NamedTemporaryFile() as key:
        chain.write(tls.certificate_chain_pem)
        key.write(tls.private_key_pem)
        chain.flush()
        key.flush()
        context.load_cert_chain(chain.name, key.name)
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=TRANSFER_SERVER_NAME) as wrapped:
            return x509.load_der_x509_certificate(wrapped.getpeercert(binary_form=True)).serial_number


def test_a_reissued_certificate_is_served_and_presented_from_the_next_connection_on() -> None:
    from cryptography import x509

    from worker.kv_transfer.certificates import DeploymentCa
    from worker.kv_transfer.receiver import KvTransferServer
    from worker.kv_transfer.testing import MemorySink

    def serial(tls: TlsConfig) -> int:
        return x509.load_pem_x509_certificate(tls.certificate_chain_pem).serial_number

    ca = DeploymentCa("d1")
    before, after = ca.issue("generation-0"), ca.issue("generation-0")
    sink = MemorySink()
    security = TransportSecurity(tls=before)
    with KvTransferServer(sink, ReceiverConfig(max_chunk_bytes=CHUNK_LIMIT), security=security) as receiver:
        peer = ca.issue("prefill-0")
        assert _served_certificate_serial(receiver.address, peer) == serial(before)
        source = LinearKvBuffer(LAYOUT, NUM_BLOCKS, bytearray(random.Random(13).randbytes(LAYOUT.run_bytes(2, NUM_BLOCKS))))
        with KvSender(SenderConfig(max_chunk_bytes=CHUNK_LIMIT), security=TransportSecurity(tls=peer)) as sender:

            def push() -> FailureReason | None:
                transfer_id = new_transfer_id()
                sink.expect(transfer_id, "rotated", LAYOUT, NUM_BLOCKS)
                outcome = sender.push(receiver.address, transfer_id, "rotated", source, 5.0)
                if outcome.ok:
                    assert sink.data(transfer_id) == bytes(source.view)
                return None if outcome.failure is None else outcome.failure.reason

            assert push() is None
            receiver.replace_tls(after)
            assert _served_certificate_serial(receiver.address, peer) == serial(after)
            assert push() is None  # the sender's connection, made before, keeps working
            # The sender's next connections present its replacement: one of another CA is refused,
            # one of this deployment's CA is admitted.
            sender.replace_tls(DeploymentCa("d2").issue("prefill-0"))
            assert push() is FailureReason.PEER_UNAVAILABLE
            sender.replace_tls(ca.issue("prefill-0"))
            assert push() is None
            with pytest.raises(TlsConfigError):  # a server's client authentication is fixed at start
                receiver.replace_tls(dataclasses.replace(after, require_client_auth=False))
    with KvTransferServer(MemorySink(), ReceiverConfig()) as plain, KvSender() as plain_sender:
        for side in (plain, plain_sender):
            with pytest.raises(TransferConfigError) as raised:
                side.replace_tls(after)
            assert "plain TCP" in str(raised.value)
