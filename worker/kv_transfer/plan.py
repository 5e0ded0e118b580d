"""How a request's KV is cut into chunks and spread over parallel streams.

A chunk is a rectangle of (layer range) x (block range). Whole layers are preferred (when every
block of a layer fits in one chunk, a chunk holds as many whole layers as fit), because a run of
whole layers is contiguous in a request-linear buffer and can be sent without a gather copy;
otherwise each layer is split into near-equal block ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.kv_layout import KvLayout


class ChunkPlanError(ValueError):
    """The layout cannot be cut into chunks within the byte limit."""


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk: sequence number (unique in its transfer) and its layer and block ranges."""

    sequence: int
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_blocks(self) -> int:
        return self.block_end - self.block_start

    def size_bytes(self, layout: KvLayout) -> int:
        return layout.run_bytes(self.num_layers, self.num_blocks)


def _even_ranges(total: int, max_per_range: int) -> list[tuple[int, int]]:
    """Split [0, total) into the fewest near-equal ranges of at most max_per_range each."""
    count = -(-total // max_per_range)
    base, extra = divmod(total, count)
    ranges, start = [], 0
    for index in range(count):
        end = start + base + (1 if index < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def plan_chunks(
    layout: KvLayout, num_blocks: int, max_chunk_bytes: int, *, first_block: int = 0, first_sequence: int = 0
) -> tuple[ChunkSpec, ...]:
    """Cover every (layer, block) cell of [0, num_layers) x [first_block, first_block + num_blocks)
    exactly once, numbering the chunks from `first_sequence` (a push streamed in parts plans each
    part with the blocks and sequence numbers that follow the previous part's)."""
    if num_blocks <= 0:
        raise ChunkPlanError(f"num_blocks must be positive, got {num_blocks}")
    block_bytes = layout.block_bytes_per_layer
    if block_bytes > max_chunk_bytes:
        raise ChunkPlanError(
            f"one block of one layer is {block_bytes} bytes, more than the chunk limit of {max_chunk_bytes} bytes"
        )
    layer_bytes = num_blocks * block_bytes
    rectangles: list[tuple[int, int, int, int]] = []
    if layer_bytes <= max_chunk_bytes:
        for layer_start, layer_end in _even_ranges(layout.num_layers, max_chunk_bytes // layer_bytes):
            rectangles.append((layer_start, layer_end, 0, num_blocks))
    else:
        block_ranges = _even_ranges(num_blocks, max_chunk_bytes // block_bytes)
        for layer in range(layout.num_layers):
            for block_start, block_end in block_ranges:
                rectangles.append((layer, layer + 1, block_start, block_end))
    return tuple(
        ChunkSpec(first_sequence + sequence, layer_start, layer_end, first_block + block_start, first_block + block_end)
        for sequence, (layer_start, layer_end, block_start, block_end) in enumerate(rectangles)
    )


def assign_streams(chunks: tuple[ChunkSpec, ...], num_streams: int) -> tuple[tuple[ChunkSpec, ...], ...]:
    """Deal chunks round-robin onto at most num_streams non-empty streams (chunks are near-equal in size)."""
    if num_streams <= 0:
        raise ChunkPlanError(f"num_streams must be positive, got {num_streams}")
    used = min(num_streams, len(chunks))
    return tuple(chunks[index::used] for index in range(used))
