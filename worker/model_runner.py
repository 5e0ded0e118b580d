"""The forward API the engine calls once per step: chunks in, logits out, KV written to the paged cache."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from worker.attention import (
    DecodeMirror,
    GatherWorkspace,
    PagedAttentionBackend,
    SequenceChunk,
    StepPlanError,
    plan_step,
)
from worker.device import dtype_name
from worker.kv_cache import PagedKvCache
from worker.model import DecoderLM

__all__ = ["ModelRunner", "ModelRunnerError", "SequenceChunk", "StepPlanError"]

logger = logging.getLogger(__name__)

# The decode mirror (worker/attention.py) saves the per-step re-gather of every decode context, the
# main cost of paged decode on CPU, for a second copy of the decode batch's KV. On CUDA the gather
# is cheap next to device memory, so it is off there by default.
DEFAULT_CPU_DECODE_MIRROR_BYTES = 1 << 30


class ModelRunnerError(ValueError):
    """The model and the KV cache do not fit together."""


class ModelRunner:
    """Runs steps of mixed prefill/decode chunks of a `DecoderLM` over a `PagedKvCache`.

    Not thread-safe: one engine loop owns it (the gather workspace is reused across steps).
    """

    def __init__(
        self, model: DecoderLM, kv_cache: PagedKvCache, *, decode_mirror_max_bytes: int | None = None
    ) -> None:
        config = model.config
        layout = kv_cache.layout
        mismatches = [
            f"{name}: model {mine!r}, cache {theirs!r}"
            for name, mine, theirs in (
                ("num_layers", config.num_layers, layout.num_layers),
                ("num_kv_heads", config.num_kv_heads, layout.num_kv_heads),
                ("head_dim", config.head_dim, layout.head_dim),
                ("dtype", dtype_name(model.dtype), layout.dtype),
                ("device", model.device, kv_cache.device),
            )
            if mine != theirs
        ]
        if mismatches:
            raise ModelRunnerError("model and KV cache disagree: " + "; ".join(mismatches))
        if decode_mirror_max_bytes is None:
            decode_mirror_max_bytes = DEFAULT_CPU_DECODE_MIRROR_BYTES if kv_cache.device.type == "cpu" else 0
        if decode_mirror_max_bytes < 0:
            raise ModelRunnerError(f"decode_mirror_max_bytes must be >= 0, got {decode_mirror_max_bytes}")
        self._model = model
        self._cache = kv_cache
        self._workspace = GatherWorkspace()
        self._mirror = DecodeMirror(kv_cache, decode_mirror_max_bytes) if decode_mirror_max_bytes else None

    @property
    def model(self) -> DecoderLM:
        return self._model

    @property
    def kv_cache(self) -> PagedKvCache:
        return self._cache

    def forward(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """float32 logits [count(want_logits), vocab] for the last token of each such chunk, in chunk order."""
        config = self._model.config
        if not chunks:
            return torch.empty((0, config.vocab_size), dtype=torch.float32, device=self._model.device)
        with torch.inference_mode():
            plan = plan_step(
                chunks,
                tokens_per_block=self._cache.tokens_per_block,
                num_blocks=self._cache.num_blocks,
                vocab_size=config.vocab_size,
                max_positions=config.max_position_embeddings,
                device=self._model.device,
            )
            self._cache.note_written(plan.written_blocks)
            mirror_step = None
            if self._mirror is not None and plan.decode is not None:
                mirror_step = self._mirror.prepare(plan.decode)
            backend = PagedAttentionBackend(self._cache, plan, self._workspace, self._mirror, mirror_step)
            try:
                hidden = self._model.forward_hidden(plan.token_ids, plan.positions, backend)
            except BaseException:
                # The mirror's bookkeeping already claims this step's copies, some layers never made.
                if self._mirror is not None:
                    self._mirror.invalidate()
                raise
            return self._model.compute_logits(hidden.index_select(0, plan.logits_rows))
