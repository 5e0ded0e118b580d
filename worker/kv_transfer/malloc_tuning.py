"""glibc malloc settings for processes that move KV through gRPC (an explicit, process-wide opt-in).

Every chunk passes through several multi-MiB buffers (gRPC's message copy, the Python bytes of the
received message). With glibc's defaults each gRPC thread gets its own malloc arena whose heap
grows and shrinks around those buffers (mprotect plus a page fault per 4 KiB page on every chunk),
and large blocks come from fresh mmap'd memory. Measured with bench/transfer_bench.py on the
development machine: the receiver's system time fell from about 1.7-2.2 to about 0.6 CPU-seconds
per GiB, with one arena and a high mmap/trim threshold.

Call `tune_malloc_for_transfers()` once, early in the worker process (before gRPC servers or
channels start threads). It changes allocation for the whole process, which is why it is not done
implicitly by the transport. The environment variable
`GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456`
does the same for a process started with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# The largest mmap threshold glibc accepts on 64-bit systems (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20


@dataclass(frozen=True)
class MallocTuning:
    applied: bool
    detail: str


def tune_malloc_for_transfers(*, arena_max: int = 1) -> MallocTuning:
    """Apply the settings if this is glibc; a no-op (applied=False) elsewhere."""
    if not sys.platform.startswith("linux"):
        return MallocTuning(False, f"not glibc ({sys.platform})")
    name = ctypes.util.find_library("c")
    if name is None:
        return MallocTuning(False, "libc not found")
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return MallocTuning(False, "libc has no mallopt (not glibc)")
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    results = {
        "arena_max": mallopt(_M_ARENA_MAX, arena_max),
        "mmap_threshold": mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        "trim_threshold": mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
    }
    refused = sorted(key for key, ok in results.items() if ok != 1)
    if refused:
        logger.warning("mallopt refused %s", refused)
        return MallocTuning(False, f"mallopt refused {refused}")
    logger.info("malloc tuned for bulk transfers: arena_max=%d, mmap/trim thresholds %d/%d bytes",
                arena_max, MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)
    return MallocTuning(True, f"arena_max={arena_max}, mmap_threshold={MMAP_THRESHOLD_BYTES}, trim_threshold={TRIM_THRESHOLD_BYTES}")
