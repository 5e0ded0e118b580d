"""Every fault kind gives its documented outcome (worker/kv_transfer/faults.py) on both sides: the
sender's TransferOutcome and the calls the receiver's target got; the receiver serves on. Each test
runs on both data planes (gRPC streams, and shared memory forced); a SIGKILLed sender's segment is
removed by the sweep a launcher runs."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time

import msgspec
import pytest

from worker.kv_layout import KvLayout
from worker.kv_transfer import shm
from worker.kv_transfer.buffers import LinearKvBuffer
from worker.kv_transfer.config import SenderConfig
from worker.kv_transfer.failures import FailureReason
from worker.kv_transfer.faults import FaultInjector
from worker.kv_transfer.ids import new_transfer_id
from worker.kv_transfer.sender import KvSender
from worker.kv_transfer.testing import ReceiverProcess

pytestmark = pytest.mark.timeout(120)

# 6 layers x 8 blocks of 8 KiB per layer: 6 whole-layer chunks of 64 KiB, dealt onto 2 streams
# (chunks 0, 2, 4 on the first; 1, 3, 5 on the second).
LAYOUT = KvLayout(num_layers=6, num_kv_heads=2, head_dim=64, tokens_per_block=16, dtype="bfloat16", model_fingerprint="m")
NUM_BLOCKS = 8
SENDER_CONFIG = SenderConfig(num_streams=2, num_connections=2, max_chunk_bytes=64 * 1024)
DEADLINE_S = 10.0
SHORT_DEADLINE_S = 1.0

SENDER_RULES = [
    {"kind": "drop", "request_ids": ["tx-drop"], "chunk": 1},
    {"kind": "delay", "request_ids": ["tx-delay"], "chunk": 0, "seconds": 0.2},
    {"kind": "duplicate", "request_ids": ["tx-duplicate"]},
    {"kind": "reorder", "request_ids": ["tx-reorder"], "chunk": 0},
    {"kind": "corrupt", "request_ids": ["tx-corrupt"], "chunk": 1},
    {"kind": "truncate", "request_ids": ["tx-truncate"], "chunk": 2},
    {"kind": "stall", "request_ids": ["tx-stall"], "chunk": 1, "seconds": 0.2},
    {"kind": "stall", "request_ids": ["tx-cancel"], "chunk": 1},  # until cancelled
    {"kind": "close", "request_ids": ["tx-close"], "chunk": 2},
    {"kind": "kill", "request_ids": ["tx-kill"], "chunk": 2},
]
RECEIVER_RULES = [
    {"kind": "drop", "side": "receiver", "request_ids": ["rx-drop"], "chunk": 1},
    {"kind": "delay", "side": "receiver", "request_ids": ["rx-delay"], "chunk": 0, "seconds": 0.2},
    {"kind": "stall", "side": "receiver", "request_ids": ["rx-stall"], "chunk": 0, "seconds": 0.2},
    {"kind": "expire", "side": "receiver", "request_ids": ["rx-expire"], "chunk": 1},
    {"kind": "refuse", "side": "receiver", "request_ids": ["rx-refuse"]},
]


def _source(seed: int = 3) -> LinearKvBuffer:
    size = LAYOUT.run_bytes(LAYOUT.num_layers, NUM_BLOCKS)
    return LinearKvBuffer(LAYOUT, NUM_BLOCKS, bytearray(random.Random(seed).randbytes(size)))


@pytest.fixture(scope="module")
def receiver():
    with ReceiverProcess(
        config={"max_chunk_bytes": 64 * 1024, "reaper_interval_s": 0.05},
        faults={"seed": 1, "rules": RECEIVER_RULES},
    ) as process:
        yield process


@pytest.fixture(scope="module", params=["grpc", "shm"])
def plane(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def sender(plane: str):
    config = msgspec.structs.replace(SENDER_CONFIG, data_plane=plane)
    with KvSender(config, faults=FaultInjector.from_mapping({"seed": 1, "rules": SENDER_RULES}), shm_tag="faults") as instance:
        yield instance
    assert shm.segments("faults") == []  # a closed sender leaves nothing


def _push(receiver: ReceiverProcess, sender: KvSender, request_id: str, deadline_s: float = DEADLINE_S, cancelled=None):
    source = _source()
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, request_id, LAYOUT, NUM_BLOCKS)
    outcome = sender.push(receiver.address, transfer_id, request_id, source, deadline_s, cancelled)
    result, data = receiver.received_bytes(transfer_id, wait_s=5.0)
    return outcome, result, data, source


def _assert_still_serving(receiver: ReceiverProcess, sender: KvSender) -> None:
    outcome, result, data, source = _push(receiver, sender, "healthy")
    assert outcome.ok, outcome.failure
    assert result.state == "COMMITTED" and data == bytes(source.view)


@pytest.mark.parametrize("request_id", ["tx-delay", "tx-duplicate", "tx-reorder", "rx-delay"])
def test_harmless_faults_still_deliver_every_byte(receiver, sender, request_id: str) -> None:
    outcome, result, data, source = _push(receiver, sender, request_id)
    assert outcome.ok, outcome.failure
    assert result.state == "COMMITTED" and result.events == ("commit",)
    assert data == bytes(source.view)
    if request_id == "tx-duplicate":
        assert result.writes == outcome.chunks_sent  # the copies were ignored, not written twice
    _assert_still_serving(receiver, sender)


@pytest.mark.parametrize(
    ("request_id", "reason", "deadline_s"),
    [
        ("tx-drop", FailureReason.INCOMPLETE, DEADLINE_S),
        ("tx-corrupt", FailureReason.CHECKSUM_MISMATCH, DEADLINE_S),
        ("tx-truncate", FailureReason.INCOMPLETE, DEADLINE_S),
        ("tx-stall", FailureReason.DEADLINE_EXCEEDED, SHORT_DEADLINE_S),
        ("tx-close", FailureReason.PEER_UNAVAILABLE, DEADLINE_S),
        ("rx-drop", FailureReason.INCOMPLETE, DEADLINE_S),
        ("rx-stall", FailureReason.DEADLINE_EXCEEDED, SHORT_DEADLINE_S),
        ("rx-expire", FailureReason.RESERVATION_EXPIRED, DEADLINE_S),
    ],
)
def test_harmful_faults_fail_with_the_same_reason_on_both_sides(
    receiver, sender, request_id: str, reason: FailureReason, deadline_s: float
) -> None:
    started = time.monotonic()
    outcome, result, _, _ = _push(receiver, sender, request_id, deadline_s)
    assert not outcome.ok
    assert outcome.failure.reason is reason, outcome.failure
    assert result.state == "FAILED" and result.failure_reason == reason.value, result
    assert result.events == (f"fail:{reason.value}",)  # told exactly once, never committed
    assert "fail-during-write" not in result.events and not any(e.startswith("write-after") for e in result.events)
    assert time.monotonic() - started < deadline_s + 5.0  # bounded, never a hang
    _assert_still_serving(receiver, sender)


def test_a_cancelled_push_returns_at_once_and_the_receiver_hears_why(receiver, sender) -> None:
    """A push nobody waits for any more (its request released, or its transfer retried elsewhere
    after it stalled) is cancelled instead of pinning its blocks until its deadline."""
    assert not sender.cancel(new_transfer_id(), "no such push")
    source = _source()
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, "tx-cancel", LAYOUT, NUM_BLOCKS)
    outcomes = []
    pushing = threading.Thread(target=lambda: outcomes.append(sender.push(receiver.address, transfer_id, "tx-cancel", source, DEADLINE_S)))
    started = time.monotonic()
    pushing.start()
    time.sleep(0.3)  # the push is stalled on its second chunk
    assert pushing.is_alive()
    assert sender.cancel(transfer_id, "the router retried the transfer elsewhere")
    pushing.join(timeout=DEADLINE_S)
    assert not pushing.is_alive() and time.monotonic() - started < DEADLINE_S / 2
    (outcome,) = outcomes
    assert outcome.failure is not None and outcome.failure.reason is FailureReason.CANCELLED, outcome.failure
    assert "retried the transfer elsewhere" in outcome.failure.detail
    result, _ = receiver.received_bytes(transfer_id, wait_s=5.0)
    assert result.state == "FAILED" and result.failure_reason == FailureReason.CANCELLED.value, result
    assert not sender.cancel(transfer_id, "over already")
    _assert_still_serving(receiver, sender)


def test_a_cancel_that_comes_before_the_push_can_be_found_is_not_lost(receiver, sender) -> None:
    """The instance records why it cancels a push, then calls KvSender.cancel. A cancel that lands
    after the instance handed the push to its thread but before the sender registered it finds no
    push to end; the push's `cancelled` check, asked once it can be found, sees the record instead,
    and the push ends before its Prepare (it used to run to its end, pinning its blocks)."""
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, "tx-cancel", LAYOUT, NUM_BLOCKS)  # would stall until cancelled
    recorded = {transfer_id: "superseded by another transfer"}
    assert not sender.cancel(transfer_id, recorded[transfer_id])  # too early: nothing to end yet
    started = time.monotonic()
    outcome = sender.push(receiver.address, transfer_id, "tx-cancel", _source(), DEADLINE_S, lambda: recorded.get(transfer_id))
    assert outcome.failure is not None and outcome.failure.reason is FailureReason.CANCELLED, outcome.failure
    assert outcome.failure.detail == "superseded by another transfer"
    assert outcome.chunks_sent == 0 and outcome.bytes_sent == 0
    assert time.monotonic() - started < DEADLINE_S / 2  # not run to its deadline
    assert receiver.result(transfer_id).state == "UNOPENED"  # never prepared: nothing to abort there
    assert not sender.cancel(transfer_id, "over already")
    # A check that finds no record changes nothing.
    outcome, result, data, source = _push(receiver, sender, "healthy", cancelled=lambda: None)
    assert outcome.ok, outcome.failure
    assert result.state == "COMMITTED" and data == bytes(source.view)


class _Computing(LinearKvBuffer):
    """A StreamingTransferSource none of whose blocks is final yet: a push relayed at a context's
    start, whose deadline is the whole transfer timeout."""

    def wait_ready(self, have_blocks: int, timeout_s: float) -> int:
        time.sleep(min(timeout_s, 0.05))
        return have_blocks


def test_a_cancel_ends_a_prepare_that_the_receiver_never_answers(receiver, sender) -> None:
    """A stopped receiver takes the connection and never answers. A push relayed at its context's
    start waits in its Prepare; when the router gives the transfer up, the cancel ends that wait at
    once (it used to hold the push, and the blocks it pins, to its deadline)."""
    source = _Computing(LAYOUT, NUM_BLOCKS, bytearray(LAYOUT.run_bytes(LAYOUT.num_layers, NUM_BLOCKS)))
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, "healthy", LAYOUT, NUM_BLOCKS)
    outcomes = []
    pushing = threading.Thread(target=lambda: outcomes.append(sender.push(receiver.address, transfer_id, "healthy", source, DEADLINE_S)))
    os.kill(receiver.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        pushing.start()
        time.sleep(0.3)  # in its Prepare
        assert pushing.is_alive()
        assert sender.cancel(transfer_id, "the router gave the transfer up")
        pushing.join(timeout=DEADLINE_S)
        # The cancel, then _fail's Abort to the stopped receiver (SENDER_CONFIG.abort_timeout_s, 1 s).
        assert not pushing.is_alive() and time.monotonic() - started < DEADLINE_S / 2
    finally:
        os.kill(receiver.pid, signal.SIGCONT)
    (outcome,) = outcomes
    assert outcome.failure is not None and outcome.failure.reason is FailureReason.CANCELLED, outcome.failure
    assert outcome.chunks_sent == 0
    assert receiver.result(transfer_id, wait_s=0.5).state != "COMMITTED"
    _assert_still_serving(receiver, sender)


def test_refused_prepare_opens_nothing(receiver, sender) -> None:
    outcome, result, _, _ = _push(receiver, sender, "rx-refuse")
    assert outcome.failure is not None and outcome.failure.reason is FailureReason.RESOURCE_EXHAUSTED
    assert outcome.chunks_sent == 0
    assert result.state == "UNOPENED"
    _assert_still_serving(receiver, sender)


def _push_and_get_killed(address: str, transfer_id: str, plane: str) -> None:
    """Runs in a spawned sender process that the kill fault ends."""
    config = msgspec.structs.replace(SENDER_CONFIG, data_plane=plane)
    faults = FaultInjector.from_mapping({"seed": 1, "rules": SENDER_RULES})
    with KvSender(config, faults=faults, shm_tag="killedtx") as doomed:
        doomed.push(address, transfer_id, "tx-kill", _source(), DEADLINE_S)


def test_killed_sender_fails_the_transfer_on_the_receiver(receiver, sender, plane) -> None:
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, "tx-kill", LAYOUT, NUM_BLOCKS)
    process = multiprocessing.get_context("spawn").Process(
        target=_push_and_get_killed, args=(receiver.address, transfer_id, plane)
    )
    process.start()
    process.join(60)
    assert process.exitcode == -9  # SIGKILL
    result = receiver.result(transfer_id, wait_s=5.0)
    assert result.state == "FAILED" and result.failure_reason == FailureReason.PEER_UNAVAILABLE.value, result
    _assert_still_serving(receiver, sender)
    # The killed process never closed its pool: its segment stays until a sweep of its tag.
    assert len(shm.segments("killedtx")) == (1 if plane == "shm" else 0)
    assert len(shm.sweep("killedtx", only_dead_owners=True)) == (1 if plane == "shm" else 0)
    assert shm.segments("killedtx") == []


@pytest.mark.parametrize("plane", ["grpc", "shm"])
def test_killed_receiver_is_peer_unavailable_to_the_sender(plane: str) -> None:
    doomed = ReceiverProcess(faults={"rules": [{"kind": "kill", "side": "receiver", "chunk": 1}]})
    doomed.start()
    try:
        transfer_id = new_transfer_id()
        doomed.expect(transfer_id, "victim", LAYOUT, NUM_BLOCKS)
        config = msgspec.structs.replace(SENDER_CONFIG, data_plane=plane)
        with KvSender(config, shm_tag="killedrx") as plain:
            started = time.monotonic()
            outcome = plain.push(doomed.address, transfer_id, "victim", _source(), DEADLINE_S)
        assert outcome.failure is not None and outcome.failure.reason is FailureReason.PEER_UNAVAILABLE, outcome
        assert time.monotonic() - started < DEADLINE_S
        for _ in range(100):
            if not doomed.is_alive():
                break
            time.sleep(0.05)
        assert not doomed.is_alive()
        assert shm.segments("killedrx") == []  # a receiver owns no segments; the sender closed its own
    finally:
        doomed.kill()


class _BrokenSource:
    """An engine bug: reading the third chunk raises. A plain TransferSource (`read` only, no
    `read_parts`), as an engine's own source is."""

    def __init__(self, buffer: LinearKvBuffer) -> None:
        self.layout = buffer.layout
        self.num_blocks = buffer.num_blocks
        self._buffer = buffer

    def read(self, layer_start: int, layer_end: int, block_start: int, block_end: int):
        if layer_start == 2:
            raise RuntimeError("cache tensor went away")
        return self._buffer.read(layer_start, layer_end, block_start, block_end)


def test_source_error_fails_the_push_and_the_receiver_hears_why(receiver, sender) -> None:
    size = LAYOUT.run_bytes(LAYOUT.num_layers, NUM_BLOCKS)
    source = _BrokenSource(LinearKvBuffer(LAYOUT, NUM_BLOCKS, bytearray(size)))
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, "engine-bug", LAYOUT, NUM_BLOCKS)
    outcome = sender.push(receiver.address, transfer_id, "engine-bug", source, DEADLINE_S)
    assert outcome.failure is not None and outcome.failure.reason is FailureReason.INTERNAL
    assert "cache tensor went away" in outcome.failure.detail
    result = receiver.result(transfer_id, wait_s=5.0)
    assert result.events == ("fail:INTERNAL",), result
    _assert_still_serving(receiver, sender)


def test_a_push_on_a_connection_closed_on_this_side_reconnects_once_and_delivers(receiver) -> None:
    """grpc raises ValueError for a call on a closed channel (another push's failure or a fault, or
    a cache eviction, closed the shared connections under this push). The receiver saw nothing of
    that call, and a real connection loss would leave a channel that reconnects: the push forgets
    the closed connections, opens fresh ones once, and delivers (the chaos soak saw retried pushes
    fail on connections another push's fault had just closed)."""
    with KvSender(SENDER_CONFIG) as sender:
        closed = sender._connect(receiver.address)
        closed.close()  # cached, and now closed
        outcome, result, data, source = _push(receiver, sender, "closed-before-prepare")
        assert outcome.ok, outcome.failure
        assert result.events == ("commit",) and data == bytes(source.view)
        assert sender._connect(receiver.address) is not closed  # the fresh ones are cached


def _closed_pushes(connections, monkeypatch) -> None:
    class _ClosedPush:
        def future(self, *args, **kwargs):
            raise ValueError("Cannot invoke RPC: Channel closed!")

    monkeypatch.setattr(connections, "pushes", [_ClosedPush() for _ in connections.pushes])


def test_a_stream_that_cannot_start_on_a_closed_connection_starts_on_fresh_ones(receiver, monkeypatch) -> None:
    """The race the chaos suite hit: one stream's fault closed the connection while the push was
    starting its first stream; nothing was sent yet, so the push reconnects once and goes on."""
    with KvSender(SENDER_CONFIG) as sender:
        connections = sender._connect(receiver.address)
        _closed_pushes(connections, monkeypatch)
        outcome, result, data, source = _push(receiver, sender, "closed-before-streams")
        assert outcome.ok, outcome.failure
        assert result.events == ("commit",) and data == bytes(source.view)
        assert sender._connect(receiver.address) is not connections


def test_a_push_whose_fresh_connections_are_closed_too_fails_as_peer_unavailable(receiver, monkeypatch) -> None:
    """One reconnect per push: when the fresh connections cannot start a stream either, the push
    fails as PEER_UNAVAILABLE (never raises), forgets them, and commits nothing."""
    with KvSender(SENDER_CONFIG) as sender:
        original_connect = sender._connect
        handed_out = []

        def connect_closed(target):
            connections = original_connect(target)
            _closed_pushes(connections, monkeypatch)
            handed_out.append(connections)
            return connections

        monkeypatch.setattr(sender, "_connect", connect_closed)
        transfer_id = new_transfer_id()
        receiver.expect(transfer_id, "closed-twice", LAYOUT, NUM_BLOCKS)
        outcome = sender.push(receiver.address, transfer_id, "closed-twice", _source(), SHORT_DEADLINE_S)
        assert outcome.failure is not None and outcome.failure.reason is FailureReason.PEER_UNAVAILABLE
        assert "connection closed" in outcome.failure.detail and outcome.chunks_sent == 0
        assert len(handed_out) == 2  # the first connections and one reconnect, no more
        monkeypatch.setattr(sender, "_connect", original_connect)
        assert sender._connect(receiver.address) is not handed_out[-1]  # forgotten: the next push reconnects
        # Nothing was committed; the receiver's deadline ends the transfer it had opened.
        assert receiver.result(transfer_id, wait_s=SHORT_DEADLINE_S + 5.0).state != "COMMITTED"
