"""The prefill side's TransferSource over a request's paged KV blocks (worker/engine.py makes them,
the KV sender reads them on its push threads)."""

from __future__ import annotations

import threading

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
