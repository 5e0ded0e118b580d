"""Building a large wire frame without holding the GIL while its bytes are copied.

gRPC Python sends a message only as one `bytes` object, so the sender must copy each chunk's KV
into a fresh `bytes`. `b"".join` does that copy with the GIL held whenever a part is a view of
mutable memory (a KV cache or any bytearray), which serializes the chunk copies of parallel
streams with each other and with gRPC's own work in the process. Here the frame is allocated
uninitialized (`PyBytes_FromStringAndSize(NULL, n)`, the way C extensions make a bytes object they
are about to fill) and filled with numpy copies, which release the GIL. The object is not shared
with anything until it is returned, so it is never seen half-filled or mutated after publication.

CPython only (the data offset of a bytes object is an implementation detail, checked on first
use); elsewhere, or for small frames, it falls back to `b"".join`.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable, Sequence

import numpy as np

Buffer = bytes | bytearray | memoryview

# Below this, the fixed cost of the numpy views outweighs the GIL-free copy.
MIN_GIL_FREE_BYTES = 256 * 1024


@functools.cache
def _allocator() -> tuple[Callable[[None, int], bytes], int] | None:
    """(an uninitialized-bytes constructor, the data offset in a bytes object), or None where the
    layout is not CPython's. A private function object: ctypes.pythonapi's shared one is left alone."""
    if platform.python_implementation() != "CPython":
        return None
    prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)
    new_bytes = prototype(("PyBytes_FromStringAndSize", ctypes.pythonapi))
    # A bytes object's data starts at the last byte of its fixed part (ob_sval[1]).
    offset = bytes.__basicsize__ - 1
    sample = b"duet-frames-probe"
    if ctypes.string_at(id(sample) + offset, len(sample)) != sample:
        return None
    return new_bytes, offset


def _writable(frame: bytes, size: int, offset: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * size).from_address(id(frame) + offset), dtype=np.uint8)


def join_frame(parts: Sequence[Buffer]) -> bytes:
    """The concatenation of `parts` (contiguous buffers) as a new bytes object; the bulk of it copied
    with the GIL released."""
    views = [memoryview(part) for part in parts]
    size = sum(view.nbytes for view in views)
    allocator = _allocator()
    if allocator is None or size < MIN_GIL_FREE_BYTES or not all(view.c_contiguous for view in views):
        return b"".join(parts)
    new_bytes, offset = allocator
    frame = new_bytes(None, size)
    target = _writable(frame, size, offset)
    position = 0
    for view in views:
        source = np.frombuffer(view, dtype=np.uint8)
        end = position + source.size
        np.copyto(target[position:end], source)
        position = end
    return frame
