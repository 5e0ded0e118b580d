"""The receiver's book of transfers: states, coverage of (layer, block) cells, limits, deadlines.

Pure bookkeeping without gRPC, so that it is tested directly. All methods are thread-safe. The
target's `commit` and `fail` are called outside the lock, exactly once per transfer, and `fail` only
once no write into the target is still running (the engine may reuse the blocks as soon as it
hears of the failure, so a late write must never land in them).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason, TransferFailure, TransferRejected
from worker.kv_transfer.interfaces import TransferTarget
from worker.kv_transfer.plan import ChunkSpec

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    OPEN = "OPEN"  # chunks are accepted
    COMMITTING = "COMMITTING"  # coverage verified, target.commit() running
    COMMITTED = "COMMITTED"  # acknowledged: the blocks are usable
    FAILED = "FAILED"  # the target was (or will be, once writes drain) told why


TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    TransferState.OPEN: frozenset({TransferState.COMMITTING, TransferState.FAILED}),
    TransferState.COMMITTING: frozenset({TransferState.COMMITTED, TransferState.FAILED}),
    TransferState.COMMITTED: frozenset(),
    TransferState.FAILED: frozenset(),
}


class IllegalTransferTransition(RuntimeError):
    """A state change that TRANSITIONS does not allow (a bug in the transport)."""


class Admission(enum.Enum):
    WRITE = "WRITE"  # verify and write this chunk, then call finish_write
    DUPLICATE = "DUPLICATE"  # same sequence number, range and checksum as an accepted chunk: ignore it
    LATE = "LATE"  # the transfer has finished (failed, or committed and this is an exact replay): drop it
    CONFLICT = "CONFLICT"  # the transfer committed other contents under this sequence number: refuse it


@dataclass(frozen=True)
class CommitReceipt:
    chunks_received: int
    bytes_received: int


@dataclass(frozen=True)
class RegistryStats:
    open_transfers: int
    committed: int
    failed: int


class TransferRecord:
    """One transfer. Fields are guarded by the registry's lock; handlers treat it as an opaque handle."""

    def __init__(
        self,
        transfer_id: str,
        request_id: str,
        target: TransferTarget,
        layout: KvLayout,
        num_blocks: int,
        max_chunk_bytes: int,
        deadline_s: float,
    ) -> None:
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.layout = layout
        self.num_blocks = num_blocks
        self.max_chunk_bytes = max_chunk_bytes
        self.deadline_s = deadline_s
        self.state = TransferState.OPEN
        self.failure: TransferFailure | None = None
        self._target: TransferTarget | None = target
        self._failure_delivered = False
        self._coverage = bytearray(layout.num_layers * num_blocks)
        self._accepted: dict[int, tuple[ChunkSpec, int]] = {}
        # What a committed transfer accepted, kept so that an exact replay (dropped: transfers are
        # idempotent) can be told from other contents (refused). Packed, because up to
        # finished_capacity committed transfers keep theirs: the sorted sequence numbers, and per
        # chunk its layer and block ranges and checksum (five words).
        self._committed_sequences = array("Q")
        self._committed_contents = array("Q")
        self._writes_in_flight = 0
        self.streams = 0
        # The negotiated checksum algorithm (a ChecksumAlgorithm value); set by the server.
        self.checksum_algorithm = 0
        # Set by the server: the receiver-side faults armed for this transfer (None: none).
        self.faults: object | None = None
        # Set by the server on the shared-memory plane: the sender's mapped segment (shm.py).
        self.shm_segment: object | None = None
        self.chunks_received = 0
        self.bytes_received = 0

    @property
    def target(self) -> TransferTarget:
        if self._target is None:
            raise IllegalTransferTransition(f"transfer {self.transfer_id} has finished; its target is released")
        return self._target

    @property
    def finished(self) -> bool:
        return self.state in (TransferState.COMMITTED, TransferState.FAILED)

    def _move(self, new_state: TransferState) -> None:
        if new_state not in TRANSITIONS[self.state]:
            raise IllegalTransferTransition(f"transfer {self.transfer_id}: {self.state.value} -> {new_state.value}")
        self.state = new_state


class TransferRegistry:
    def __init__(
        self,
        *,
        max_open_transfers: int,
        max_streams_per_transfer: int,
        finished_capacity: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_open = max_open_transfers
        self._max_streams = max_streams_per_transfer
        self._finished_capacity = finished_capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, TransferRecord] = {}
        self._finished_order: OrderedDict[str, None] = OrderedDict()
        self._open = 0
        self._committed = 0
        self._failed = 0

    # -- opening -----------------------------------------------------------------------------------

    def open_record(self, transfer_id: str) -> TransferRecord | None:
        """The transfer with this id, if it is still open (a repeated Prepare)."""
        with self._lock:
            record = self._records.get(transfer_id)
            return record if record is not None and not record.finished else None

    def check_new(self, transfer_id: str) -> None:
        """Refuse an id that is already known or a registry at its limit (before the sink is asked)."""
        with self._lock:
            if transfer_id in self._records:
                raise TransferRejected(FailureReason.UNKNOWN_TRANSFER, "transfer id already used")
            if self._open >= self._max_open:
                raise TransferRejected(
                    FailureReason.RESOURCE_EXHAUSTED, f"receiver has {self._open} open transfers (limit {self._max_open})"
                )

    def add(
        self,
        transfer_id: str,
        request_id: str,
        target: TransferTarget,
        num_blocks: int,
        max_chunk_bytes: int,
        timeout_s: float,
    ) -> TransferRecord:
        record = TransferRecord(
            transfer_id, request_id, target, target.layout, num_blocks, max_chunk_bytes, self._clock() + timeout_s
        )
        with self._lock:
            if transfer_id in self._records:
                raise TransferRejected(FailureReason.UNKNOWN_TRANSFER, "transfer id already used")
            self._records[transfer_id] = record
            self._open += 1
        return record

    # -- lookup and streams ------------------------------------------------------------------------

    def find(self, transfer_id: str, request_id: str) -> TransferRecord:
        """The transfer (open or recently finished); unknown ids and mismatched request ids are the same
        NOT_FOUND, so that a prober learns nothing about which ids exist."""
        with self._lock:
            record = self._records.get(transfer_id)
        if record is None or record.request_id != request_id:
            raise TransferRejected(FailureReason.UNKNOWN_TRANSFER, "no such transfer")
        return record

    def attach_stream(self, record: TransferRecord) -> None:
        with self._lock:
            if record.streams >= self._max_streams:
                raise TransferRejected(
                    FailureReason.RESOURCE_EXHAUSTED,
                    f"transfer already has {record.streams} streams (limit {self._max_streams})",
                )
            record.streams += 1

    def detach_stream(self, record: TransferRecord) -> None:
        with self._lock:
            record.streams -= 1

    # -- chunks ------------------------------------------------------------------------------------

    def admit(self, record: TransferRecord, spec: ChunkSpec, checksum: int) -> Admission:
        """Decide what to do with a chunk whose header passed validation. A chunk that overlaps cells
        another chunk already delivered, or reuses a sequence number for other contents, fails the
        transfer (PROTOCOL_ERROR) and is LATE. After commit, an exact replay of an accepted chunk is
        LATE and anything else a CONFLICT (the committed transfer stays as it is)."""
        deliver: TransferFailure | None = None
        with self._lock:
            if record.state is TransferState.COMMITTED:
                return Admission.LATE if self._replays_committed_locked(record, spec, checksum) else Admission.CONFLICT
            if record.state is not TransferState.OPEN:
                return Admission.LATE
            if self._clock() > record.deadline_s:
                deliver = self._fail_locked(record, TransferFailure(FailureReason.DEADLINE_EXCEEDED, "transfer deadline passed"))
                admission = Admission.LATE
            else:
                previous = record._accepted.get(spec.sequence)
                if previous is not None:
                    if previous == (spec, checksum):
                        return Admission.DUPLICATE
                    deliver = self._fail_locked(
                        record,
                        TransferFailure(FailureReason.PROTOCOL_ERROR, f"sequence {spec.sequence} reused for other contents"),
                    )
                    admission = Admission.LATE
                elif not self._cells_free_locked(record, spec):
                    deliver = self._fail_locked(
                        record,
                        TransferFailure(
                            FailureReason.PROTOCOL_ERROR,
                            f"chunk {spec.sequence} overlaps cells that another chunk delivered",
                        ),
                    )
                    admission = Admission.LATE
                else:
                    self._mark_cells_locked(record, spec)
                    record._accepted[spec.sequence] = (spec, checksum)
                    record._writes_in_flight += 1
                    return Admission.WRITE
        self._deliver_failure(record, deliver)
        return admission

    def finish_write(self, record: TransferRecord, size_bytes: int) -> None:
        """A WRITE admission's bytes are in the target (or the write gave up; the transfer failed then)."""
        with self._lock:
            record._writes_in_flight -= 1
            record.chunks_received += 1
            record.bytes_received += size_bytes
            deliver = self._take_undelivered_locked(record)
        self._deliver_failure(record, deliver)

    @staticmethod
    def _replays_committed_locked(record: TransferRecord, spec: ChunkSpec, checksum: int) -> bool:
        sequences = record._committed_sequences
        index = bisect_left(sequences, spec.sequence)
        if index == len(sequences) or sequences[index] != spec.sequence:
            return False
        stored = tuple(record._committed_contents[5 * index : 5 * index + 5])
        return stored == (spec.layer_start, spec.layer_end, spec.block_start, spec.block_end, checksum)

    @staticmethod
    def _cells_free_locked(record: TransferRecord, spec: ChunkSpec) -> bool:
        width = spec.block_end - spec.block_start
        for layer in range(spec.layer_start, spec.layer_end):
            start = layer * record.num_blocks + spec.block_start
            if record._coverage.count(0, start, start + width) != width:
                return False
        return True

    @staticmethod
    def _mark_cells_locked(record: TransferRecord, spec: ChunkSpec) -> None:
        width = spec.block_end - spec.block_start
        ones = b"\x01" * width
        for layer in range(spec.layer_start, spec.layer_end):
            start = layer * record.num_blocks + spec.block_start
            record._coverage[start : start + width] = ones

    # -- ending ------------------------------------------------------------------------------------

    def fail(self, record: TransferRecord, failure: TransferFailure) -> bool:
        """Fail an open transfer; False if it had already finished (or is being committed)."""
        with self._lock:
            if record.state is not TransferState.OPEN:
                return False
            deliver = self._fail_locked(record, failure)
        self._deliver_failure(record, deliver)
        return True

    def fail_by_id(self, transfer_id: str, failure: TransferFailure) -> bool:
        with self._lock:
            record = self._records.get(transfer_id)
        return record is not None and self.fail(record, failure)

    def fail_all_open(self, failure: TransferFailure) -> int:
        """Fail every open transfer (the server is stopping); returns how many."""
        with self._lock:
            open_records = [r for r in self._records.values() if r.state is TransferState.OPEN]
        return sum(1 for record in open_records if self.fail(record, failure))

    def expire_overdue(self) -> int:
        """Fail every open transfer whose deadline has passed; returns how many."""
        now = self._clock()
        with self._lock:
            overdue = [r for r in self._records.values() if r.state is TransferState.OPEN and now > r.deadline_s]
        failure = TransferFailure(FailureReason.DEADLINE_EXCEEDED, "transfer deadline passed before commit")
        return sum(1 for record in overdue if self.fail(record, failure))

    def commit(
        self, record: TransferRecord, chunks_sent: int, bytes_sent: int, token_ids: tuple[int, ...] = ()
    ) -> CommitReceipt:
        """Verify that every cell arrived exactly once and commit the target. Raises TransferRejected
        with the transfer's failure if it failed (now or before). Repeating a successful commit is
        answered with the same receipt."""
        deliver: TransferFailure | None = None
        with self._lock:
            if record.state is TransferState.COMMITTED:
                return CommitReceipt(record.chunks_received, record.bytes_received)
            if record.state is TransferState.COMMITTING:
                raise TransferRejected(FailureReason.PROTOCOL_ERROR, "commit already in progress")
            if record.state is TransferState.OPEN:
                problem = self._incompleteness_locked(record, chunks_sent, bytes_sent)
                if problem is not None:
                    deliver = self._fail_locked(record, problem)
                else:
                    record._move(TransferState.COMMITTING)
            failure = record.failure
        if deliver is not None or failure is not None:
            self._deliver_failure(record, deliver)
            assert failure is not None
            raise TransferRejected(failure.reason, failure.detail)
        try:
            record.target.commit(token_ids)
        except TransferRejected as rejected:
            self._end_commit(record, rejected.failure)
            raise
        except Exception as error:  # the engine's bug must not leave the transfer half-committed
            logger.exception("target.commit() of transfer %s raised", record.transfer_id)
            failure = TransferFailure(FailureReason.INTERNAL, f"target commit failed: {type(error).__name__}")
            self._end_commit(record, failure)
            raise TransferRejected(failure.reason, failure.detail) from error
        self._end_commit(record, None)
        return CommitReceipt(record.chunks_received, record.bytes_received)

    def _end_commit(self, record: TransferRecord, failure: TransferFailure | None) -> None:
        with self._lock:
            if failure is None:
                record._move(TransferState.COMMITTED)
                self._committed += 1
                for sequence in sorted(record._accepted):
                    spec, checksum = record._accepted[sequence]
                    record._committed_sequences.append(sequence)
                    record._committed_contents.extend(
                        (spec.layer_start, spec.layer_end, spec.block_start, spec.block_end, checksum)
                    )
            else:
                # The target's own commit failed: it knows, and is not told again (commit and fail
                # are never both called).
                record._move(TransferState.FAILED)
                record.failure = failure
                record._failure_delivered = True
                self._failed += 1
            record._target = None
            self._finish_locked(record)
        if failure is not None:
            logger.warning("commit of transfer %s failed: %s", record.transfer_id, failure)

    def _incompleteness_locked(self, record: TransferRecord, chunks_sent: int, bytes_sent: int) -> TransferFailure | None:
        if self._clock() > record.deadline_s:
            return TransferFailure(FailureReason.DEADLINE_EXCEEDED, "transfer deadline passed before commit")
        if record._writes_in_flight:
            return TransferFailure(FailureReason.INCOMPLETE, f"{record._writes_in_flight} chunk writes still running at commit")
        missing = record._coverage.count(0)
        if missing:
            return TransferFailure(
                FailureReason.INCOMPLETE, f"{missing} of {len(record._coverage)} (layer, block) cells never arrived"
            )
        if chunks_sent != record.chunks_received or bytes_sent != record.bytes_received:
            return TransferFailure(
                FailureReason.INCOMPLETE,
                f"sender sent {chunks_sent} chunks / {bytes_sent} bytes, receiver accepted "
                f"{record.chunks_received} / {record.bytes_received}",
            )
        return None

    def _fail_locked(self, record: TransferRecord, failure: TransferFailure) -> TransferFailure | None:
        """Move to FAILED; returns the failure to deliver now (None: writes still running, the last
        finish_write delivers it)."""
        record._move(TransferState.FAILED)
        record.failure = failure
        self._failed += 1
        self._finish_locked(record)
        return self._take_undelivered_locked(record)

    def _take_undelivered_locked(self, record: TransferRecord) -> TransferFailure | None:
        if record.state is not TransferState.FAILED or record._failure_delivered or record._writes_in_flight:
            return None
        record._failure_delivered = True
        return record.failure

    def _finish_locked(self, record: TransferRecord) -> None:
        self._open -= 1
        record._coverage = bytearray()
        record._accepted = {}
        self._finished_order[record.transfer_id] = None
        while len(self._finished_order) > self._finished_capacity:
            oldest, _ = self._finished_order.popitem(last=False)
            self._records.pop(oldest, None)

    def _deliver_failure(self, record: TransferRecord, failure: TransferFailure | None) -> None:
        if failure is None:
            return
        target, record._target = record._target, None
        if target is None:
            return
        logger.info("transfer %s of request %s failed: %s", record.transfer_id, record.request_id, failure)
        try:
            target.fail(failure)
        except Exception:  # the transfer is already failed; the engine's bug is logged, not propagated
            logger.exception("target.fail() of transfer %s raised", record.transfer_id)

    def stats(self) -> RegistryStats:
        with self._lock:
            return RegistryStats(open_transfers=self._open, committed=self._committed, failed=self._failed)
