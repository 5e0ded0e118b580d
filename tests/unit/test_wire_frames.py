"""join_frame: the same bytes as b"".join for every kind of part, small and large frames alike."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest

from worker.kv_transfer import frames
from worker.kv_transfer.frames import MIN_GIL_FREE_BYTES, join_frame

RNG = random.Random(11)
BIG = bytearray(RNG.randbytes(3 * MIN_GIL_FREE_BYTES))


@pytest.mark.parametrize(
    "parts",
    [
        [b"\x0a\x03", b"abc"],  # small: the plain join
        [b"\x0a\x03", b"abc", b"\x12\x80\x80\x03", memoryview(BIG)],
        [memoryview(BIG)[: MIN_GIL_FREE_BYTES + 1], b"", memoryview(BIG)[-7:]],
        [bytes(BIG), memoryview(np.arange(4096, dtype=np.uint16))],  # a non-byte item size
        [memoryview(BIG)[::2]],  # not contiguous: the plain join handles (or refuses) it alike
    ],
    ids=["small", "header-and-view", "odd-sizes", "bytes-and-uint16", "strided"],
)
def test_join_frame_equals_join(parts) -> None:
    try:
        expected = b"".join(parts)
    except TypeError:
        with pytest.raises(TypeError):
            join_frame(parts)
        return
    frame = join_frame(parts)
    assert type(frame) is bytes
    assert frame == expected
    assert hash(frame) == hash(expected)


def test_large_frames_take_the_gil_free_path_on_cpython(monkeypatch) -> None:
    if sys.implementation.name != "cpython":
        pytest.skip("the GIL-free path is CPython's")
    assert frames._allocator() is not None
    calls = []
    real_copyto = np.copyto

    def counting_copyto(*args, **kwargs):
        calls.append(1)
        return real_copyto(*args, **kwargs)

    monkeypatch.setattr(frames.np, "copyto", counting_copyto)
    assert join_frame([b"h", memoryview(BIG)]) == b"h" + bytes(BIG)
    assert len(calls) == 2
    calls.clear()
    join_frame([b"h", b"small"])
    assert not calls
