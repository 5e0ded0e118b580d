"""A request's KV hand-over on one instance: the one place that owns its hand-over state.

TensorRT-LLM's disaggregated flow (its LlmRequestState DISAGG_* values, scheduler/state.py) has a
sending side and a receiving side. This module keeps each side's bookkeeping; the engine
(worker/engine.py) moves the request's local state and emits its outputs.

Receiving side (a GENERATION_ONLY request on a GENERATION or MIXED instance):
- waiting for blocks: DISAGG_GENERATION_INIT, until the capacity scheduler reserves them;
- reserved: `Handover.reserve` registers the blocks under a new, unguessable transfer id and queues a
  `Reservation` notice for the router (DISAGG_GENERATION_TRANS_IN_PROGRESS). A transfer thread
  writes into exactly those blocks through `TransferTarget`, holding the reservation's lock, so the
  engine never frees blocks under a writer;
- committed: the writer posts `KvCommitted`; the engine thread takes it (`commit`) and the request
  becomes DISAGG_GENERATION_TRANS_COMPLETE, then generates;
- dead: expired (`expired`: no commit within reservation_timeout_s), failed (the writer posts
  `KvWriteFailed`) or cancelled (an abort): DISAGG_TRANS_ERROR (GENERATION_COMPLETE for an abort),
  blocks freed.

Sending side (a CONTEXT_ONLY request on a PREFILL or MIXED instance):
- leased: its first token is out and it holds its blocks, waiting for the push
  (DISAGG_CONTEXT_TRANS_IN_PROGRESS) until the lease of sender_lease_s runs out;
- pinned: pushes in flight read the blocks (`pin` for each, `unpin` when its result comes back as
  `PushReported`). A pinned request's lease cannot expire, and an abort or release that comes
  meanwhile is deferred (`defer_end`) until the last push returns, never freeing blocks under a
  reader;
- acknowledged: a push succeeded, DISAGG_CONTEXT_COMPLETE, blocks freed; deferred like an abort
  while another push is still in flight (a stalled one the router gave up and retried past). A
  failed push leaves it leased (the router may retry the transfer, or release it:
  DISAGG_TRANS_ERROR, as does an expired lease).

Threads: the engine thread owns `RequestHandover` values and calls every method here, except the
ones marked "any thread" (`open`, `post` and `TransferTarget`), which transfer and push threads call.
They report through the inbox, which the engine thread drains at its next step.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from worker.engine_types import Reservation
from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason, TransferFailure, TransferRejected
from worker.kv_transfer.ids import new_transfer_id
from worker.protocol import RequestOutput

# Ends a request (its final output goes to the list): run at once, or deferred behind pushes.
EndRequest = Callable[[list[RequestOutput]], None]
# Writes KV bytes into cache blocks: (block ids, layer start, layer end, data) (worker/kv_cache.py).
ImportBlocks = Callable[[list[int], int, int, memoryview], None]
# Lets a copy write into cache blocks directly: (block ids, layer start, layer end, copy), False when
# the blocks cannot be handed out as views (worker/kv_cache.py PagedKvCache.fill_blocks).
FillBlocks = Callable[[list[int], int, int, Callable[[list[memoryview]], object]], bool]


# --- the inbox: what other threads report ----------------------------------------------------------
@dataclass(frozen=True)
class KvCommitted:
    """Receiving side: every byte of the transfer was written and verified. `token_ids`: the
    sender's output tokens, which the commit carries (empty from a sender that sends none)."""

    transfer_id: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KvWriteFailed:
    """Receiving side: the transfer into this reservation failed."""

    transfer_id: str
    failure: TransferFailure


@dataclass(frozen=True)
class PushReported:
    """Sending side: a push returned (failure None: acknowledged by the receiver)."""

    request_id: str
    failure: TransferFailure | None


InboxMessage = KvCommitted | KvWriteFailed | PushReported


# --- per-request state --------------------------------------------------------------------------------
class ReservedBlocks:
    """Receiving side: the blocks reserved for one incoming transfer. Guarded by `lock`, which a
    transfer thread holds while it writes, so the engine never frees blocks mid-write."""

    def __init__(
        self,
        transfer_id: str,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        expires_at_s: float,
        known_tokens: tuple[int, ...] = (),
        token_with_kv: bool = False,
    ):
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.block_ids = block_ids
        self.num_tokens = num_tokens
        self.expires_at_s = expires_at_s
        # The request's output tokens when it was reserved, and whether the commit must bring the
        # next one (an early reservation): a commit's tokens are checked against them.
        self.known_tokens = known_tokens
        self.token_with_kv = token_with_kv
        self.lock = threading.Lock()
        self.live = True  # false once expired, failed, cancelled or finished
        self.committed = False


@dataclass
class RequestHandover:
    """One request's hand-over state (a request uses one side only)."""

    reservation: ReservedBlocks | None = None  # receiving side
    lease_deadline_s: float | None = None  # sending side, once its context is done
    pushes_in_flight: int = 0
    # An abort or release that came while a push was reading the blocks: it takes effect (and the
    # blocks are freed) when the push returns, never under a reader's feet.
    deferred_end: EndRequest | None = None


class Expiry(enum.Enum):
    RESERVATION = "reservation"  # receiving side: no KV committed in time
    LEASE = "lease"  # sending side: nobody took the KV in time


class EndTiming(enum.Enum):
    NOW = "now"  # no push in flight: end the request now
    DEFERRED = "deferred"  # a push is in flight: the end runs when the last one returns
    ALREADY_DEFERRED = "already deferred"  # an earlier end waits already; this one is dropped


class Unpinned(enum.Enum):
    REPORT = "report"  # no end waits: act on the push's result
    END = "end"  # the last push returned: run the deferred end now
    WAIT = "wait"  # an end waits for pushes still in flight


class Handover:
    """The reservations by transfer id, the notices for the router, the inbox, and the transitions
    of `RequestHandover` values."""

    def __init__(
        self,
        layout: KvLayout,
        *,
        reservation_timeout_s: float,
        sender_lease_s: float,
        on_inbox: Callable[[], None] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.layout = layout
        self.vocab_size = vocab_size  # bounds the token ids a commit may carry
        self._reservation_timeout_s = reservation_timeout_s
        self._sender_lease_s = sender_lease_s
        self._by_transfer: dict[str, ReservedBlocks] = {}
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._on_inbox = on_inbox  # wakes an idle step loop when another thread posts
        self._new_reservations: list[Reservation] = []

    # --- receiving side ------------------------------------------------------------------------------
    def reserve(
        self,
        state: RequestHandover,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        now: float,
        *,
        known_tokens: tuple[int, ...] = (),
        token_with_kv: bool = False,
    ) -> ReservedBlocks:
        """Register blocks the scheduler reserved for a request's incoming KV, under a new transfer id."""
        reservation = ReservedBlocks(
            new_transfer_id(), request_id, block_ids, num_tokens, now + self._reservation_timeout_s, known_tokens, token_with_kv
        )
        state.reservation = reservation
        with self._lock:
            self._by_transfer[reservation.transfer_id] = reservation
        self._new_reservations.append(self._notice(reservation))
        return reservation

    def reservation_of(self, state: RequestHandover) -> Reservation | None:
        """The request's live reservation, as the value the router is told."""
        reservation = state.reservation
        if reservation is None or not reservation.live:
            return None
        return self._notice(reservation)

    def _notice(self, r: ReservedBlocks) -> Reservation:
        return Reservation(
            r.request_id, r.transfer_id, len(r.block_ids), r.num_tokens, self.layout, r.expires_at_s, self._reservation_timeout_s
        )

    def renew(self, state: RequestHandover, now: float) -> bool:
        """Extend a live, uncommitted reservation by its timeout from `now` (an early reservation
        whose prefill is still running); False if there is nothing to renew."""
        reservation = state.reservation
        if reservation is None:
            return False
        with reservation.lock:
            if not reservation.live or reservation.committed:
                return False
            reservation.expires_at_s = max(reservation.expires_at_s, now + self._reservation_timeout_s)
        return True

    def drain_new_reservations(self) -> list[Reservation]:
        """Reservations made since the last call (the router hands their transfer ids to senders)."""
        made, self._new_reservations = self._new_reservations, []
        return made

    def open(
        self, transfer_id: str, request_id: str, peer_layout: KvLayout, import_blocks: ImportBlocks,
        fill_blocks: FillBlocks | None = None,
    ) -> TransferTarget:
        """Any thread (TransferSink.open): the reserved blocks behind `transfer_id`."""
        with self._lock:
            reservation = self._by_transfer.get(transfer_id)
        if reservation is None:
            raise TransferRejected(FailureReason.UNKNOWN_TRANSFER, "no reservation has this transfer id")
        if reservation.request_id != request_id:
            raise TransferRejected(FailureReason.UNKNOWN_TRANSFER, "the transfer id belongs to another request")
        problem = self.layout.incompatibility(peer_layout)
        if problem is not None:
            raise TransferRejected(FailureReason.INCOMPATIBLE, problem)
        with reservation.lock:
            if not reservation.live:
                raise TransferRejected(FailureReason.RESERVATION_EXPIRED, "the reservation is no longer live")
            if reservation.committed:
                raise TransferRejected(FailureReason.PROTOCOL_ERROR, "the transfer was already committed")
        return TransferTarget(reservation, self.layout, import_blocks, self.post, self.vocab_size, fill_blocks)

    def commit(self, transfer_id: str) -> ReservedBlocks | None:
        """The KV behind `transfer_id` committed: forget the transfer id (None if it is gone already)."""
        with self._lock:
            return self._by_transfer.pop(transfer_id, None)

    @staticmethod
    def settle(state: RequestHandover, reservation: ReservedBlocks) -> bool:
        """Whether a committed `reservation` is still the request's own; if so the request holds the
        KV from now on and no reservation."""
        if state.reservation is not reservation:
            return False
        state.reservation = None
        return True

    def find(self, transfer_id: str) -> ReservedBlocks | None:
        with self._lock:
            return self._by_transfer.get(transfer_id)

    @staticmethod
    def invalidate(reservation: ReservedBlocks) -> None:
        """No more writes into `reservation` (waits for a write in progress)."""
        with reservation.lock:
            reservation.live = False

    def cancel(self, state: RequestHandover) -> None:
        """An abort: the request's reservation, if any, takes no more writes."""
        if state.reservation is not None:
            self.invalidate(state.reservation)

    def forget(self, state: RequestHandover) -> None:
        """The request ended: drop its reservation."""
        if state.reservation is not None:
            with self._lock:
                self._by_transfer.pop(state.reservation.transfer_id, None)
            state.reservation = None

    # --- sending side --------------------------------------------------------------------------------
    def start_lease(self, state: RequestHandover, now: float) -> None:
        """The request's context is done: it holds its blocks for a push until the lease runs out."""
        state.lease_deadline_s = now + self._sender_lease_s

    @staticmethod
    def pin(state: RequestHandover) -> None:
        """A push starts reading the request's blocks."""
        state.pushes_in_flight += 1

    @staticmethod
    def unpin(state: RequestHandover) -> Unpinned:
        """A push returned."""
        state.pushes_in_flight = max(0, state.pushes_in_flight - 1)
        if state.deferred_end is None:
            return Unpinned.REPORT
        return Unpinned.END if state.pushes_in_flight == 0 else Unpinned.WAIT

    @staticmethod
    def defer_end(state: RequestHandover, end: EndRequest) -> EndTiming:
        """When an abort, a release or an acknowledged push may end the request: now, or once the
        pushes in flight return."""
        if state.pushes_in_flight == 0:
            return EndTiming.NOW
        if state.deferred_end is not None:
            return EndTiming.ALREADY_DEFERRED
        state.deferred_end = end
        return EndTiming.DEFERRED

    # --- both sides ----------------------------------------------------------------------------------
    @staticmethod
    def expired(state: RequestHandover, now: float, *, waiting_to_send: bool) -> Expiry | None:
        """Whether the request's reservation or lease ran out at `now` (an expired reservation takes
        no more writes). `waiting_to_send`: the request is in DISAGG_CONTEXT_TRANS_IN_PROGRESS."""
        reservation = state.reservation
        if reservation is not None and now >= reservation.expires_at_s:
            with reservation.lock:
                expired = reservation.live and not reservation.committed
                if expired:
                    reservation.live = False
            return Expiry.RESERVATION if expired else None
        if (
            state.lease_deadline_s is not None
            and now >= state.lease_deadline_s
            and state.pushes_in_flight == 0
            and waiting_to_send
        ):
            return Expiry.LEASE
        return None

    # --- the inbox -----------------------------------------------------------------------------------
    def post(self, message: InboxMessage) -> None:
        """Any thread: queue a report for the engine thread and wake it."""
        self._inbox.put(message)
        if self._on_inbox is not None:
            self._on_inbox()

    def has_mail(self) -> bool:
        return not self._inbox.empty()

    def inbox(self) -> Iterator[InboxMessage]:
        """The reports posted so far, and any posted while they are handled."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return


class TransferTarget:
    """TransferTarget over a reservation (any thread): writes go straight into the reserved cache
    blocks, under the reservation's lock (a TransferViewsTarget when it can fill blocks in place)."""

    def __init__(self, reservation: ReservedBlocks, layout: KvLayout, import_blocks: ImportBlocks,
                 post: Callable[[InboxMessage], None], vocab_size: int | None = None,
                 fill_blocks: FillBlocks | None = None) -> None:
        self._reservation = reservation
        self._vocab_size = vocab_size
        self._import_blocks = import_blocks
        self._fill_blocks = fill_blocks
        self._post = post
        self.num_blocks = len(reservation.block_ids)
        self.layout = layout

    @contextlib.contextmanager
    def _writing(self, layer_start: int, layer_end: int, block_start: int, block_end: int) -> Iterator[list[int]]:
        """The cache block ids of a range, under the reservation's lock while it is live and not
        committed (the engine cannot free them meanwhile); the refusals of `write` and `fill`."""
        if not (0 <= block_start < block_end <= self.num_blocks and 0 <= layer_start < layer_end <= self.layout.num_layers):
            raise TransferRejected(FailureReason.PROTOCOL_ERROR, "range outside the reservation")
        reservation = self._reservation
        with reservation.lock:
            if not reservation.live or reservation.committed:
                raise TransferRejected(FailureReason.RESERVATION_EXPIRED, "the reservation is no longer live")
            yield reservation.block_ids[block_start:block_end]

    def write(self, layer_start: int, layer_end: int, block_start: int, block_end: int, data: memoryview) -> None:
        with self._writing(layer_start, layer_end, block_start, block_end) as block_ids:
            self._import_blocks(block_ids, layer_start, layer_end, data)

    def fill(
        self, layer_start: int, layer_end: int, block_start: int, block_end: int, copy: Callable[[list[memoryview]], object]
    ) -> bool:
        """TransferViewsTarget.fill: `copy` writes into the reserved blocks themselves, under the
        reservation's lock as `write` does."""
        if self._fill_blocks is None:
            return False
        with self._writing(layer_start, layer_end, block_start, block_end) as block_ids:
            return self._fill_blocks(block_ids, layer_start, layer_end, copy)

    def commit(self, token_ids: tuple[int, ...] = ()) -> None:
        reservation = self._reservation
        token_ids = tuple(token_ids)
        problem = _token_mismatch(reservation, token_ids, self._vocab_size)
        if problem is not None:
            raise TransferRejected(FailureReason.PROTOCOL_ERROR, problem)
        with reservation.lock:
            if not reservation.live:
                raise TransferRejected(FailureReason.RESERVATION_EXPIRED, "the reservation is no longer live")
            reservation.committed = True
        self._post(KvCommitted(reservation.transfer_id, tuple(token_ids)))

    def fail(self, failure: TransferFailure) -> None:
        self._post(KvWriteFailed(self._reservation.transfer_id, failure))


def _token_mismatch(reservation: ReservedBlocks, token_ids: tuple[int, ...], vocab_size: int | None) -> str | None:
    """Why a commit's tokens do not fit the reservation (None: they do). An early reservation needs
    the tokens it knew plus exactly one more; a late one, none or exactly the tokens it knew."""
    known = reservation.known_tokens
    if vocab_size is not None and any(not 0 <= token < vocab_size for token in token_ids):
        return f"the commit carries a token id outside [0, {vocab_size})"
    if reservation.token_with_kv:
        if len(token_ids) != len(known) + 1 or token_ids[: len(known)] != known:
            return f"the commit must carry the request's {len(known)} known output tokens and the next one, got {len(token_ids)}"
        return None
    if token_ids and token_ids != known:
        return "the commit's output tokens differ from the request's"
    return None
