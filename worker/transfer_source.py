"""The prefill side's TransferSource over a request's paged KV blocks (worker/engine.py makes them,
the KV sender reads them on its push threads)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from worker.kv_cache import PagedKvCache
from worker.kv_layout import KvLayout


class EngineTransferSource:
    """TransferSource over a request's blocks on the prefill side. A streaming one
    (StreamingTransferSource) starts with the blocks of the finished chunks of a context still
    computing: the engine thread advances it, finishes it (every block final, the output tokens
    known) or cancels it, and the push thread waits on it."""

    def __init__(self, cache: PagedKvCache, layout: KvLayout, block_ids: list[int], *, ready_blocks: int | None = None) -> None:
        self._cache = cache
        self._block_ids = block_ids
        self.layout = layout
        self.num_blocks = len(block_ids)
        self.output_token_ids: tuple[int, ...] = ()
        self._ready = threading.Condition()
        self._ready_blocks = self.num_blocks if ready_blocks is None else ready_blocks
        self._cancelled = False

    def advance(self, ready_blocks: int) -> None:
        with self._ready:
            self._ready_blocks = max(self._ready_blocks, min(ready_blocks, self.num_blocks))
            self._ready.notify_all()

    def finish(self, output_token_ids: tuple[int, ...]) -> None:
        with self._ready:
            self.output_token_ids = output_token_ids
            self._ready_blocks = self.num_blocks
            self._ready.notify_all()

    def cancel(self) -> None:
        with self._ready:
            self._cancelled = True
            self._ready.notify_all()

    def wait_ready(self, have_blocks: int, timeout_s: float) -> int:
        with self._ready:
            self._ready.wait_for(lambda: self._cancelled or self._ready_blocks > have_blocks, timeout=timeout_s)
            return -1 if self._cancelled else self._ready_blocks

    def read(self, layer_start: int, layer_end: int, block_start: int, block_end: int) -> memoryview:
        with torch.inference_mode():
            flat = self._cache.export_uint8(self._block_ids[block_start:block_end], layer_start, layer_end)
        return memoryview(flat.numpy())

    def read_parts(self, layer_start: int, layer_end: int, block_start: int, block_end: int) -> Sequence[memoryview]:
        """The range as views of the cache itself, one per layer, K or V and run of consecutive block
        ids ([layers, 2, blocks, ...] is the order `read` gathers them in): the sender copies them
        straight into its message or shared-memory segment, one copy of the bytes instead of two.
        Valid while the push runs (the engine pins the request's blocks until it returns, as for
        `read`). A cache off the CPU, or blocks in many runs, is gathered by `read` instead."""
        views = self._cache.run_views(self._block_ids[block_start:block_end], layer_start, layer_end)
        if views is None:
            return (self.read(layer_start, layer_end, block_start, block_end),)
        return [memoryview(view) for view in views]
