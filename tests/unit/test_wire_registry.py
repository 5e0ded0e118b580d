"""The receiver's transfer book: idempotence, exactly-once coverage, commit checks, deadlines,
limits, and that a target hears `fail` only once no write into it is running."""

from __future__ import annotations

import threading

import pytest

from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason, TransferFailure, TransferRejected
from worker.kv_transfer.plan import ChunkSpec, plan_chunks
from worker.kv_transfer.registry import (
    TRANSITIONS,
    Admission,
    IllegalTransferTransition,
    TransferRegistry,
    TransferState,
)

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=2, tokens_per_block=2, dtype="float32", model_fingerprint="m")
NUM_BLOCKS = 3


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class RecordingTarget:
    def __init__(self, commit_error: Exception | None = None) -> None:
        self.layout = LAYOUT
        self.num_blocks = NUM_BLOCKS
        self.calls: list[str] = []
        self.commit_error = commit_error

    def write(self, *args: object) -> None:
        self.calls.append("write")

    def commit(self, token_ids: tuple[int, ...] = ()) -> None:
        self.calls.append("commit")
        if self.commit_error is not None:
            raise self.commit_error

    def fail(self, failure: TransferFailure) -> None:
        self.calls.append(f"fail:{failure.reason.value}")


def _registry(clock: FakeClock | None = None, **limits: int) -> TransferRegistry:
    return TransferRegistry(
        max_open_transfers=limits.get("max_open", 4),
        max_streams_per_transfer=limits.get("max_streams", 2),
        finished_capacity=limits.get("finished", 8),
        clock=clock or FakeClock(),
    )


def _open(registry: TransferRegistry, transfer_id: str = "t" * 20, target: RecordingTarget | None = None):
    target = target or RecordingTarget()
    registry.check_new(transfer_id)
    record = registry.add(transfer_id, "req", target, NUM_BLOCKS, 1 << 20, timeout_s=10.0)
    return record, target


def _deliver_all(registry: TransferRegistry, record, chunks) -> None:
    for chunk in chunks:
        assert registry.admit(record, chunk, 7) is Admission.WRITE
        registry.finish_write(record, chunk.size_bytes(LAYOUT))


def _chunks() -> tuple[ChunkSpec, ...]:
    return plan_chunks(LAYOUT, NUM_BLOCKS, LAYOUT.block_bytes_per_layer * 2)


def test_transition_table_is_closed_and_final_states_are_final() -> None:
    assert set(TRANSITIONS) == set(TransferState)
    assert TRANSITIONS[TransferState.COMMITTED] == frozenset() == TRANSITIONS[TransferState.FAILED]


def test_complete_transfer_commits_once_and_repeated_commit_is_acknowledged_again() -> None:
    registry = _registry()
    record, target = _open(registry)
    chunks = _chunks()
    _deliver_all(registry, record, chunks)
    size = sum(c.size_bytes(LAYOUT) for c in chunks)
    receipt = registry.commit(record, len(chunks), size)
    assert (receipt.chunks_received, receipt.bytes_received) == (len(chunks), size)
    assert registry.commit(record, len(chunks), size) == receipt
    assert target.calls.count("commit") == 1 and not [c for c in target.calls if c.startswith("fail")]
    assert record.state is TransferState.COMMITTED
    assert registry.admit(record, chunks[0], 7) is Admission.LATE  # late chunk: dropped
    assert registry.stats().committed == 1 and registry.stats().open_transfers == 0


def test_after_commit_an_exact_replay_is_late_and_other_contents_a_conflict() -> None:
    registry = _registry()
    record, target = _open(registry)
    chunks = _chunks()
    _deliver_all(registry, record, chunks)
    registry.commit(record, len(chunks), sum(c.size_bytes(LAYOUT) for c in chunks))
    for chunk in chunks:
        assert registry.admit(record, chunk, 7) is Admission.LATE
    first = chunks[0]
    assert registry.admit(record, first, 8) is Admission.CONFLICT  # other bytes
    moved = ChunkSpec(first.sequence, first.layer_start, first.layer_end, first.block_start + 1, first.block_end + 1)
    assert registry.admit(record, moved, 7) is Admission.CONFLICT  # other cells
    assert registry.admit(record, ChunkSpec(len(chunks) + 9, 0, 1, 0, 1), 7) is Admission.CONFLICT  # never sent
    assert record.state is TransferState.COMMITTED and target.calls.count("commit") == 1
    assert not [c for c in target.calls if c.startswith("fail")]


def test_duplicate_chunk_changes_nothing_but_reused_sequence_fails() -> None:
    registry = _registry()
    record, target = _open(registry)
    first = _chunks()[0]
    _deliver_all(registry, record, [first])
    assert registry.admit(record, first, 7) is Admission.DUPLICATE
    other_range = ChunkSpec(first.sequence, 1, 2, 0, 1)
    assert registry.admit(record, other_range, 7) is Admission.LATE
    assert record.state is TransferState.FAILED
    assert record.failure.reason is FailureReason.PROTOCOL_ERROR
    assert target.calls[-1] == "fail:PROTOCOL_ERROR"


def test_overlapping_chunk_fails_the_transfer() -> None:
    registry = _registry()
    record, target = _open(registry)
    _deliver_all(registry, record, [ChunkSpec(0, 0, 1, 0, 2)])
    assert registry.admit(record, ChunkSpec(1, 0, 1, 1, 3), 7) is Admission.LATE
    assert record.failure.reason is FailureReason.PROTOCOL_ERROR and "overlaps" in record.failure.detail


def test_commit_with_missing_cells_fails_incomplete() -> None:
    registry = _registry()
    record, target = _open(registry)
    chunks = _chunks()
    _deliver_all(registry, record, chunks[:-1])
    with pytest.raises(TransferRejected) as raised:
        registry.commit(record, len(chunks), 0)
    assert raised.value.code is FailureReason.INCOMPLETE and "never arrived" in raised.value.detail
    assert target.calls[-1] == "fail:INCOMPLETE" and "commit" not in target.calls
    with pytest.raises(TransferRejected):  # a retried commit reports the same failure
        registry.commit(record, len(chunks), 0)


def test_commit_with_count_mismatch_fails_incomplete() -> None:
    registry = _registry()
    record, _ = _open(registry)
    chunks = _chunks()
    _deliver_all(registry, record, chunks)
    with pytest.raises(TransferRejected) as raised:
        registry.commit(record, len(chunks) + 1, 0)
    assert raised.value.code is FailureReason.INCOMPLETE


def test_fail_waits_for_running_writes_before_telling_the_target() -> None:
    registry = _registry()
    record, target = _open(registry)
    chunk = _chunks()[0]
    assert registry.admit(record, chunk, 7) is Admission.WRITE  # a write is now running
    assert registry.fail(record, TransferFailure(FailureReason.CANCELLED, "abort"))
    assert target.calls == []  # not while the write runs
    registry.finish_write(record, 0)
    assert target.calls == ["fail:CANCELLED"]
    assert not registry.fail(record, TransferFailure(FailureReason.CANCELLED, "again"))
    assert target.calls == ["fail:CANCELLED"]


def test_deadline_expiry_fails_open_transfers_only() -> None:
    clock = FakeClock()
    registry = _registry(clock)
    record, target = _open(registry, "a" * 20)
    done, _ = _open(registry, "b" * 20)
    _deliver_all(registry, done, _chunks())
    registry.commit(done, len(_chunks()), sum(c.size_bytes(LAYOUT) for c in _chunks()))
    assert registry.expire_overdue() == 0
    clock.now_s += 11.0
    assert registry.expire_overdue() == 1
    assert target.calls == ["fail:DEADLINE_EXCEEDED"]
    assert registry.admit(record, _chunks()[0], 7) is Admission.LATE


def test_chunk_after_the_deadline_fails_the_transfer() -> None:
    clock = FakeClock()
    registry = _registry(clock)
    record, target = _open(registry)
    clock.now_s += 11.0
    assert registry.admit(record, _chunks()[0], 7) is Admission.LATE
    assert target.calls == ["fail:DEADLINE_EXCEEDED"]


def test_open_transfer_and_stream_limits() -> None:
    registry = _registry(max_open=2, max_streams=1)
    record, _ = _open(registry, "a" * 20)
    _open(registry, "b" * 20)
    with pytest.raises(TransferRejected) as raised:
        registry.check_new("c" * 20)
    assert raised.value.code is FailureReason.RESOURCE_EXHAUSTED
    with pytest.raises(TransferRejected) as raised:
        registry.check_new("a" * 20)  # ids are single-use
    registry.attach_stream(record)
    with pytest.raises(TransferRejected) as raised:
        registry.attach_stream(record)
    assert raised.value.code is FailureReason.RESOURCE_EXHAUSTED
    registry.detach_stream(record)
    registry.attach_stream(record)


def test_unknown_ids_and_wrong_request_ids_look_the_same() -> None:
    registry = _registry()
    _open(registry)
    for transfer_id, request_id in (("z" * 20, "req"), ("t" * 20, "other-req")):
        with pytest.raises(TransferRejected) as raised:
            registry.find(transfer_id, request_id)
        assert raised.value.code is FailureReason.UNKNOWN_TRANSFER
        assert raised.value.detail == "no such transfer"


def test_finished_transfers_are_forgotten_beyond_capacity() -> None:
    registry = _registry(finished=2)
    for index in range(3):
        record, _ = _open(registry, chr(ord("a") + index) * 20)
        registry.fail(record, TransferFailure(FailureReason.CANCELLED))
    with pytest.raises(TransferRejected):
        registry.find("a" * 20, "req")
    assert registry.find("c" * 20, "req").state is TransferState.FAILED


def test_target_commit_error_fails_without_calling_fail() -> None:
    registry = _registry()
    record, target = _open(registry, target=RecordingTarget(commit_error=RuntimeError("gpu gone")))
    chunks = _chunks()
    _deliver_all(registry, record, chunks)
    with pytest.raises(TransferRejected) as raised:
        registry.commit(record, len(chunks), sum(c.size_bytes(LAYOUT) for c in chunks))
    assert raised.value.code is FailureReason.INTERNAL
    assert target.calls.count("commit") == 1 and not [c for c in target.calls if c.startswith("fail")]
    assert record.state is TransferState.FAILED


def test_state_moves_only_along_the_table() -> None:
    registry = _registry()
    record, _ = _open(registry)
    registry.fail(record, TransferFailure(FailureReason.CANCELLED))
    with pytest.raises(IllegalTransferTransition):
        record._move(TransferState.COMMITTED)


def test_concurrent_admissions_of_one_chunk_write_it_once() -> None:
    registry = _registry()
    record, _ = _open(registry)
    chunk = _chunks()[0]
    results: list[Admission] = []
    barrier = threading.Barrier(8)

    def admit() -> None:
        barrier.wait()
        results.append(registry.admit(record, chunk, 7))

    threads = [threading.Thread(target=admit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(Admission.WRITE) == 1 and results.count(Admission.DUPLICATE) == 7
