"""One push's shared-memory segment, on the sending side (worker/kv_transfer/sender.py).

On the shared-memory plane a push takes a segment from the sender's pool (worker/kv_transfer/shm.py)
for its whole KV, offers it at Prepare with a random probe in it, gives each chunk it plans a place
in it, and its stream threads write the chunks there; the chunk messages carry only the offset.
The segment goes back to the pool when the push ends, but only once no stream thread is writing
into it: writers register under the condition's lock and check there that the push has not ended,
and the push's end (`ended`) is set before the release.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence

from duet_wire.v1 import kv_transfer_pb2 as pb
from worker.kv_layout import KvLayout
from worker.kv_transfer import codec
from worker.kv_transfer.plan import ChunkSpec
from worker.kv_transfer.shm import PROBE_BYTES, Segment, SegmentPool


class PushSegment:
    """The segment of one push while it is offered or in use (none before `offer`, none after
    `release`). Thread-safe: stream threads write while the push's own thread plans and releases."""

    def __init__(self, ended: threading.Event) -> None:
        self._ended = ended  # the push has ended: no write may start any more
        self._cond = threading.Condition()
        self._writers = 0
        self._segment: Segment | None = None
        self._pool: SegmentPool | None = None
        self._offsets: dict[int, int] = {}  # chunk sequence -> byte offset in the segment
        self._next_offset = 0  # where the next chunk planned goes

    def offer(self, pool: SegmentPool, size_bytes: int) -> pb.KvShmOffer:
        """Take a segment of `size_bytes` from `pool` and write the probe the receiver must read
        back; raises ShmError when shared memory cannot hold it."""
        segment = pool.acquire(size_bytes)
        probe = secrets.token_bytes(PROBE_BYTES)
        segment.write(0, (probe,))
        with self._cond:
            self._segment, self._pool = segment, pool
        return pb.KvShmOffer(segment=segment.name, probe_offset=0, probe=probe)

    def place(self, chunks: Sequence[ChunkSpec], layout: KvLayout) -> None:
        """Give each chunk planned its place, after the ones planned before (the segment is sized for
        the whole KV)."""
        for spec in chunks:
            self._offsets[spec.sequence] = self._next_offset
            self._next_offset += spec.size_bytes(layout)

    def offset(self, sequence: int) -> int:
        return self._offsets[sequence]

    def write(
        self, offset: int, parts: Sequence[memoryview | bytes | bytearray], size_bytes: int, checksum_algorithm: int, *, corrupt: bool
    ) -> int | None:
        """Place a chunk's bytes at `offset` and return their checksum, taken from the segment right
        after the copy (the bytes are then in cache: one read of the source instead of two); None when
        the push has ended or holds no segment. `corrupt` (fault injection) damages the bytes after
        the checksum. A failure of the copy raises."""
        with self._cond:
            segment = self._segment
            if segment is None or self._ended.is_set():
                return None
            self._writers += 1
        try:
            segment.write(offset, parts)
            placed = segment.array[offset : offset + size_bytes]
            data_checksum = codec.checksum(placed, checksum_algorithm)
            if corrupt:
                placed[size_bytes // 2] ^= 0xFF
            return data_checksum
        finally:
            with self._cond:
                self._writers -= 1
                self._cond.notify_all()

    def release(self) -> None:
        """Back to the pool, once no stream thread writes it (no-op without a segment)."""
        with self._cond:
            segment, self._segment = self._segment, None
            pool = self._pool
            self._cond.wait_for(lambda: self._writers == 0)
        if segment is not None and pool is not None:
            pool.release(segment)
