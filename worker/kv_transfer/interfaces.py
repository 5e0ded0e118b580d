"""What the engines implement (sink, target, source) and what a push returns.

Threading: the transport calls `TransferTarget.write` from several threads at once (one per Push
stream), always for disjoint (layer, block) ranges, and `TransferSource.read` likewise. `commit` and
`fail` are called at most once per target, and never both; after either, no more writes come.

Block indices in every range are positions in the request's own block list (0 .. num_blocks-1),
not cache block ids: each side maps them onto its cache's block ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import TransferFailure


@runtime_checkable
class TransferTarget(Protocol):
    """The receiver's reserved blocks of one request."""

    num_blocks: int
    layout: KvLayout

    def write(self, layer_start: int, layer_end: int, block_start: int, block_end: int, data: memoryview) -> None:
        """Store verified bytes laid out as [layer_end-layer_start, 2, block_end-block_start, T, H, D].

        `data` is only valid during the call. Raise TransferRejected to fail the transfer."""
        ...

    def commit(self, token_ids: tuple[int, ...] = ()) -> None:
        """Every byte arrived and was verified: the blocks become usable. `token_ids`: the sending
        request's output tokens, which the commit carries (raise TransferRejected to refuse them)."""
        ...

    def fail(self, failure: TransferFailure) -> None:
        """The transfer failed: the reservation's contents must never be read."""
        ...


@runtime_checkable
class TransferViewsTarget(TransferTarget, Protocol):
    """A TransferTarget that lets the receiver write a range straight into its storage. On the
    shared-memory plane the receiver then copies a chunk from the segment into that storage and
    verifies the checksum on the stored copy, instead of copying out, verifying and calling `write`
    (one pass over the bytes fewer). Bytes that fail the check stay in blocks the failed transfer
    reserved, which are never read."""

    def fill(
        self, layer_start: int, layer_end: int, block_start: int, block_end: int, copy: Callable[[Sequence[memoryview]], object]
    ) -> bool:
        """Call `copy` with writable buffers whose concatenation is the range in `write`'s layout,
        while they are the reservation's (the target holds whatever keeps them so until `copy`
        returns), and return True; False, without calling it: no such buffers for this range (use
        `write`). Filling them is this range's write: the same threading and ordering rules apply,
        and the same refusals (TransferRejected)."""
        ...


@runtime_checkable
class TransferSink(Protocol):
    """The receiver side of the engine: turns a transfer id into the blocks reserved for it."""

    def open(self, transfer_id: str, request_id: str, peer_layout: KvLayout) -> TransferTarget:
        """Return the target reserved under `transfer_id`; raise TransferRejected(code, detail) to refuse
        (UNKNOWN_TRANSFER for an id it never issued, RESERVATION_EXPIRED, RESOURCE_EXHAUSTED, ...)."""
        ...


@runtime_checkable
class TransferSource(Protocol):
    """The sender side of the engine: a request's computed KV blocks."""

    layout: KvLayout
    num_blocks: int

    def read(self, layer_start: int, layer_end: int, block_start: int, block_end: int) -> memoryview | bytes:
        """The bytes of a range, laid out as [layer_end-layer_start, 2, block_end-block_start, T, H, D].

        A returned memoryview must stay valid and unchanged until the push returns."""
        ...


@runtime_checkable
class StreamingTransferSource(TransferSource, Protocol):
    """A TransferSource whose blocks become final over time (a chunked prefill still computing): the
    sender pushes each part as soon as it is final, then commits. Blocks are final in order."""

    def wait_ready(self, have_blocks: int, timeout_s: float) -> int:
        """How many leading blocks are final, once more than `have_blocks` are (`num_blocks`: all);
        `have_blocks` if `timeout_s` passed first; -1 if the source was given up (the request
        ended: nothing more will come, and the push must fail)."""
        ...


@runtime_checkable
class TransferPartsSource(TransferSource, Protocol):
    """A TransferSource that can also hand out a range as several buffers without gathering them (a
    range that is not contiguous in its storage). The sender then builds each chunk's message from
    the parts with a single copy instead of two (gRPC Python takes a message only as one `bytes`)."""

    def read_parts(
        self, layer_start: int, layer_end: int, block_start: int, block_end: int
    ) -> Sequence[memoryview | bytes]:
        """Buffers whose concatenation is exactly what `read` returns for the range, under the same
        validity rules."""
        ...


@dataclass(frozen=True)
class TransferOutcome:
    """The result of one push. `failure` is None exactly when the receiver acknowledged the commit."""

    transfer_id: str
    request_id: str
    failure: TransferFailure | None
    bytes_sent: int
    chunks_sent: int
    num_streams: int
    elapsed_s: float
    data_plane: str = "grpc"
    """What carried the bytes: "grpc" or "shm" (a data plane name of worker/kv_transfer/config.py)."""

    @property
    def ok(self) -> bool:
        return self.failure is None
