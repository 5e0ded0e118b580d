"""The decode mirror: reuse across steps must never serve stale KV (reordered, finished, joined
sequences; blocks reused after a finish; blocks imported between steps; a failed step)."""

from __future__ import annotations

import pytest
import torch

import worker.attention as attention
from worker.default_model import build_default_model, margin_corpus
from worker.dense import reference_logits
from worker.kv_cache import PagedKvCache
from worker.kv_layout import KvLayout
from worker.model_runner import ModelRunner, SequenceChunk

TPB = 4
ATOL = 5e-4


@pytest.fixture(autouse=True, scope="module")
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    return build_default_model("float32", "cpu")[0]


def make_runner(model, num_blocks=64, mirror_bytes=None):
    config = model.config
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, TPB, "float32", "mirror-test")
    return ModelRunner(model, PagedKvCache(layout, num_blocks), decode_mirror_max_bytes=mirror_bytes)


class Seq:
    def __init__(self, tokens, blocks):
        self.tokens = list(tokens)
        self.blocks = list(blocks)

    def decode_chunk(self):
        return SequenceChunk(self.tokens[-1:], len(self.tokens) - 1, self.blocks, True)


def decode_and_check(model, runner, seqs, steps=1):
    """Each step: feed every sequence's last token, check logits, append the greedy token."""
    for _ in range(steps):
        logits = runner.forward([s.decode_chunk() for s in seqs])
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(logits[row], reference_logits(model, seq.tokens)[-1], atol=ATOL, rtol=0)
            seq.tokens.append(int(logits[row].argmax()))


def prefill(runner, seq):
    runner.forward([SequenceChunk(seq.tokens[:-1], 0, seq.blocks, False)])


def test_reordered_finished_and_joined_rows(model):
    runner = make_runner(model)
    prompts = margin_corpus(1, 5, min_len=5, max_len=14)
    seqs = [Seq(p, range(i * 12, i * 12 + 12)) for i, p in enumerate(prompts)]
    for seq in seqs[:4]:
        prefill(runner, seq)
    decode_and_check(model, runner, seqs[:4], steps=3)
    prefill(runner, seqs[4])
    # seq 1 finished; the others come back in another order, a new one joins in the middle.
    decode_and_check(model, runner, [seqs[3], seqs[0], seqs[4], seqs[2]], steps=3)
    decode_and_check(model, runner, [seqs[2], seqs[4]], steps=2)


def test_blocks_reused_after_a_finish_are_not_served_stale(model):
    runner = make_runner(model)
    first = Seq(margin_corpus(2, 1, min_len=9, max_len=9)[0], [7, 3, 11, 5, 9])
    prefill(runner, first)
    decode_and_check(model, runner, [first], steps=3)  # mirror row 0 now holds blocks 7, 3, 11 at length 12
    # A new sequence gets the very same blocks (LIFO reuse) and the same length, in the same row.
    second = Seq(margin_corpus(3, 1, min_len=12, max_len=12)[0], [7, 3, 11, 5, 9])
    assert len(second.tokens) == len(first.tokens)  # its first decode uses blocks 7, 3, 11 again
    prefill(runner, second)
    decode_and_check(model, runner, [second], steps=2)


def test_blocks_imported_between_steps_are_seen(model):
    runner = make_runner(model)
    other = make_runner(model)
    mine = Seq(margin_corpus(4, 1, min_len=10, max_len=10)[0], [1, 2, 3, 4])
    prefill(runner, mine)
    decode_and_check(model, runner, [mine], steps=2)
    # Another instance computed a different sequence of the same length: ship its KV into my blocks.
    theirs = Seq(margin_corpus(5, 1, min_len=len(mine.tokens), max_len=len(mine.tokens))[0], [20, 21, 22, 23])
    other.forward([SequenceChunk(theirs.tokens[:-1], 0, theirs.blocks, False)])
    used = -(-(len(theirs.tokens) - 1) // TPB)
    data = other.kv_cache.export_bytes(theirs.blocks[:used], 0, model.config.num_layers)
    runner.kv_cache.import_blocks(mine.blocks[:used], 0, model.config.num_layers, data)
    continued = Seq(theirs.tokens, mine.blocks)
    decode_and_check(model, runner, [continued], steps=2)


def test_a_mirror_that_does_not_fit_falls_back_to_gathers(model):
    runner = make_runner(model, mirror_bytes=1)
    seqs = [Seq(p, range(i * 8, i * 8 + 8)) for i, p in enumerate(margin_corpus(6, 3, min_len=4, max_len=12))]
    for seq in seqs:
        prefill(runner, seq)
    decode_and_check(model, runner, seqs, steps=2)
    assert runner._mirror is not None and runner._mirror.allocated_bytes == 0


def test_mirror_grows_with_batch_and_context(model):
    runner = make_runner(model, num_blocks=128)
    seqs = [Seq(p, range(i * 16, i * 16 + 16)) for i, p in enumerate(margin_corpus(7, 6, min_len=3, max_len=6))]
    prefill(runner, seqs[0])
    decode_and_check(model, runner, seqs[:1], steps=14)  # width 2 -> 5 blocks: capacity 4 -> 8
    for seq in seqs[1:]:
        prefill(runner, seq)
    decode_and_check(model, runner, seqs, steps=2)  # rows 1 -> 6: capacity 4 -> 8
    assert runner._mirror.allocated_bytes > 0


def test_a_failed_step_leaves_no_false_bookkeeping(model, monkeypatch):
    runner = make_runner(model)
    seqs = [Seq(p, range(i * 10, i * 10 + 10)) for i, p in enumerate(margin_corpus(8, 3, min_len=6, max_len=15))]
    for seq in seqs:
        prefill(runner, seq)
    real = attention.decode_attention
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # layer 1 of the first decode step: layers 2.. never got their copies
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "decode_attention", failing)
    with pytest.raises(RuntimeError, match="injected"):
        runner.forward([s.decode_chunk() for s in seqs])
    decode_and_check(model, runner, seqs, steps=2)


def test_sequences_sharing_prefix_blocks_decode_side_by_side(model):
    runner = make_runner(model)
    shared = margin_corpus(9, 1, min_len=2 * TPB, max_len=2 * TPB)[0]
    a = Seq(shared + [65, 66, 67], [30, 31, 40, 41])
    b = Seq(shared + [70, 71], [30, 31, 50, 51])  # same first two (full) blocks
    prefill(runner, a)
    runner.forward([SequenceChunk(b.tokens[2 * TPB : -1], 2 * TPB, b.blocks, False)])
    decode_and_check(model, runner, [a, b], steps=3)
    decode_and_check(model, runner, [b, a], steps=2)


def test_a_finished_sequence_does_not_make_the_others_recopy(model):
    """Rows stay with their sequences: after one finishes, the others refresh only the block they write."""
    runner = make_runner(model)
    seqs = [Seq(p, range(i * 10, i * 10 + 10)) for i, p in enumerate(margin_corpus(10, 4, min_len=9, max_len=9))]
    for seq in seqs:
        prefill(runner, seq)
    decode_and_check(model, runner, seqs, steps=2)
    mirror = runner._mirror
    counts = []
    real_prepare = mirror.prepare

    def recording_prepare(group):
        step = real_prepare(group)
        counts.append(step.count)
        return step

    mirror.prepare = recording_prepare
    decode_and_check(model, runner, [seqs[0], seqs[2], seqs[3]], steps=1)  # seqs[1] finished
    decode_and_check(model, runner, [seqs[3], seqs[0], seqs[2]], steps=1)  # and an order change
    assert counts == [3, 3]  # one written block per sequence, nothing else recopied
