"""The byte layout of KV blocks, shared by the paged cache and the transfer path (no torch here).

One layer's KV for a run of blocks is laid out as [2 (K, V), block, token-in-block, kv-head, head-dim],
C-contiguous. A run over several layers simply concatenates layers in order, so the bytes of
layers [l0, l1) x blocks (b_0 .. b_n) are exactly `cache[l0:l1, :, block_ids]` of a cache tensor of
shape [num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUT_NAME = "L2BTHD.v1"

DTYPE_ITEMSIZE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KvLayoutError(ValueError):
    """An invalid or incompatible KV layout."""


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    model_fingerprint: str
    layout_name: str = LAYOUT_NAME

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise KvLayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_ITEMSIZE_BYTES:
            raise KvLayoutError(f"dtype must be one of {sorted(DTYPE_ITEMSIZE_BYTES)}, got {self.dtype!r}")
        if not self.model_fingerprint:
            raise KvLayoutError("model_fingerprint must not be empty")

    @property
    def itemsize_bytes(self) -> int:
        return DTYPE_ITEMSIZE_BYTES[self.dtype]

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of K and V of one block in one layer."""
        return 2 * self.tokens_per_block * self.num_kv_heads * self.head_dim * self.itemsize_bytes

    def run_bytes(self, num_layers: int, num_blocks: int) -> int:
        """Bytes of a run of `num_layers` consecutive layers x `num_blocks` blocks."""
        return num_layers * num_blocks * self.block_bytes_per_layer

    def incompatibility(self, other: KvLayout) -> str | None:
        """Why KV laid out as `other` cannot be written into a cache laid out as `self` (None if it can)."""
        for name in (
            "model_fingerprint",
            "dtype",
            "tokens_per_block",
            "layout_name",
            "num_layers",
            "num_kv_heads",
            "head_dim",
        ):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: local {mine!r}, peer {theirs!r}"
        return None
