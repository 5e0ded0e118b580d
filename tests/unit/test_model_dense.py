"""The dense baseline generator against the eager reference, and its input checks."""

from __future__ import annotations

import pytest
import torch

from worker.default_model import build_default_model, margin_corpus
from worker.dense import DenseGenerationError, DenseGenerator, reference_logits


@pytest.fixture(autouse=True, scope="module")
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    return build_default_model("float32", "cpu")[0]


def test_batched_prefill_and_decode_match_reference(model):
    prompts = margin_corpus(2, 3, min_len=12, max_len=12)
    generator = DenseGenerator(model, max_batch_size=4, max_len=20)
    logits = generator.prefill(prompts)
    sequences = [list(p) for p in prompts]
    for _ in range(5):
        for row, sequence in enumerate(sequences):
            torch.testing.assert_close(logits[row], reference_logits(model, sequence)[-1], atol=5e-4, rtol=0)
        tokens = logits.argmax(dim=-1)
        for sequence, token in zip(sequences, tokens.tolist(), strict=True):
            sequence.append(token)
        logits = generator.decode_step(tokens)
    assert generator.length == 17


def test_generate_greedy_shape(model):
    out = DenseGenerator(model, 2, 16).generate_greedy([[1, 2, 3], [4, 5, 6]], 4)
    assert len(out) == 2 and all(len(row) == 4 for row in out)


def test_input_checks(model):
    generator = DenseGenerator(model, 2, 8)
    with pytest.raises(DenseGenerationError, match="before prefill"):
        generator.decode_step([1, 2])
    with pytest.raises(DenseGenerationError, match="exceed"):
        generator.prefill([[1] * 9])
    with pytest.raises(DenseGenerationError, match="exceed"):
        generator.prefill([[1], [2], [3]])
    generator.prefill([[1] * 8, [2] * 8])
    with pytest.raises(DenseGenerationError, match="full"):
        generator.decode_step([1, 2])
    with pytest.raises(DenseGenerationError, match="max_position_embeddings"):
        DenseGenerator(model, 1, 5000)
    with pytest.raises(DenseGenerationError, match="empty"):
        reference_logits(model, [])
