"""Typed, validated model configuration built from a Hugging Face config.json dict (no torch here).

Supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM.
Supported RoPE scaling: none/"default", "linear", "llama3", "yarn". Rejected with a typed error:
"dynamic" (its frequencies depend on the current sequence length, so KV written earlier would be
rotated with different frequencies than later queries: incompatible with a KV cache), "longrope",
and anything else. Also rejected: partial rotary embeddings, activations other than SiLU, and
active sliding-window attention (not implemented; a sliding window that covers every position,
i.e. >= max_position_embeddings, is accepted because it masks nothing).

Both config.json generations are read: the older `rope_theta` + `rope_scaling` keys and the newer
`rope_parameters`; the checkpoint dtype from `torch_dtype` (older) or `dtype` (newer).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from scheduler.config import positive_int

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


class ModelConfigError(ValueError):
    """An invalid or unsupported model configuration; `field` names the offending key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnsupportedArchitectureError(ModelConfigError):
    """The checkpoint's architecture is not one this decoder implements."""

    def __init__(self, architecture: str) -> None:
        super().__init__(
            "architectures",
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
        self.architecture = architecture


def _require_positive_int(name: str, value: object) -> None:
    positive_int(name, value, ModelConfigError)


def _require_positive_float(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ModelConfigError(name, f"must be a positive finite number, got {value!r}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ModelConfigError(name, f"must be a boolean, got {value!r}")


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation: every inverse frequency divided by `factor`."""

    factor: float

    def __post_init__(self) -> None:
        _require_positive_float("rope_scaling.factor", self.factor)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent scaling (low frequencies scaled, high kept, a smooth ramp between)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _require_positive_float("rope_scaling.factor", self.factor)
        _require_positive_float("rope_scaling.low_freq_factor", self.low_freq_factor)
        _require_positive_float("rope_scaling.high_freq_factor", self.high_freq_factor)
        _require_positive_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ModelConfigError(
                "rope_scaling.high_freq_factor",
                f"must exceed low_freq_factor ({self.low_freq_factor}), got {self.high_freq_factor}",
            )


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN: a ramp between interpolated and extrapolated frequencies plus an attention factor on cos/sin."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        _require_positive_float("rope_scaling.factor", self.factor)
        _require_positive_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)
        _require_positive_float("rope_scaling.beta_fast", self.beta_fast)
        _require_positive_float("rope_scaling.beta_slow", self.beta_slow)
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None:
                _require_positive_float(f"rope_scaling.{name}", value)
        _require_bool("rope_scaling.truncate", self.truncate)

    def resolved_attention_factor(self) -> float:
        """The factor cos/sin are multiplied by (as the YaRN paper and Hugging Face compute it)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return float(get_mscale(self.factor))


RopeScaling = LinearRopeScaling | Llama3RopeScaling | YarnRopeScaling


@dataclass(frozen=True)
class GenerationConfig:
    """Generation defaults of a checkpoint (generation_config.json) or of the embedded model."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.eos_token_ids, tuple):
            raise ModelConfigError("eos_token_id", f"must be a tuple of ints, got {self.eos_token_ids!r}")
        for token_id in self.eos_token_ids:
            _require_token_id("eos_token_id", token_id)
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                _require_token_id(name, getattr(self, name))
        if self.do_sample is not None:
            _require_bool("do_sample", self.do_sample)
        if self.temperature is not None and (
            not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or self.temperature < 0
        ):
            raise ModelConfigError("temperature", f"must be a number >= 0, got {self.temperature!r}")
        if self.top_p is not None and (
            not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1
        ):
            raise ModelConfigError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0):
            raise ModelConfigError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if self.repetition_penalty is not None:
            _require_positive_float("repetition_penalty", self.repetition_penalty)
        if self.max_new_tokens is not None:
            _require_positive_int("max_new_tokens", self.max_new_tokens)

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> GenerationConfig:
        """Read the keys this project uses from a generation_config.json dict; others are ignored."""
        if not isinstance(raw, Mapping):
            raise ModelConfigError("generation_config", f"must be a JSON object, got {type(raw).__name__}")
        return cls(
            eos_token_ids=parse_token_ids("eos_token_id", raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            do_sample=raw.get("do_sample"),
            temperature=raw.get("temperature"),
            top_p=raw.get("top_p"),
            top_k=raw.get("top_k"),
            repetition_penalty=raw.get("repetition_penalty"),
            max_new_tokens=raw.get("max_new_tokens"),
        )


def _require_token_id(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelConfigError(name, f"must be a non-negative integer token id, got {value!r}")


def parse_token_ids(name: str, value: object) -> tuple[int, ...]:
    """An HF token-id field that may be absent, one int, or a list of ints."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for token_id in values:
        _require_token_id(name, token_id)
    return tuple(dict.fromkeys(values))  # de-duplicated, order kept


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama with attention_bias=True)
    attention_output_bias: bool = False  # bias on o_proj (Llama with attention_bias=True; never Qwen2)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    checkpoint_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(self.architecture)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _require_positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelConfigError(
                "num_kv_heads", f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ModelConfigError("head_dim", f"must be even for rotary embeddings, got {self.head_dim}")
        _require_positive_float("rms_norm_eps", self.rms_norm_eps)
        _require_positive_float("rope_theta", self.rope_theta)
        if self.rope_scaling is not None and not isinstance(
            self.rope_scaling, (LinearRopeScaling, Llama3RopeScaling, YarnRopeScaling)
        ):
            raise ModelConfigError("rope_scaling", f"must be a typed RopeScaling value, got {self.rope_scaling!r}")
        for name in ("attention_bias", "attention_output_bias", "mlp_bias", "tie_word_embeddings"):
            _require_bool(name, getattr(self, name))
        if self.bos_token_id is not None:
            _require_token_id("bos_token_id", self.bos_token_id)
            if self.bos_token_id >= self.vocab_size:
                raise ModelConfigError("bos_token_id", f"{self.bos_token_id} is outside vocab_size {self.vocab_size}")
        if not isinstance(self.eos_token_ids, tuple):
            raise ModelConfigError("eos_token_id", f"must be a tuple of ints, got {self.eos_token_ids!r}")
        for token_id in self.eos_token_ids:
            _require_token_id("eos_token_id", token_id)
            if token_id >= self.vocab_size:
                raise ModelConfigError("eos_token_id", f"{token_id} is outside vocab_size {self.vocab_size}")
        if self.checkpoint_dtype is not None and self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ModelConfigError(
                "torch_dtype", f"must be one of {CHECKPOINT_DTYPES}, got {self.checkpoint_dtype!r}"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def canonical_json(self) -> str:
        """A stable serialisation (sorted keys, scaling tagged by kind), used by model fingerprints."""
        payload = asdict(self)
        if self.rope_scaling is not None:
            payload["rope_scaling"] = {"kind": type(self.rope_scaling).__name__, **asdict(self.rope_scaling)}
        return json.dumps(payload, sort_keys=True, separators=(",", ":"))

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict (newer `rope_parameters` form) that `from_hf_config` reads back equal."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if isinstance(self.rope_scaling, LinearRopeScaling):
            rope.update(rope_type="linear", factor=self.rope_scaling.factor)
        elif isinstance(self.rope_scaling, Llama3RopeScaling):
            rope.update(rope_type="llama3", **asdict(self.rope_scaling))
        elif isinstance(self.rope_scaling, YarnRopeScaling):
            rope.update(rope_type="yarn", **asdict(self.rope_scaling))
        raw: dict[str, Any] = {
            "architectures": [self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "hidden_act": "silu",
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.architecture != "Qwen2ForCausalLM":
            if self.attention_bias != self.attention_output_bias:
                raise ModelConfigError(
                    "attention_bias", f"{self.architecture} has one flag for q/k/v and o biases; they differ here"
                )
            raw["attention_bias"] = self.attention_bias
        elif not self.attention_bias or self.attention_output_bias:
            raise ModelConfigError("attention_bias", "Qwen2 always has q/k/v bias and never an o_proj bias")
        if self.checkpoint_dtype is not None:
            raw["dtype"] = self.checkpoint_dtype
        return raw

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed config.json; raises ModelConfigError naming the offending key."""
        if not isinstance(raw, Mapping):
            raise ModelConfigError("config", f"must be a JSON object, got {type(raw).__name__}")
        architecture = _parse_architecture(raw)

        def required(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelConfigError(key, "missing from config.json")
            return raw[key]

        hidden_size = required("hidden_size")
        num_heads = required("num_attention_heads")
        _require_positive_int("hidden_size", hidden_size)
        _require_positive_int("num_attention_heads", num_heads)
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ModelConfigError(
                    "head_dim", f"absent, and hidden_size {hidden_size} is not divisible by {num_heads} heads"
                )
            head_dim = hidden_size // num_heads

        activation = raw.get("hidden_act", "silu")
        if activation not in ("silu", "swish"):
            raise ModelConfigError("hidden_act", f"only SiLU (SwiGLU MLP) is supported, got {activation!r}")
        max_positions = required("max_position_embeddings")
        _check_sliding_window(raw, architecture, max_positions)

        rope_theta, rope_scaling = _parse_rope(raw, max_positions)
        qkv_bias, output_bias = _parse_attention_bias(raw, architecture)
        bos = raw.get("bos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=required("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=required("intermediate_size"),
            num_layers=required("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=qkv_bias,
            attention_output_bias=output_bias,
            mlp_bias=raw.get("mlp_bias", False),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=bos,
            eos_token_ids=parse_token_ids("eos_token_id", raw.get("eos_token_id")),
            checkpoint_dtype=_parse_checkpoint_dtype(raw),
        )


def _parse_architecture(raw: Mapping[str, Any]) -> str:
    architectures = raw.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise ModelConfigError("architectures", f"must be a non-empty list, got {architectures!r}")
    if len(architectures) != 1:
        raise ModelConfigError("architectures", f"expected exactly one architecture, got {architectures!r}")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(str(architecture))
    return architecture


def _parse_checkpoint_dtype(raw: Mapping[str, Any]) -> str | None:
    """`torch_dtype` (transformers < 4.56) and `dtype` (newer) name the same thing; both must agree."""
    values = {}
    for key in ("torch_dtype", "dtype"):
        value = raw.get(key)
        if value is None:
            continue
        name = _DTYPE_ALIASES.get(str(value).removeprefix("torch."))
        if name is None:
            raise ModelConfigError(key, f"must be one of {CHECKPOINT_DTYPES}, got {value!r}")
        values[key] = name
    if len(set(values.values())) > 1:
        raise ModelConfigError(
            "dtype", f"torch_dtype ({values['torch_dtype']!r}) and dtype ({values['dtype']!r}) disagree"
        )
    return next(iter(values.values()), None)


def _parse_attention_bias(raw: Mapping[str, Any], architecture: str) -> tuple[bool, bool]:
    if architecture == "Qwen2ForCausalLM":
        return True, False  # Qwen2 always has q/k/v bias and never an o_proj bias
    bias = raw.get("attention_bias", False)
    _require_bool("attention_bias", bias)
    return bias, bias  # Llama/Mistral: one flag for q, k, v and o


def _check_sliding_window(raw: Mapping[str, Any], architecture: str, max_positions: int) -> None:
    window = raw.get("sliding_window")
    if window is None:
        return
    if architecture == "Qwen2ForCausalLM":
        layer_types = raw.get("layer_types")
        uses_window = bool(raw.get("use_sliding_window", False)) or (
            isinstance(layer_types, list) and any(kind != "full_attention" for kind in layer_types)
        )
        if not uses_window:
            return
    _require_positive_int("sliding_window", window)
    if window < max_positions:
        raise ModelConfigError(
            "sliding_window",
            f"sliding-window attention ({window} < max_position_embeddings {max_positions}) is not supported",
        )


def _parse_rope(raw: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """Read rope_theta and the scaling from either config generation (`rope_scaling` wins, as in HF)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ModelConfigError("rope_scaling", f"must be a JSON object, got {params!r}")
    rope_theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    _require_positive_float("rope_theta", rope_theta)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelConfigError("partial_rotary_factor", f"partial rotary embeddings are not supported, got {partial!r}")
    kind = params.get("rope_type", params.get("type", "default"))

    def param(key: str, default: Any = None) -> Any:
        value = params.get(key, default)
        if value is None:
            raise ModelConfigError(f"rope_scaling.{key}", f"required for rope_type {kind!r}")
        return value

    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if kind == "default":
        return float(rope_theta), None
    if kind == "linear":
        return float(rope_theta), LinearRopeScaling(factor=param("factor"))
    if kind == "llama3":
        return float(rope_theta), Llama3RopeScaling(
            factor=param("factor"),
            low_freq_factor=param("low_freq_factor"),
            high_freq_factor=param("high_freq_factor"),
            original_max_position_embeddings=original or max_positions,
        )
    if kind == "yarn":
        original = original or max_positions
        factor = params.get("factor")
        if factor is None:
            factor = max_positions / original
        return float(rope_theta), YarnRopeScaling(
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=params.get("truncate", True),
        )
    if kind == "dynamic":
        raise ModelConfigError(
            "rope_scaling.rope_type",
            "'dynamic' NTK scaling is not supported: its frequencies change with the sequence length, "
            "which is incompatible with a KV cache",
        )
    raise ModelConfigError(
        "rope_scaling.rope_type", f"unsupported rope_type {kind!r}; supported: default, linear, llama3, yarn"
    )
