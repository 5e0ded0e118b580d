"""Dense (un-paged) counterparts of the paged runner.

* `reference_logits`: full recompute of one sequence with an eager attention written independently
  of the paged kernels (repeat K/V, fp32 softmax, as Hugging Face's eager path): the oracle for
  exact-token tests.
* `DenseGenerator`: a bare batched generation loop over a preallocated contiguous cache
  [batch, kv_heads, max_len, head_dim] per layer, no paging, no scheduler: the baseline the engine
  benchmark compares against. It uses the same SDPA kernels as the paged path (causal prefill,
  folded grouped-query decode), so the comparison measures paging and scheduling, not kernel choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.attention import causal_attention, decode_attention
from worker.model import DecoderLM


class DenseGenerationError(ValueError):
    """A bad call of the dense baseline (ragged prompts, batch or length out of range)."""


class _EagerCausalBackend:
    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim**-0.5
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hqk,khd->qhd", probs, v)


def reference_logits(model: DecoderLM, token_ids: Sequence[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of one sequence, recomputed densely without any cache."""
    if len(token_ids) == 0:
        raise DenseGenerationError("token_ids must not be empty")
    with torch.inference_mode():
        tokens = torch.as_tensor(list(token_ids), dtype=torch.int64, device=model.device)
        positions = torch.arange(tokens.numel(), dtype=torch.int64, device=model.device)
        hidden = model.forward_hidden(tokens, positions, _EagerCausalBackend())
        return model.compute_logits(hidden)


class _DensePrefillBackend:
    def __init__(self, generator: DenseGenerator, batch: int, length: int) -> None:
        self._gen, self._batch, self._length = generator, batch, length

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = (self._batch, self._length)
        q4 = q.view(*shape, *q.shape[1:])
        k4 = k.view(*shape, *k.shape[1:])
        v4 = v.view(*shape, *v.shape[1:])
        self._gen._k[layer_index][: self._batch, :, : self._length] = k4.transpose(1, 2)
        self._gen._v[layer_index][: self._batch, :, : self._length] = v4.transpose(1, 2)
        return causal_attention(q4, k4, v4).reshape(q.shape)


class _DenseDecodeBackend:
    def __init__(self, generator: DenseGenerator, batch: int, position: int) -> None:
        self._gen, self._batch, self._position = generator, batch, position

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache = self._gen._k[layer_index][: self._batch]
        v_cache = self._gen._v[layer_index][: self._batch]
        k_cache[:, :, self._position] = k
        v_cache[:, :, self._position] = v
        end = self._position + 1
        return decode_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], None)


class DenseGenerator:
    """Batched greedy-capable generation of equal-length prompts over a dense preallocated KV cache."""

    def __init__(self, model: DecoderLM, max_batch_size: int, max_len: int) -> None:
        config = model.config
        if max_batch_size <= 0 or max_len <= 0:
            raise DenseGenerationError(f"max_batch_size and max_len must be positive, got {max_batch_size}, {max_len}")
        if max_len > config.max_position_embeddings:
            raise DenseGenerationError(
                f"max_len {max_len} exceeds max_position_embeddings {config.max_position_embeddings}"
            )
        self._model = model
        self._max_batch = max_batch_size
        self._max_len = max_len
        shape = (max_batch_size, config.num_kv_heads, max_len, config.head_dim)
        kw = {"dtype": model.dtype, "device": model.device}
        self._k = [torch.zeros(shape, **kw) for _ in range(config.num_layers)]
        self._v = [torch.zeros(shape, **kw) for _ in range(config.num_layers)]
        self._batch = 0
        self._length = 0

    @property
    def length(self) -> int:
        """Tokens per sequence currently in the cache."""
        return self._length

    def prefill(self, prompts: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """Run equal-length prompts [B, L] from position 0; float32 logits [B, vocab] of their last tokens."""
        tokens = torch.as_tensor(prompts, dtype=torch.int64, device=self._model.device)
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise DenseGenerationError(f"prompts must be a non-empty [batch, length] array, got shape {tuple(tokens.shape)}")
        batch, length = tokens.shape
        if batch > self._max_batch or length > self._max_len:
            raise DenseGenerationError(f"prompts {batch} x {length} exceed {self._max_batch} x {self._max_len}")
        with torch.inference_mode():
            positions = torch.arange(length, device=self._model.device).repeat(batch)
            hidden = self._model.forward_hidden(
                tokens.reshape(-1), positions, _DensePrefillBackend(self, batch, length)
            )
            logits = self._model.compute_logits(hidden.view(batch, length, -1)[:, -1])
        self._batch, self._length = batch, length
        return logits

    def decode_step(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append one token per sequence; float32 logits [B, vocab] for it."""
        if self._batch == 0:
            raise DenseGenerationError("decode_step before prefill")
        tokens = torch.as_tensor(token_ids, dtype=torch.int64, device=self._model.device).view(-1)
        if tokens.numel() != self._batch:
            raise DenseGenerationError(f"expected {self._batch} tokens, got {tokens.numel()}")
        if self._length >= self._max_len:
            raise DenseGenerationError(f"cache full at max_len {self._max_len}")
        position = self._length
        with torch.inference_mode():
            positions = torch.full((self._batch,), position, dtype=torch.int64, device=self._model.device)
            hidden = self._model.forward_hidden(tokens, positions, _DenseDecodeBackend(self, self._batch, position))
            logits = self._model.compute_logits(hidden)
        self._length += 1
        return logits

    def generate_greedy(self, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of `max_new_tokens` tokens per prompt (no stop tokens)."""
        logits = self.prefill(prompts)
        outputs: list[list[int]] = [[] for _ in range(logits.shape[0])]
        for step in range(max_new_tokens):
            next_ids = logits.argmax(dim=-1)
            for row, token in enumerate(next_ids.tolist()):
                outputs[row].append(token)
            if step + 1 < max_new_tokens:
                logits = self.decode_step(next_ids)
        return outputs
