"""The hand-over bookkeeping (worker/handover.py) on its own: reservations, leases, pins, deferred
ends and the inbox, without an engine (tests/unit/test_engine.py runs them inside one)."""

from __future__ import annotations

import pytest

from worker.handover import (
    EndTiming,
    Expiry,
    Handover,
    KvCommitted,
    KvWriteFailed,
    PushReported,
    RequestHandover,
    Unpinned,
)
from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason, TransferFailure, TransferRejected

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32", model_fingerprint="fp")


def make(**kwargs) -> tuple[Handover, list[int]]:
    wakes: list[int] = []
    handover = Handover(LAYOUT, reservation_timeout_s=5.0, sender_lease_s=10.0, on_inbox=lambda: wakes.append(1), **kwargs)
    return handover, wakes


def test_a_reservation_is_announced_once_and_opened_by_its_transfer_id():
    handover, wakes = make()
    state = RequestHandover()
    reservation = handover.reserve(state, "r", [3, 4], 20, now=100.0)
    (notice,) = handover.drain_new_reservations()
    assert (notice.request_id, notice.transfer_id, notice.num_blocks, notice.num_tokens, notice.expires_at_s) == (
        "r", reservation.transfer_id, 2, 20, 105.0
    )
    assert handover.drain_new_reservations() == []
    assert handover.reservation_of(state) == notice

    written = []
    target = handover.open(reservation.transfer_id, "r", LAYOUT, lambda *args: written.append(args))
    target.write(0, 2, 1, 2, memoryview(b"kv"))
    assert written == [([4], 0, 2, memoryview(b"kv"))]
    target.commit()
    assert list(handover.inbox()) == [KvCommitted(reservation.transfer_id)] and wakes == [1]
    assert handover.commit(reservation.transfer_id) is reservation
    assert handover.settle(state, reservation) and state.reservation is None
    assert handover.commit(reservation.transfer_id) is None  # once


def test_a_target_fills_its_reserved_blocks_in_place_under_the_lock_and_not_once_they_are_gone():
    handover, _ = make()
    state = RequestHandover()
    reservation = handover.reserve(state, "r", [3, 4, 8], 40, now=0.0)
    calls = []

    def fill_blocks(block_ids, layer_start, layer_end, copy):
        assert reservation.lock.locked()  # the engine cannot free the blocks while they are written
        copy(["views"])
        calls.append((block_ids, layer_start, layer_end))
        return True

    copied = []
    target = handover.open(reservation.transfer_id, "r", LAYOUT, lambda *args: None, fill_blocks)
    assert target.fill(0, 2, 1, 3, copied.append)
    assert calls == [([4, 8], 0, 2)] and copied == [["views"]]
    with pytest.raises(TransferRejected) as info:
        target.fill(0, 2, 2, 4, copied.append)  # past the reservation
    assert info.value.failure.reason is FailureReason.PROTOCOL_ERROR
    handover.cancel(state)
    with pytest.raises(TransferRejected) as info:
        target.fill(0, 2, 0, 1, copied.append)
    assert info.value.failure.reason is FailureReason.RESERVATION_EXPIRED
    assert len(calls) == 1 and len(copied) == 1
    # A target without in-place filling declines: the receiver copies out and calls write instead.
    other = handover.reserve(RequestHandover(), "s", [5], 16, now=0.0)
    assert not handover.open(other.transfer_id, "s", LAYOUT, lambda *args: None).fill(0, 2, 0, 1, copied.append)
    assert len(copied) == 1


@pytest.mark.parametrize(
    ("transfer_id", "request_id", "layout", "reason"),
    [
        ("nope", "r", LAYOUT, FailureReason.UNKNOWN_TRANSFER),
        (None, "other", LAYOUT, FailureReason.UNKNOWN_TRANSFER),
        (None, "r", KvLayout(2, 2, 8, 32, "float32", "fp"), FailureReason.INCOMPATIBLE),
    ],
)
def test_open_refuses_what_does_not_match(transfer_id, request_id, layout, reason):
    handover, _ = make()
    reservation = handover.reserve(RequestHandover(), "r", [1], 16, now=0.0)
    with pytest.raises(TransferRejected) as info:
        handover.open(transfer_id or reservation.transfer_id, request_id, layout, lambda *args: None)
    assert info.value.failure.reason is reason


def test_a_cancelled_or_expired_reservation_takes_no_writes():
    handover, _ = make()
    state = RequestHandover()
    reservation = handover.reserve(state, "r", [1], 16, now=0.0)
    target = handover.open(reservation.transfer_id, "r", LAYOUT, lambda *args: None)
    assert handover.expired(state, 4.9, waiting_to_send=False) is None
    assert handover.expired(state, 5.0, waiting_to_send=False) is Expiry.RESERVATION
    assert handover.expired(state, 6.0, waiting_to_send=False) is None  # expires once
    assert handover.reservation_of(state) is None
    with pytest.raises(TransferRejected):
        target.write(0, 1, 0, 1, memoryview(b""))
    with pytest.raises(TransferRejected) as info:
        handover.open(reservation.transfer_id, "r", LAYOUT, lambda *args: None)
    assert info.value.failure.reason is FailureReason.RESERVATION_EXPIRED
    handover.forget(state)
    assert handover.find(reservation.transfer_id) is None and state.reservation is None


def test_a_failed_write_is_reported_through_the_inbox():
    handover, _ = make()
    reservation = handover.reserve(RequestHandover(), "r", [1], 16, now=0.0)
    failure = TransferFailure(FailureReason.CHECKSUM_MISMATCH, "bad chunk")
    handover.open(reservation.transfer_id, "r", LAYOUT, lambda *args: None).fail(failure)
    handover.post(PushReported("p", None))
    assert list(handover.inbox()) == [KvWriteFailed(reservation.transfer_id, failure), PushReported("p", None)]
    assert not handover.has_mail()


def test_the_lease_runs_out_only_when_no_push_is_in_flight():
    handover, _ = make()
    state = RequestHandover()
    handover.start_lease(state, now=0.0)
    assert handover.expired(state, 9.9, waiting_to_send=True) is None
    handover.pin(state)
    assert handover.expired(state, 10.0, waiting_to_send=True) is None
    assert handover.unpin(state) is Unpinned.REPORT
    assert handover.expired(state, 10.0, waiting_to_send=False) is None  # not waiting to send any more
    assert handover.expired(state, 10.0, waiting_to_send=True) is Expiry.LEASE


def test_an_end_waits_for_the_last_push():
    handover, _ = make()
    state = RequestHandover()
    ended = []
    assert handover.defer_end(state, ended.append) is EndTiming.NOW
    handover.pin(state)
    handover.pin(state)
    assert handover.defer_end(state, ended.append) is EndTiming.DEFERRED
    assert handover.defer_end(state, lambda outputs: None) is EndTiming.ALREADY_DEFERRED
    assert handover.unpin(state) is Unpinned.WAIT
    assert handover.unpin(state) is Unpinned.END
    state.deferred_end([])
    assert ended == [[]]
