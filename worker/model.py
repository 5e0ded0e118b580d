"""A Llama-family decoder (Llama, Mistral, Qwen2 shapes) in plain torch.

Parameter names are exactly Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...), so a
checkpoint's tensors are copied in by name. The model works on a flat batch of tokens [T, hidden]
(every sequence of a step concatenated): projections and the MLP are one matmul per weight for the
whole step, and attention is delegated to an `AttentionBackend` (paged cache, dense reference,
dense baseline), which sees the rotated q/k/v of one layer at a time.

Numerics follow Hugging Face's modelling code (RMSNorm in fp32 then cast, RoPE frequencies and
cos/sin in fp32, cos/sin cast to the model dtype before rotation), so bf16 results track HF closely.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from worker.device import dtype_name
from worker.model_config import LinearRopeScaling, Llama3RopeScaling, ModelConfig, YarnRopeScaling

logger = logging.getLogger(__name__)

# Fingerprints hash whole tensors up to 2 x FINGERPRINT_SAMPLE_BYTES and, above that, the first and
# last FINGERPRINT_SAMPLE_BYTES plus FINGERPRINT_WINDOWS evenly spaced windows of
# FINGERPRINT_WINDOW_BYTES: enough to tell checkpoints (and fine-tunes) apart while keeping the cost
# bounded (~192 KiB per tensor) for multi-GB models.
FINGERPRINT_SAMPLE_BYTES = 64 * 1024
FINGERPRINT_WINDOWS = 16
FINGERPRINT_WINDOW_BYTES = 4 * 1024
FINGERPRINT_VERSION = "duet-model-fingerprint.v1"


class AttentionBackend(Protocol):
    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] (rotated) -> [T, num_heads, head_dim]."""
        ...


def rope_inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """fp32 inverse frequencies [head_dim // 2] and the cos/sin scale, as Hugging Face computes them."""
    dim = config.head_dim
    base = config.rope_theta
    scaling = config.rope_scaling
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if scaling is None:
        return inv_freq, 1.0
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor, 1.0
    if isinstance(scaling, Llama3RopeScaling):
        old_context_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_context_len / scaling.low_freq_factor
        high_freq_wavelen = old_context_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth_factor) * inv_freq_llama / scaling.factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_inverse_frequencies(config, scaling), scaling.resolved_attention_factor()
    raise TypeError(f"unhandled rope scaling {scaling!r}")


def _yarn_inverse_frequencies(config: ModelConfig, scaling: YarnRopeScaling) -> torch.Tensor:
    dim = config.head_dim
    base = config.rope_theta

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low = correction_dim(scaling.beta_fast)
    high = correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as upstream: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim] in x's dtype."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias, **kw)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias, **kw)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias, **kw)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_output_bias, **kw)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_index: int,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = backend.attend(layer_index, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class Mlp(nn.Module):
    def __init__(self, config: ModelConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": config.mlp_bias}
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = Attention(config, **kw)
        self.mlp = Mlp(config, **kw)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_index: int,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, layer_index, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderBody(nn.Module):
    """Hugging Face's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(config, **kw) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)


class DecoderLM(nn.Module):
    """The causal LM. Parameters are allocated uninitialised: a loader or builder fills every one."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        # Build on the meta device first so multi-GB models are not randomly initialised for nothing.
        meta = {"device": torch.device("meta"), "dtype": dtype}
        self.model = DecoderBody(config, **meta)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **meta)
        self.to_empty(device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, attention_scaling = rope_inverse_frequencies(config)
        self._inv_freq = inv_freq.to(device)
        self._rope_attention_scaling = attention_scaling
        self.requires_grad_(False)
        self.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, head_dim] in the model dtype for int64 positions [T] (computed in fp32)."""
        inv_freq = self._inv_freq.to(positions.device)  # a plain attribute: Module.to(dtype) must not cast it
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos()
        sin = emb.sin()
        if self._rope_attention_scaling != 1.0:
            cos = cos * self._rope_attention_scaling
            sin = sin * self._rope_attention_scaling
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)

    def forward_hidden(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Last-layer hidden states [T, hidden] (before the final norm) for tokens [T] at positions [T]."""
        cos, sin = self.rope_cos_sin(positions)
        hidden = self.model.embed_tokens(token_ids)
        for index, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, index, backend)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for last-layer hidden rows [N, hidden] (the final norm is applied
        here, so a step normalises only the rows it wants logits for)."""
        return self.lm_head(self.model.norm(hidden)).to(torch.float32)

    def fingerprint(self) -> str:
        """Stable hex digest of (config, dtype, tensor names/shapes, weight bytes).

        Tensors up to 2 x FINGERPRINT_SAMPLE_BYTES are hashed whole; larger ones by their first and
        last FINGERPRINT_SAMPLE_BYTES and evenly spaced windows in between (bounded cost on large
        models; a change confined to unsampled bytes goes unseen). Equal weights in equal dtypes
        give equal digests on any device; a different dtype gives a different digest on purpose,
        since the KV bytes it produces differ too.
        """
        digest = hashlib.sha256()
        digest.update(FINGERPRINT_VERSION.encode())
        digest.update(self.config.canonical_json().encode())
        digest.update(dtype_name(self.dtype).encode())
        for name, tensor in sorted(self.state_dict().items()):
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            if flat.numel() <= 2 * FINGERPRINT_SAMPLE_BYTES:
                digest.update(flat.cpu().numpy().tobytes())
            else:
                step = (flat.numel() - FINGERPRINT_WINDOW_BYTES) // (FINGERPRINT_WINDOWS + 1)
                windows = [flat[step * i : step * i + FINGERPRINT_WINDOW_BYTES] for i in range(1, FINGERPRINT_WINDOWS + 1)]
                pieces = [flat[:FINGERPRINT_SAMPLE_BYTES], *windows, flat[-FINGERPRINT_SAMPLE_BYTES:]]
                digest.update(torch.cat(pieces).cpu().numpy().tobytes())
        return digest.hexdigest()
