"""Building a large wire frame without holding the GIL while its bytes are copied.

gRPC Python sends a message only as one `bytes` object, so the sender must copy each chunk's KV
into a fresh `bytes`. `b"".join` does that copy with the GIL held whenever a part is a view of
mutable memory (a KV cache or any bytearray), which serializes the chunk copies of parallel
streams with each other and with gRPC's own work in the process. Here the frame is allocated
uninitialized (`PyBytes_FromStringAndSize(NULL, n)`, the way C extensions make a bytes object they
are about to fill) and filled with numpy copies, which release the GIL. The object is not shared
with anything until it is returned, so it is never seen half-filled or mutated after publication.

CPython only (the data offset of a bytes object is an implementation detail, checked once at
import); elsewhere, or for small frames, it falls back to `b"".join`.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Sequence

import numpy as np

Buffer = bytes | bytearray | memoryview

# Below this, the fixed cost of the numpy views outweighs the GIL-free copy.
MIN_GIL_FREE_BYTES = 256 * 1024


def _probe() -> tuple[object, int] | None:
    if platform.python_implementation() != "CPython":
        return None
    new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    new_bytes.restype = ctypes.py_object
    new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    # A bytes object's data starts at the last byte of its fixed part (ob_sval[1]).
    offset = bytes.__basicsize__ - 1
    sample = b"duet-frames-probe"
    if ctypes.string_at(id(sample) + offset, len(sample)) != sample:
        return None
    return new_bytes, offset


_ALLOCATOR = _probe()


def _writable(frame: bytes, size: int) -> np.ndarray:
    assert _ALLOCATOR is not None
    address = id(frame) + _ALLOCATOR[1]
    return np.frombuffer((ctypes.c_char * size).from_address(address), dtype=np.uint8)


def join_frame(parts: Sequence[Buffer]) -> bytes:
    """The concatenation of `parts` (contiguous buffers) as a new bytes object; the bulk of it copied
    with the GIL released."""
    views = [memoryview(part) for part in parts]
    size = sum(view.nbytes for view in views)
    if _ALLOCATOR is None or size < MIN_GIL_FREE_BYTES or not all(view.c_contiguous for view in views):
        return b"".join(parts)
    frame = _ALLOCATOR[0](None, size)
    target = _writable(frame, size)
    position = 0
    for view in views:
        source = np.frombuffer(view, dtype=np.uint8)
        end = position + source.size
        np.copyto(target[position:end], source)
        position = end
    return frame
