"""Peer check against Hugging Face transformers (test-only import; skipped when missing).

Tiny random Llama / Mistral / Qwen2 models are saved with `save_pretrained` (safetensors, also
sharded), loaded with our loader, and must give the same logits and the same greedy tokens through
the paged ModelRunner.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from worker.dense import reference_logits  # noqa: E402
from worker.kv_cache import PagedKvCache  # noqa: E402
from worker.kv_layout import KvLayout  # noqa: E402
from worker.loader import load_checkpoint  # noqa: E402
from worker.model_config import Llama3RopeScaling, YarnRopeScaling  # noqa: E402
from worker.model_runner import ModelRunner, SequenceChunk  # noqa: E402

VOCAB = 320
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CASES = {
    "llama_gqa_llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama_bias_head_dim_linear_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"attention_bias": True, "mlp_bias": True, "head_dim": 24, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "qwen2_bias_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen2_yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    ),
    "mistral_gqa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "num_key_value_heads": 1}),
}


@pytest.fixture(autouse=True, scope="module")
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def build_hf(case: str):
    config_name, model_name, extra = CASES[case]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    model = getattr(transformers, model_name)(config).eval()
    generator = torch.Generator().manual_seed(sum(map(ord, case)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 1.0 if "embed" in name or "norm" in name else 0.15
            if name == "lm_head.weight":
                std = 1.0
            value = torch.randn(param.shape, generator=generator) * std
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * value
            param.copy_(value)
    return model


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], float]:
    ids = list(prompt)
    out = []
    min_margin = float("inf")
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2).values
            min_margin = min(min_margin, float(top[0] - top[1]))
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
    return out, min_margin


def paged_greedy(model, prompt: list[int], steps: int) -> list[int]:
    config = model.config
    tpb = 4
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, tpb, "float32", "peer")
    runner = ModelRunner(model, PagedKvCache(layout, 64))
    blocks = random.Random(0).sample(range(64), -(-(len(prompt) + steps) // tpb))
    # Prefill in two chunks to exercise the cached-prefix path on real checkpoints too.
    split = len(prompt) // 2
    runner.forward([SequenceChunk(prompt[:split], 0, blocks, False)])
    logits = runner.forward([SequenceChunk(prompt[split:], split, blocks, True)])
    out = []
    for step in range(steps):
        token = int(logits[0].argmax())
        out.append(token)
        if step + 1 < steps:
            logits = runner.forward([SequenceChunk([token], len(prompt) + step, blocks, True)])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(case, tmp_path):
    hf_model = build_hf(case)
    sharded = case == "llama_gqa_llama3_rope"
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "1GB")
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == [type(hf_model).__name__]

    ours, generation = load_checkpoint(tmp_path, "float32", "cpu")
    assert generation.eos_token_ids == (2,)
    if case == "llama_gqa_llama3_rope":
        assert ours.config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 16)
    if case == "qwen2_yarn":
        assert isinstance(ours.config.rope_scaling, YarnRopeScaling)
    if case == "qwen2_bias_tied":
        assert ours.config.tie_word_embeddings and ours.config.attention_bias

    prompt = [random.Random(case).randrange(3, VOCAB) for _ in range(37)]  # past 32 positions: rope scaling matters
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(reference_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)

    expected_tokens, margin = hf_greedy(hf_model, prompt, 16)
    assert margin > 1e-3, "test model has a near-tie; pick another seed"
    assert paged_greedy(ours, prompt, 16) == expected_tokens


def test_the_peer_check_can_fail(tmp_path):
    """Dropping the rope scaling from the config changes the logits: the comparison has teeth."""
    hf_model = build_hf("llama_gqa_llama3_rope")
    hf_model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_scaling", None)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, _ = load_checkpoint(tmp_path, "float32", "cpu")
    prompt = list(range(3, 40))
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    assert (reference_logits(ours, prompt) - expected).abs().max() > 1e-2


def _word_level_tokenizer(directory) -> None:
    """A tokenizer.json with one word per id (t0 .. t{VOCAB-1}): the serving path needs one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))


def test_dtype_auto_serves_a_float32_checkpoint_as_saved_on_cpu(tmp_path):
    """`dtype: auto` on a CPU takes the checkpoint's dtype: a float32 checkpoint gives the tokens
    transformers gives (bfloat16, what auto chose before on CPUs with native bf16, differs)."""
    from worker.llm import LLM
    from worker.sampling import SamplingParams

    hf_model = build_hf("llama_gqa_llama3_rope")
    hf_model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert (raw.get("dtype") or raw.get("torch_dtype")) == "float32"
    _word_level_tokenizer(tmp_path)

    llm = LLM(str(tmp_path), device="cpu")  # dtype "auto"
    assert llm.engine.layout.dtype == "float32"
    prompt = [random.Random("auto").randrange(3, VOCAB) for _ in range(29)]
    expected, margin = hf_greedy(hf_model, prompt, 12)
    assert margin > 1e-3, "test model has a near-tie; pick another seed"
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert output.token_ids == expected


@pytest.mark.parametrize(
    ("saved", "device", "bf16_supported", "chosen"),
    [
        ("float32", "cpu", None, torch.float32),
        (None, "cpu", None, torch.float32),
        ("bfloat16", "cpu", None, torch.bfloat16),
        ("float16", "cpu", None, torch.float16),
        ("float32", "cuda", True, torch.bfloat16),
        ("float32", "cuda", False, torch.float16),
        (None, "cuda", True, torch.bfloat16),
        ("bfloat16", "cuda", False, torch.float16),
        ("float16", "cuda", True, torch.float16),
    ],
)
def test_dtype_auto_for_a_checkpoint(monkeypatch, saved, device, bf16_supported, chosen):
    from worker.device import resolve_model_dtype

    if bf16_supported is not None:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_supported)
    assert resolve_model_dtype("auto", torch.device(device), saved) == chosen
    assert resolve_model_dtype("float32", torch.device("cpu"), "bfloat16") == torch.float32
