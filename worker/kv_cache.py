"""The paged KV cache: one tensor laid out exactly as worker/kv_layout.py describes.

Shape [num_layers, 2 (K, V), num_blocks, tokens_per_block, num_kv_heads, head_dim]. Block ids come
from the scheduler's block manager; this class never decides which block belongs to whom, it only
stores, exports and imports bytes by id. The cache starts zeroed: attention reads padding slots of
partially filled blocks (masked out, but multiplied by zero probabilities), which must stay finite.

Every block carries a write version, bumped by every write (the model runner's, `import_blocks`):
copies of blocks kept elsewhere (the runner's decode mirror) compare versions to know they are
current. Whoever writes `tensor` directly must call `note_written` for the blocks it touched.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence

import numpy as np
import torch

from worker.device import DTYPE_BY_NAME
from worker.kv_layout import KvLayout

logger = logging.getLogger(__name__)

KvBytes = bytes | bytearray | memoryview


# A range whose blocks fall in at most this many runs of consecutive ids (freshly allocated blocks
# mostly do) is read and written through views of the cache, one per layer, K or V and run
# (run_views); beyond it, each view is a small copy call and one indexed gather or scatter is cheaper.
MAX_VIEW_RUNS = 4


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive ids covering `block_ids` in order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], block_id + 1)
        else:
            runs.append((block_id, block_id + 1))
    return runs


class KvCacheError(ValueError):
    """A bad export/import request: block ids, layer range or byte length do not fit the cache."""


class PagedKvCache:
    def __init__(self, layout: KvLayout, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise KvCacheError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self._layout = layout
        self._num_blocks = num_blocks
        self._dtype = DTYPE_BY_NAME[layout.dtype]
        self._kv = torch.zeros(
            (layout.num_layers, 2, num_blocks, layout.tokens_per_block, layout.num_kv_heads, layout.head_dim),
            dtype=self._dtype,
            device=torch.device(device),
        )
        # Host-side metadata even for a CUDA cache: compared on the host every step.
        self._block_versions = torch.zeros(num_blocks, dtype=torch.int64)
        self._byte_array: np.ndarray | None = None  # byte_array(), made on first use
        logger.debug(
            "allocated KV cache: %d blocks x %d layers, %d bytes",
            num_blocks,
            layout.num_layers,
            self._kv.numel() * self._kv.element_size(),
        )

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def tokens_per_block(self) -> int:
        return self._layout.tokens_per_block

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._kv.device

    @property
    def tensor(self) -> torch.Tensor:
        """The whole cache tensor (the attention kernels index it directly)."""
        return self._kv

    @property
    def block_versions(self) -> torch.Tensor:
        """int64 [num_blocks] (CPU): a block's version changes whenever its contents may have changed."""
        return self._block_versions

    def note_written(self, block_ids: torch.Tensor | Sequence[int]) -> None:
        """Record that the blocks `block_ids` (duplicates allowed) were written."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1).cpu()
        self._block_versions.index_add_(0, ids, torch.ones_like(ids))

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as views [num_blocks, tokens_per_block, num_kv_heads, head_dim]."""
        return self._kv[layer, 0], self._kv[layer, 1]

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as views [num_blocks * tokens_per_block, num_kv_heads, head_dim]."""
        k, v = self.layer_blocks(layer)
        return k.flatten(0, 1), v.flatten(0, 1)

    def run_bytes(self, num_blocks: int, layer_start: int, layer_end: int) -> int:
        return self._layout.run_bytes(layer_end - layer_start, num_blocks)

    def export_blocks(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> torch.Tensor:
        """A contiguous copy [layer_end - layer_start, 2, len(block_ids), tpb, kv_heads, head_dim], cache dtype and device."""
        index = self._block_index(block_ids, unique=False)
        self._check_layers(layer_start, layer_end)
        return self._kv[layer_start:layer_end, :, index].contiguous()

    def byte_array(self) -> np.ndarray:
        """The whole cache as a uint8 numpy array over its storage (CPU only): [layers, 2, blocks,
        tpb, kv_heads, head_dim x element size]. Slicing it costs a fraction of slicing the tensor,
        which matters to a reader that takes many views per chunk (a push's parts)."""
        if self._byte_array is None:
            if self.device.type != "cpu":
                raise KvCacheError("byte_array: the cache is not on the CPU")
            self._byte_array = self._kv.view(torch.uint8).numpy()
        return self._byte_array

    def run_views(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> list[np.ndarray] | None:
        """The range as views of the cache's own bytes, in `export_blocks`' order ([layers, 2,
        blocks, ...]: one contiguous view per layer, K or V and run of consecutive block ids), or None
        when the cache is off the CPU or the ids fall in more than MAX_VIEW_RUNS runs. Checked as an
        export is; a view stays valid as long as the cache (what it shows is the blocks' current
        contents)."""
        self._block_index(block_ids, unique=False)
        self._check_layers(layer_start, layer_end)
        return self._views(block_ids, layer_start, layer_end)

    def _views(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> list[np.ndarray] | None:
        """`run_views` of ids and layers already checked."""
        runs = block_runs(block_ids)
        if self.device.type != "cpu" or len(runs) > MAX_VIEW_RUNS:
            return None
        cache = self.byte_array()  # bytes, so that bf16 needs no numpy dtype; numpy slices are cheap
        return [
            cache[layer, side, start:end].reshape(-1)
            for layer in range(layer_start, layer_end)
            for side in (0, 1)
            for start, end in runs
        ]

    def export_uint8(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> torch.Tensor:
        """The same bytes as a flat uint8 CPU tensor: `.numpy()` gives them without dtype conversion (bf16 too)."""
        return self.export_blocks(block_ids, layer_start, layer_end).cpu().view(-1).view(torch.uint8)

    def export_bytes(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> bytes:
        return self.export_uint8(block_ids, layer_start, layer_end).numpy().tobytes()

    def fill_blocks(
        self, block_ids: Sequence[int], layer_start: int, layer_end: int, fill: Callable[[list[memoryview]], object]
    ) -> bool:
        """Let `fill` write a run straight into `block_ids` (distinct ids) of layers [start, end): it is
        called with writable views of the cache whose concatenation is the run in `import_blocks`'
        layout (one per layer, K or V and run of consecutive ids), and the blocks count as written
        once it returns (True). False, without calling it: the cache is off the CPU or the ids fall
        in more than MAX_VIEW_RUNS runs (use `import_blocks`). Saves the copy into a buffer that
        `import_blocks` would copy again (the shared-memory plane's receiver)."""
        index = self._block_index(block_ids, unique=True)
        self._check_layers(layer_start, layer_end)
        return self._fill_views(index, layer_start, layer_end, lambda views: fill([memoryview(view) for view in views]))

    def _fill_views(
        self, index: torch.Tensor, layer_start: int, layer_end: int, fill: Callable[[list[np.ndarray]], object]
    ) -> bool:
        """`fill_blocks` and `import_blocks`' copy per view, for ids and layers already checked."""
        views = self._views(index.tolist(), layer_start, layer_end)
        if views is None:
            return False
        fill(views)
        self.note_written(index)
        return True

    def import_blocks(
        self,
        block_ids: Sequence[int],
        layer_start: int,
        layer_end: int,
        data: KvBytes | torch.Tensor,
    ) -> None:
        """Write a run exported by a compatible cache into `block_ids` (distinct ids) of layers [start, end)."""
        index = self._block_index(block_ids, unique=True)
        self._check_layers(layer_start, layer_end)
        if not isinstance(data, torch.Tensor):

            def copy(views: list[np.ndarray]) -> None:
                # A copy per view (torch's indexed assignment costs more than the bytes at these sizes).
                source = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
                expected_bytes = self.run_bytes(len(block_ids), layer_start, layer_end)
                if source.nbytes != expected_bytes:
                    raise KvCacheError(f"data is {source.nbytes} bytes, the run needs exactly {expected_bytes}")
                offset = 0
                for view in views:
                    view[:] = source[offset : offset + view.nbytes]
                    offset += view.nbytes

            if self._fill_views(index, layer_start, layer_end, copy):
                return
        shape = (
            layer_end - layer_start,
            2,
            len(block_ids),
            self._layout.tokens_per_block,
            self._layout.num_kv_heads,
            self._layout.head_dim,
        )
        expected_bytes = self.run_bytes(len(block_ids), layer_start, layer_end)
        source = self._as_cache_tensor(data, expected_bytes).view(shape)
        self._kv[layer_start:layer_end, :, index] = source.to(self.device, non_blocking=False)
        self.note_written(index.cpu())

    def _as_cache_tensor(self, data: KvBytes | torch.Tensor, expected_bytes: int) -> torch.Tensor:
        if isinstance(data, torch.Tensor):
            if data.dtype == self._dtype:
                got_bytes = data.numel() * data.element_size()
            elif data.dtype == torch.uint8:
                got_bytes = data.numel()
            else:
                raise KvCacheError(f"data dtype must be {self._dtype} or torch.uint8, got {data.dtype}")
            if got_bytes != expected_bytes:
                raise KvCacheError(f"data is {got_bytes} bytes, the run needs exactly {expected_bytes}")
            flat = data.contiguous().view(-1)
            return flat if flat.dtype == self._dtype else flat.view(self._dtype)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise KvCacheError(f"data must be bytes, bytearray, memoryview or a tensor, got {type(data).__name__}")
        view = memoryview(data).cast("B")
        if view.nbytes != expected_bytes:
            raise KvCacheError(f"data is {view.nbytes} bytes, the run needs exactly {expected_bytes}")
        # torch.frombuffer warns on (and must not be handed) read-only memory: copy those once.
        array = np.frombuffer(view, dtype=np.uint8)
        if view.readonly:
            array = array.copy()
        return torch.from_numpy(array).view(self._dtype)

    def _block_index(self, block_ids: Sequence[int], *, unique: bool) -> torch.Tensor:
        ids: list[int] = []
        for block_id in block_ids:
            try:
                value = operator.index(block_id)  # ints and numpy integers, not floats or bools-as-text
            except TypeError:
                raise KvCacheError(f"block id {block_id!r} is not an integer") from None
            if isinstance(block_id, bool) or not 0 <= value < self._num_blocks:
                raise KvCacheError(f"block id {block_id!r} outside [0, {self._num_blocks})")
            ids.append(value)
        if not ids:
            raise KvCacheError("block_ids must not be empty")
        if unique and len(set(ids)) != len(ids):
            raise KvCacheError(f"block_ids must be distinct for an import, got {ids}")
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _check_layers(self, layer_start: int, layer_end: int) -> None:
        if not (
            isinstance(layer_start, int)
            and isinstance(layer_end, int)
            and 0 <= layer_start < layer_end <= self._layout.num_layers
        ):
            raise KvCacheError(
                f"layer range [{layer_start}, {layer_end}) must be non-empty within [0, {self._layout.num_layers})"
            )
