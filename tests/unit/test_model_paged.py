"""Paged ModelRunner vs the dense reference: exact logits (fp32 tight) and greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from worker.attention import StepPlanError
from worker.default_model import build_default_model, margin_corpus
from worker.dense import DenseGenerator, reference_logits
from worker.kv_cache import PagedKvCache
from worker.kv_layout import KvLayout
from worker.model_runner import ModelRunner, ModelRunnerError, SequenceChunk

TPB = 8
NUM_BLOCKS = 96
ATOL = 5e-4  # logits have std ~8; observed differences are ~1e-5


@pytest.fixture(autouse=True, scope="module")
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    return build_default_model("float32", "cpu")[0]


@pytest.fixture(scope="module")
def fingerprint(model):
    return model.fingerprint()


@pytest.fixture(params=["mirror", "gather"])
def runner(model, fingerprint, request):
    """Both decode paths: the decode mirror (CPU default) and the plain per-step gather."""
    config = model.config
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, TPB, "float32", fingerprint)
    mirror_bytes = None if request.param == "mirror" else 0
    return ModelRunner(model, PagedKvCache(layout, NUM_BLOCKS), decode_mirror_max_bytes=mirror_bytes)


def shuffled_blocks(rng: random.Random, count: int, exclude: set[int] | None = None) -> list[int]:
    pool = [b for b in range(NUM_BLOCKS) if b not in (exclude or set())]
    return rng.sample(pool, count)


def blocks_for(length: int) -> int:
    return -(-length // TPB)


def test_whole_prompt_prefill_matches_reference(model, runner):
    rng = random.Random(1)
    for prompt in margin_corpus(11, 4, min_len=2, max_len=70):
        blocks = shuffled_blocks(rng, blocks_for(len(prompt)))
        logits = runner.forward([SequenceChunk(prompt, 0, blocks, True)])
        expected = reference_logits(model, prompt)[-1]
        assert logits.shape == (1, model.config.vocab_size)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits[0], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 13])
def test_chunked_prefill_matches_reference(model, runner, chunk_size):
    rng = random.Random(chunk_size)
    prompt = margin_corpus(chunk_size, 1, min_len=41, max_len=41)[0]
    expected = reference_logits(model, prompt)
    blocks = shuffled_blocks(rng, blocks_for(len(prompt)))
    for start in range(0, len(prompt), chunk_size):
        chunk = prompt[start : start + chunk_size]
        logits = runner.forward([SequenceChunk(chunk, start, blocks, True)])
        torch.testing.assert_close(logits[0], expected[start + len(chunk) - 1], atol=ATOL, rtol=0)


def test_decode_steps_match_reference_and_greedy_tokens_equal(model, runner):
    rng = random.Random(5)
    prompt = margin_corpus(5, 1, min_len=20, max_len=20)[0]
    total = len(prompt) + 24
    blocks = shuffled_blocks(rng, blocks_for(total))
    logits = runner.forward([SequenceChunk(prompt, 0, blocks, True)])
    sequence = list(prompt)
    for _ in range(24):
        token = int(logits[0].argmax())
        expected = reference_logits(model, sequence)[-1]
        assert token == int(expected.argmax())
        sequence.append(token)
        logits = runner.forward([SequenceChunk([token], len(sequence) - 1, blocks, True)])
        torch.testing.assert_close(logits[0], reference_logits(model, sequence)[-1], atol=ATOL, rtol=0)


def test_batched_decode_with_different_lengths(model, runner):
    rng = random.Random(7)
    prompts = margin_corpus(7, 5, min_len=3, max_len=40)
    tables = []
    used: set[int] = set()
    for prompt in prompts:
        table = shuffled_blocks(rng, blocks_for(len(prompt) + 6), exclude=used)
        used.update(table)
        tables.append(table)
    logits = runner.forward([SequenceChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    sequences = [list(p) for p in prompts]
    for _ in range(6):
        tokens = logits.argmax(dim=-1).tolist()
        chunks = []
        for sequence, token, table in zip(sequences, tokens, tables, strict=True):
            sequence.append(token)
            chunks.append(SequenceChunk([token], len(sequence) - 1, table, True))
        logits = runner.forward(chunks)
        for row, sequence in enumerate(sequences):
            torch.testing.assert_close(logits[row], reference_logits(model, sequence)[-1], atol=ATOL, rtol=0)


def test_reused_prefix_blocks_are_read_not_recomputed(model, runner):
    rng = random.Random(9)
    shared = margin_corpus(9, 1, min_len=3 * TPB, max_len=3 * TPB)[0]  # exactly 3 full blocks
    first = shared + [65, 66, 67, 68, 69]
    second = shared + [70, 71, 72]
    first_blocks = shuffled_blocks(rng, blocks_for(len(first)))
    runner.forward([SequenceChunk(first, 0, first_blocks, False)])
    # The second sequence shares the first 2 full blocks (16 tokens) and starts after them.
    reused = first_blocks[:2]
    own = shuffled_blocks(rng, blocks_for(len(second)) - 2, exclude=set(first_blocks))
    logits = runner.forward([SequenceChunk(second[2 * TPB :], 2 * TPB, reused + own, True)])
    torch.testing.assert_close(logits[0], reference_logits(model, second)[-1], atol=ATOL, rtol=0)


def test_prefix_reuse_really_reads_the_cache(model, runner):
    """A cached prefix that was never written gives different logits: the runner reads, not recomputes."""
    prompt = margin_corpus(13, 1, min_len=2 * TPB + 4, max_len=2 * TPB + 4)[0]
    blocks = [3, 4, 5]
    logits = runner.forward([SequenceChunk(prompt[2 * TPB :], 2 * TPB, blocks, True)])
    expected = reference_logits(model, prompt)[-1]
    assert (logits[0] - expected).abs().max() > 1e-2


def test_mixed_prefill_and_decode_in_one_step_any_chunk_order(model, runner):
    rng = random.Random(11)
    decoding = margin_corpus(21, 2, min_len=10, max_len=30)
    decode_tables = []
    used: set[int] = set()
    for prompt in decoding:
        table = shuffled_blocks(rng, blocks_for(len(prompt) + 1), exclude=used)
        used.update(table)
        decode_tables.append(table)
    runner.forward([SequenceChunk(p[:-1], 0, t, False) for p, t in zip(decoding, decode_tables, strict=True)])

    fresh = margin_corpus(22, 2, min_len=12, max_len=12)  # two equal-length fresh prefills: batched
    fresh_tables = []
    for _ in fresh:
        table = shuffled_blocks(rng, blocks_for(12), exclude=used)
        used.update(table)
        fresh_tables.append(table)
    partial = margin_corpus(23, 1, min_len=30, max_len=30)[0]
    partial_table = shuffled_blocks(rng, blocks_for(30), exclude=used)
    runner.forward([SequenceChunk(partial[:17], 0, partial_table, False)])

    chunks = [
        SequenceChunk(fresh[0], 0, fresh_tables[0], True),
        SequenceChunk(decoding[0][-1:], len(decoding[0]) - 1, decode_tables[0], True),
        SequenceChunk(partial[17:], 17, partial_table, True),
        SequenceChunk(fresh[1], 0, fresh_tables[1], False),  # no logits wanted: skipped in the output
        SequenceChunk(decoding[1][-1:], len(decoding[1]) - 1, decode_tables[1], True),
    ]
    logits = runner.forward(chunks)
    expected = [fresh[0], decoding[0], partial, decoding[1]]
    assert logits.shape[0] == len(expected)
    for row, sequence in enumerate(expected):
        torch.testing.assert_close(logits[row], reference_logits(model, sequence)[-1], atol=ATOL, rtol=0)
    # The fresh prefill without logits still wrote its KV: a decode after it must see it.
    next_logits = runner.forward([SequenceChunk([42], len(fresh[1]), fresh_tables[1], True)])
    torch.testing.assert_close(next_logits[0], reference_logits(model, fresh[1] + [42])[-1], atol=ATOL, rtol=0)


def test_greedy_generation_equals_dense_baseline(model, runner):
    prompts = margin_corpus(31, 3, min_len=16, max_len=16)
    dense = DenseGenerator(model, max_batch_size=3, max_len=64).generate_greedy(prompts, 20)
    rng = random.Random(3)
    tables = []
    used: set[int] = set()
    for _ in prompts:
        table = shuffled_blocks(rng, blocks_for(16 + 20), exclude=used)
        used.update(table)
        tables.append(table)
    logits = runner.forward([SequenceChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    generated = [[] for _ in prompts]
    for step in range(20):
        tokens = logits.argmax(dim=-1).tolist()
        for row, token in enumerate(tokens):
            generated[row].append(token)
        if step < 19:
            position = 16 + step
            logits = runner.forward([SequenceChunk([t], position, tab, True) for t, tab in zip(tokens, tables, strict=True)])
    assert generated == dense


def test_empty_step_and_no_logits(model, runner):
    assert runner.forward([]).shape == (0, model.config.vocab_size)
    out = runner.forward([SequenceChunk([1, 2, 3], 0, [0], False)])
    assert out.shape == (0, model.config.vocab_size)


@pytest.mark.parametrize(
    "chunk, message",
    [
        (SequenceChunk([], 0, [0], True), "must not be empty"),
        (SequenceChunk([1] * 9, 0, [0], True), "block table"),
        (SequenceChunk([1], -1, [0], True), "num_cached_tokens"),
        (SequenceChunk([1], 0, [NUM_BLOCKS], True), "block ids"),
        (SequenceChunk([1], 0, [-1], True), "block ids"),
        (SequenceChunk([1], 0, [0.5], True), "block ids"),
        (SequenceChunk([100000], 0, [0], True), "token ids"),
        (SequenceChunk([1], 4096, list(range(NUM_BLOCKS)), True), "max_position_embeddings"),
    ],
)
def test_bad_chunks_raise_typed_errors(runner, chunk, message):
    with pytest.raises(StepPlanError, match=message):
        runner.forward([chunk])


def test_runner_rejects_a_cache_of_another_shape(model, fingerprint):
    config = model.config
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, TPB, "bfloat16", fingerprint)
    with pytest.raises(ModelRunnerError, match="dtype"):
        ModelRunner(model, PagedKvCache(layout, 4))
    layout = KvLayout(config.num_layers + 1, config.num_kv_heads, config.head_dim, TPB, "float32", fingerprint)
    with pytest.raises(ModelRunnerError, match="num_layers"):
        ModelRunner(model, PagedKvCache(layout, 4))


def test_bf16_paged_close_to_fp32_reference():
    model16 = build_default_model("bfloat16", "cpu")[0]
    model32 = build_default_model("float32", "cpu")[0]
    config = model16.config
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, TPB, "bfloat16", "x")
    runner = ModelRunner(model16, PagedKvCache(layout, 16))
    prompt = margin_corpus(41, 1, min_len=30, max_len=30)[0]
    runner.forward([SequenceChunk(prompt[:20], 0, [5, 2, 9, 7], False)])
    logits = runner.forward([SequenceChunk(prompt[20:], 20, [5, 2, 9, 7], True)])
    expected = reference_logits(model32, prompt)[-1]
    # bf16 keeps ~3 significant digits; the logits (std ~8) agree to a small fraction of their spread.
    assert expected.std() > 4.0
    assert (logits[0] - expected).abs().max() < 1.0
