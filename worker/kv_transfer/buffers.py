"""A request's KV held contiguously in host memory, usable as a TransferSource and as the storage
of a TransferTarget (tests, benches, and engines that stage KV through host memory).

The buffer is laid out as [num_layers, 2, num_blocks, T, H, D] (worker/kv_layout.py for one
request's blocks in order). A range covering every block of a run of layers is contiguous and is
read without a copy; any other range consists of one row per (layer, K|V), which `read` gathers
into one bytes object and `read_parts` hands out as views (the sender builds its frame from those
views directly, saving a copy of every chunk). Writes copy with numpy, which releases the GIL (a
memoryview slice assignment holds it), so the receiver's streams and gRPC's own threads copy in
parallel, as they do into an engine's torch cache.
"""

from __future__ import annotations

import numpy as np

from worker.kv_layout import KvLayout


class BufferRangeError(ValueError):
    """A layer or block range outside the buffer, or data of the wrong length."""


class LinearKvBuffer:
    def __init__(self, layout: KvLayout, num_blocks: int, storage: bytearray | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise BufferRangeError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        size_bytes = layout.run_bytes(layout.num_layers, num_blocks)
        if storage is None:
            storage = bytearray(size_bytes)
        elif len(storage) != size_bytes:
            raise BufferRangeError(f"storage holds {len(storage)} bytes, the layout needs {size_bytes}")
        self.layout = layout
        self.num_blocks = num_blocks
        self._storage = storage
        self._view = memoryview(storage)
        self._array = np.frombuffer(storage, dtype=np.uint8)
        # Bytes of one block's K (or V) in one layer.
        self._half_block_bytes = layout.block_bytes_per_layer // 2

    @property
    def view(self) -> memoryview:
        return self._view

    @property
    def size_bytes(self) -> int:
        return len(self._storage)

    def _rows(self, layer_start: int, layer_end: int, block_start: int, block_end: int):
        if not (0 <= layer_start < layer_end <= self.layout.num_layers and 0 <= block_start < block_end <= self.num_blocks):
            raise BufferRangeError(
                f"range layers [{layer_start}, {layer_end}) x blocks [{block_start}, {block_end}) outside "
                f"[0, {self.layout.num_layers}) x [0, {self.num_blocks})"
            )
        row_bytes = (block_end - block_start) * self._half_block_bytes
        for layer in range(layer_start, layer_end):
            for kv in (0, 1):
                offset = ((layer * 2 + kv) * self.num_blocks + block_start) * self._half_block_bytes
                yield offset, row_bytes

    def read(self, layer_start: int, layer_end: int, block_start: int, block_end: int) -> memoryview | bytes:
        parts = self.read_parts(layer_start, layer_end, block_start, block_end)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_parts(self, layer_start: int, layer_end: int, block_start: int, block_end: int) -> tuple[memoryview, ...]:
        """Views (no copies) whose concatenation is the range: one for a run of whole layers, else one
        per (layer, K|V) row."""
        if block_start == 0 and block_end == self.num_blocks and 0 <= layer_start < layer_end <= self.layout.num_layers:
            layer_bytes = self.layout.run_bytes(1, self.num_blocks)
            return (self._view[layer_start * layer_bytes : layer_end * layer_bytes],)
        return tuple(
            self._view[offset : offset + length] for offset, length in self._rows(layer_start, layer_end, block_start, block_end)
        )

    def write(self, layer_start: int, layer_end: int, block_start: int, block_end: int, data: memoryview | bytes) -> None:
        expected = self.layout.run_bytes(layer_end - layer_start, block_end - block_start)
        if len(data) != expected:
            raise BufferRangeError(f"data holds {len(data)} bytes, the range needs {expected}")
        source = np.frombuffer(data, dtype=np.uint8)
        target = self._array
        if block_start == 0 and block_end == self.num_blocks and 0 <= layer_start < layer_end <= self.layout.num_layers:
            layer_bytes = self.layout.run_bytes(1, self.num_blocks)
            np.copyto(target[layer_start * layer_bytes : layer_end * layer_bytes], source)
            return
        position = 0
        for offset, length in self._rows(layer_start, layer_end, block_start, block_end):
            np.copyto(target[offset : offset + length], source[position : position + length])
            position += length
