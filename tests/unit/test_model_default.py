"""The embedded default model: determinism, no near-ties on the certified corpus, context dependence,
fingerprints, the byte tokenizer, and device/dtype resolution."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from worker.default_model import (
    MARGIN_CORPUS_SEED,
    bench_model_config,
    build_default_model,
    build_random_model,
    default_model_config,
    greedy_margins,
    margin_corpus,
)
from worker.dense import DenseGenerator, reference_logits
from worker.device import DeviceConfigError, dtype_name, resolve_device, resolve_dtype
from worker.kv_cache import PagedKvCache
from worker.kv_layout import KvLayout
from worker.model_runner import ModelRunner, SequenceChunk
from worker.tokenizer import ByteTokenizer, ChatTemplateError, TokenizerError

NEW_TOKENS = 32
CORPUS_SIZE = 16


@pytest.fixture(autouse=True, scope="module")
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    return build_default_model("float32", "cpu")[0]


def paged_greedy_logits(model, prompts, new_tokens):
    """Greedy continuation of all prompts batched through the paged runner: logits per decision."""
    config = model.config
    tpb = 16
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, tpb, "float32", "margin")
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // tpb)
    runner = ModelRunner(model, PagedKvCache(layout, per_seq * len(prompts)))
    blocks = list(range(per_seq * len(prompts)))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(len(prompts))]
    logits = runner.forward([SequenceChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    history = [logits]
    for step in range(new_tokens):
        tokens = logits.argmax(dim=-1).tolist()
        logits = runner.forward(
            [SequenceChunk([tok], len(p) + step, t, True) for tok, p, t in zip(tokens, prompts, tables, strict=True)]
        )
        history.append(logits)
    return torch.stack(history, dim=1)  # [prompts, decisions, vocab]


def test_certified_corpus_has_no_near_ties(model):
    """Numbers seen (fp32, 1 thread, this corpus of 16 x 33 decisions): logit std >= 6.7, median
    margin ~1.8, min margin ~1.9e-3, max |paged - dense| logit difference ~2.1e-5 (paged decodes
    the 16 prompts batched, dense one at a time): the smallest gap is ~90x the fp32 noise between
    the two paths. A Gaussian-logit model cannot promise more for arbitrary prompts (P(gap < d) is
    about 3.3 d / std per decision), hence a certified corpus and `greedy_margins` as a guard."""
    prompts = margin_corpus(MARGIN_CORPUS_SEED, CORPUS_SIZE)
    margins = greedy_margins(model, prompts, NEW_TOKENS)
    assert len(margins) == CORPUS_SIZE * (NEW_TOKENS + 1)
    paged = paged_greedy_logits(model, prompts, NEW_TOKENS)
    dense = []
    for prompt in prompts:
        generator = DenseGenerator(model, 1, len(prompt) + NEW_TOKENS)
        rows = [generator.prefill([prompt])[0]]
        for _ in range(NEW_TOKENS):
            rows.append(generator.decode_step(rows[-1].argmax().view(1))[0])
        dense.append(torch.stack(rows))
    dense = torch.stack(dense)
    assert torch.equal(paged.argmax(dim=-1), dense.argmax(dim=-1))
    discrepancy = float((paged - dense).abs().max())
    min_margin = min(margins)
    assert float(dense.std(dim=-1).min()) >= 5.0
    assert min_margin >= 1e-3
    assert min_margin >= 50 * discrepancy, (min_margin, discrepancy)


def test_outputs_depend_on_context_not_just_the_last_token(model):
    """Greedy choices after the same last byte differ with the prefix (KV bugs change tokens)."""
    prompts = [p + [ord("a")] for p in margin_corpus(5, 24, min_len=4, max_len=40)]
    choices = {int(reference_logits(model, p)[-1].argmax()) for p in prompts}
    assert len(choices) >= 4


def test_default_model_is_deterministic_and_emits_only_bytes_or_eos():
    first, tokenizer, generation = build_default_model("float32", "cpu")
    second, _, _ = build_default_model("float32", "cpu")
    assert first.fingerprint() == second.fingerprint()
    assert generation.eos_token_ids == (ByteTokenizer.EOS_ID,)
    assert first.config.vocab_size == tokenizer.vocab_size == 264
    assert first.config.num_kv_heads < first.config.num_heads  # GQA exercised
    silent = [ByteTokenizer.BOS_ID, *range(ByteTokenizer.PAD_ID, ByteTokenizer.VOCAB_SIZE)]
    assert first.lm_head.weight[silent].abs().sum() == 0
    assert first.lm_head.weight[ByteTokenizer.EOS_ID].abs().sum() > 0


def test_fingerprint_distinguishes_seeds_and_dtypes():
    config = default_model_config()
    a = build_random_model(config, 1)
    assert a.fingerprint() == build_random_model(config, 1).fingerprint()
    assert a.fingerprint() != build_random_model(config, 2).fingerprint()
    assert a.fingerprint() != build_random_model(config, 1, dtype=torch.bfloat16).fingerprint()
    assert len(a.fingerprint()) == 64


def test_bench_model_shape():
    config = bench_model_config()
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (8, 512, 8, 2)
    assert bench_model_config(vocab_size=32000).vocab_size == 32000


def test_margin_corpus_is_seeded():
    assert margin_corpus(3, 5) == margin_corpus(3, 5)
    assert margin_corpus(3, 5) != margin_corpus(4, 5)
    corpus = margin_corpus(3, 50, min_len=2, max_len=9)
    assert all(2 <= len(p) <= 9 and p[0] == ByteTokenizer.BOS_ID for p in corpus)
    assert all(0 <= t < 256 for p in corpus for t in p[1:])


@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids[0] == ByteTokenizer.BOS_ID
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    assert b"".join(tokenizer.id_to_bytes(i) or b"" for i in ids) == text.encode("utf-8")


def test_byte_tokenizer_specials():
    tokenizer = ByteTokenizer()
    ids = [ByteTokenizer.BOS_ID, 104, 105, ByteTokenizer.EOS_ID, 263]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|bos|>hi<|eos|><|reserved_4|>"
    assert tokenizer.id_to_bytes(ByteTokenizer.EOS_ID) is None
    assert tokenizer.encode("<|eos|>", add_special_tokens=False) == list(b"<|eos|>")  # no injection
    assert tokenizer.decode([0xE2, 0x82]) == "\ufffd"  # an incomplete character is replaced, not raised
    with pytest.raises(TokenizerError):
        tokenizer.decode([264])
    with pytest.raises(TokenizerError):
        tokenizer.id_to_bytes(-1)


def test_byte_tokenizer_chat_template():
    tokenizer = ByteTokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "user: hi\nassistant: "
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == "user: x\n"
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([{"role": "user"}])


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) in (torch.float32, torch.bfloat16)
    assert dtype_name(torch.float16) == "float16"
    with pytest.raises(DeviceConfigError, match="device") as info:
        resolve_device("tpu")
    assert info.value.field == "device"
    with pytest.raises(DeviceConfigError, match="dtype"):
        resolve_dtype("float64", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceConfigError, match="not available"):
            resolve_device("cuda:0")
