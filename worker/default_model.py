"""The embedded default model (tiny Llama, seeded random weights, byte tokenizer) and random builders.

Everything is built in code from a seed: no files, no download. Weights are drawn on the CPU from a
`torch.Generator` in float32 and only then cast and moved, so a seed gives the same model on every
device (up to the cast).

Near-ties: exact-token tests compare paged vs dense, chunked vs whole, disaggregated vs colocated.
A greedy choice whose top-1/top-2 logit gap is within fp32 rounding noise could flip between two
paths that are both correct, so the default model's lm_head is scaled for a logit spread (std about
DEFAULT_LOGIT_STD) where gaps are far above that noise; `margin_corpus` gives the seeded prompts the
margin test checks (tests/unit/test_model_default.py states the numbers).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import replace

import torch

from worker.dense import DenseGenerator
from worker.device import resolve_device, resolve_dtype
from worker.model import DecoderLM
from worker.model_config import GenerationConfig, ModelConfig
from worker.tokenizer import ByteTokenizer

DEFAULT_SEED = 20240601
MARGIN_CORPUS_SEED = 0  # the corpus tests/unit/test_model_default.py certifies (16 prompts, 32 new tokens)
DEFAULT_LOGIT_STD = 8.0
BENCH_SEED = 7


def default_model_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=ByteTokenizer.VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=ByteTokenizer.BOS_ID,
        eos_token_ids=(ByteTokenizer.EOS_ID,),
    )


def bench_model_config(vocab_size: int = ByteTokenizer.VOCAB_SIZE) -> ModelConfig:
    """The engine benchmark's model: 8 layers, hidden 512, 8 heads over 2 KV heads (GQA, as Llama 3)."""
    return replace(
        default_model_config(),
        vocab_size=vocab_size,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
    )


def build_random_model(
    config: ModelConfig,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    logit_std: float = DEFAULT_LOGIT_STD,
) -> DecoderLM:
    """A model with seeded Gaussian weights, scaled so activations stay O(1) through the layers
    (1/sqrt(fan_in) projections) and logits have roughly `logit_std` spread."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    model = DecoderLM(config, dtype=dtype, device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # shared with embed_tokens, filled under that name
            param.copy_(_random_tensor(name, tuple(param.shape), generator, config, logit_std))
    return model


def _silence_special_tokens(model: DecoderLM, token_ids: Iterable[int]) -> None:
    """Zero the lm_head rows of tokens the model must never emit (BOS, PAD, reserved): their logit is
    then exactly 0, far below the top of a `DEFAULT_LOGIT_STD` spread, so greedy and sampled outputs
    are always bytes or EOS (decodable) and these ids never compete for the top-1."""
    with torch.no_grad():
        for token_id in token_ids:
            model.lm_head.weight[token_id].zero_()


def _random_tensor(
    name: str, shape: tuple[int, ...], generator: torch.Generator, config: ModelConfig, logit_std: float
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        # Around 1, not exactly 1, so a norm-weight loading bug cannot hide.
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=generator)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=generator)
    if name == "lm_head.weight":
        # RMS-normed hidden rows have ~unit-variance entries: logits std ~= logit_std.
        return torch.randn(shape, generator=generator) * (logit_std / math.sqrt(config.hidden_size))
    fan_in = shape[1]
    return torch.randn(shape, generator=generator) / math.sqrt(fan_in)


def default_generation_config() -> GenerationConfig:
    return GenerationConfig(
        eos_token_ids=(ByteTokenizer.EOS_ID,),
        bos_token_id=ByteTokenizer.BOS_ID,
        pad_token_id=ByteTokenizer.PAD_ID,
    )


BUILTIN_MODELS = ("default", "bench")  # "bench": bench_model_config(), the engine benchmark's model


def build_default_model(
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    variant: str = "default",
) -> tuple[DecoderLM, ByteTokenizer, GenerationConfig]:
    """The embedded default: (model, tokenizer, generation config). dtype/device accept "auto".
    `variant` "bench" builds the engine benchmark's larger model with the same tokenizer."""
    if variant not in BUILTIN_MODELS:
        raise ValueError(f"no built-in model {variant!r}; the built-in models are {', '.join(BUILTIN_MODELS)}")
    resolved_device = device if isinstance(device, torch.device) else resolve_device(device)
    resolved_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, resolved_device)
    config, seed = (default_model_config(), DEFAULT_SEED) if variant == "default" else (bench_model_config(), BENCH_SEED)
    model = build_random_model(config, seed, dtype=resolved_dtype, device=resolved_device)
    silent = [ByteTokenizer.BOS_ID, *range(ByteTokenizer.PAD_ID, ByteTokenizer.VOCAB_SIZE)]  # not EOS
    _silence_special_tokens(model, silent)
    return model, ByteTokenizer(), default_generation_config()


def margin_corpus(seed: int, n: int, *, min_len: int = 1, max_len: int = 96) -> list[list[int]]:
    """`n` seeded prompts for the default model: BOS then random bytes, lengths in [min_len, max_len]."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompts.append([ByteTokenizer.BOS_ID] + [rng.randrange(ByteTokenizer.NUM_BYTES) for _ in range(length - 1)])
    return prompts


def greedy_margins(model: DecoderLM, prompts: list[list[int]], max_new_tokens: int) -> list[float]:
    """Top-1 minus top-2 logit at every greedy decision (prompt end + each generated token) of each
    prompt, computed with the dense baseline: a guard exact-token tests can assert on."""
    margins: list[float] = []
    for prompt in prompts:
        generator = DenseGenerator(model, 1, len(prompt) + max_new_tokens)
        logits = generator.prefill([prompt])
        for step in range(max_new_tokens + 1):
            top = logits[0].topk(2).values
            margins.append(float(top[0] - top[1]))
            if step < max_new_tokens:
                logits = generator.decode_step(logits.argmax(dim=-1))
    return margins
