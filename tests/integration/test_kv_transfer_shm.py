"""The data planes between two processes on one host: a receiver (spawned, in-memory sink) and the
sender (this process). Shared memory carries the bytes when both sides allow it and the receiver
can read the sender's segment; gRPC otherwise ("auto"), or the push fails ("shm" forced). The bytes
that arrive are the bytes sent on each plane, and no segment outlives its sender."""

from __future__ import annotations

import random

import pytest

from worker.kv_layout import KvLayout
from worker.kv_transfer import shm
from worker.kv_transfer.buffers import LinearKvBuffer
from worker.kv_transfer.config import SenderConfig
from worker.kv_transfer.failures import FailureReason
from worker.kv_transfer.ids import new_transfer_id
from worker.kv_transfer.sender import KvSender
from worker.kv_transfer.testing import ReceiverProcess

pytestmark = pytest.mark.timeout(120)

KIB = 1024
TAG = "planes"
LAYOUT = KvLayout(4, 2, 64, 16, "bfloat16", "llama-a")


def _source(num_blocks: int, seed: int) -> LinearKvBuffer:
    size = LAYOUT.run_bytes(LAYOUT.num_layers, num_blocks)
    return LinearKvBuffer(LAYOUT, num_blocks, bytearray(random.Random(seed).randbytes(size)))


@pytest.fixture(scope="module")
def receiver():
    with ReceiverProcess(config={"max_chunk_bytes": 256 * KIB, "max_streams_per_transfer": 4}) as process:
        yield process


@pytest.fixture(scope="module")
def grpc_only_receiver():
    with ReceiverProcess(config={"data_plane": "grpc"}) as process:
        yield process


def _push(receiver: ReceiverProcess, sender: KvSender, num_blocks: int, seed: int):
    source = _source(num_blocks, seed)
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, f"req-{seed}", LAYOUT, num_blocks)
    outcome = sender.push(receiver.address, transfer_id, f"req-{seed}", source, deadline_s=30.0)
    result, data = receiver.received_bytes(transfer_id)
    receiver.release(transfer_id)
    return outcome, result, data, source


@pytest.mark.parametrize(("plane", "expected"), [("grpc", "grpc"), ("shm", "shm"), ("auto", "shm")])
def test_each_plane_delivers_identical_bytes(receiver: ReceiverProcess, plane: str, expected: str) -> None:
    config = SenderConfig(data_plane=plane, num_streams=3, num_connections=2, max_chunk_bytes=64 * KIB)
    with KvSender(config, shm_tag=TAG) as sender:
        for seed, num_blocks in enumerate((37, 1, 129, 36)):
            outcome, result, data, source = _push(receiver, sender, num_blocks, seed)
            assert outcome.ok, outcome.failure
            assert outcome.data_plane == expected
            assert outcome.bytes_sent == source.size_bytes
            assert result.state == "COMMITTED" and data == bytes(source.view)
        if expected == "shm":
            # Pooled: every transfer of a size class after the first reuses its pre-faulted segment.
            stats = sender.shm_pool().stats()
            assert stats.reused >= 1 and stats.in_use == 0
    assert shm.segments(TAG) == []


def test_auto_falls_back_to_grpc_when_the_receiver_refuses_shared_memory(grpc_only_receiver: ReceiverProcess) -> None:
    with KvSender(SenderConfig(data_plane="auto"), shm_tag=TAG) as sender:
        for seed in (1, 2):
            outcome, _, data, source = _push(grpc_only_receiver, sender, 9, seed)
            assert outcome.ok and outcome.data_plane == "grpc"
            assert data == bytes(source.view)
        # Declined once (as a receiver on another host would): the second push offered nothing.
        assert sender.shm_pool().stats().created == 1 and sender.shm_pool().stats().reused == 0


def test_auto_falls_back_to_grpc_when_dev_shm_is_too_small(receiver: ReceiverProcess) -> None:
    # Containers and Ray's object store leave /dev/shm small: what a full one looks like to the pool.
    config = SenderConfig(data_plane="auto", shm_min_free_bytes=1 << 60)
    with KvSender(config, shm_tag=TAG) as sender:
        outcome, _, data, source = _push(receiver, sender, 9, 2)
    assert outcome.ok and outcome.data_plane == "grpc"
    assert data == bytes(source.view)
    assert shm.segments(TAG) == []


def test_forced_shared_memory_fails_incompatible_when_it_cannot_be_used(
    receiver: ReceiverProcess, grpc_only_receiver: ReceiverProcess
) -> None:
    with KvSender(SenderConfig(data_plane="shm"), shm_tag=TAG) as sender:
        outcome, result, _, _ = _push(grpc_only_receiver, sender, 9, 3)
        assert outcome.failure is not None and outcome.failure.reason is FailureReason.INCOMPATIBLE
        assert outcome.chunks_sent == 0
        assert result.state == "FAILED"
    with KvSender(SenderConfig(data_plane="shm", shm_min_free_bytes=1 << 60), shm_tag=TAG) as sender:
        outcome, result, _, _ = _push(receiver, sender, 9, 4)
        assert outcome.failure is not None and outcome.failure.reason is FailureReason.INCOMPATIBLE
        assert "shared memory unavailable" in outcome.failure.detail
        assert result.state == "UNOPENED"  # nothing was opened; the reservation's timeout frees it
    assert shm.segments(TAG) == []


def test_concurrent_pushes_take_separate_segments(receiver: ReceiverProcess) -> None:
    import concurrent.futures

    with KvSender(SenderConfig(data_plane="shm", max_chunk_bytes=64 * KIB), shm_tag=TAG) as sender:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda seed: _push(receiver, sender, 17 + seed, 10 + seed), range(8)))
        for outcome, _, data, source in results:
            assert outcome.ok and outcome.data_plane == "shm", outcome.failure
            assert data == bytes(source.view)
        assert sender.shm_pool().stats().in_use == 0
    assert shm.segments(TAG) == []
