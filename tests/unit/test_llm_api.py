"""The offline API of one instance (vLLM's shape): prompts in every accepted form, outputs, errors."""

from __future__ import annotations

import pytest
import torch

from worker import LLM, SamplingParams
from worker.protocol import EngineInputError


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(dtype="float32", device="cpu", num_blocks=256, capacity_policy="MAX_UTILIZATION")


def test_prompt_forms_and_outputs(llm) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    one = llm.generate("Hello", params)
    assert len(one) == 1 and one[0].prompt == "Hello"
    assert one[0].prompt_token_ids == llm.tokenizer.encode("Hello")
    assert len(one[0].token_ids) == 6 and one[0].finish_reason == "length"
    assert one[0].text == llm.tokenizer.decode(one[0].token_ids)
    many = llm.generate(["Hello", "Bonjour"], params)
    assert [o.prompt for o in many] == ["Hello", "Bonjour"]
    assert many[0].token_ids == one[0].token_ids  # greedy: the same prompt, the same tokens
    ids = llm.generate(one[0].prompt_token_ids, params)
    assert ids[0].prompt is None and ids[0].token_ids == one[0].token_ids
    lists = llm.generate([one[0].prompt_token_ids, [256, 1, 2]], params)
    assert len(lists) == 2 and lists[0].token_ids == one[0].token_ids


def test_logprobs_and_per_prompt_params(llm) -> None:
    outputs = llm.generate(
        ["a", "b"],
        [SamplingParams(max_tokens=3, temperature=0.0, logprobs=2), SamplingParams(max_tokens=2, temperature=0.7, seed=5)],
    )
    first, second = outputs
    assert first.logprobs is not None and len(first.logprobs) == len(first.token_ids)
    assert all(len(entry.top) == 2 and entry.sampled.token_id == token for entry, token in zip(first.logprobs, first.token_ids, strict=True))
    assert second.logprobs is None and len(second.token_ids) <= 2


def test_bad_inputs_are_refused(llm) -> None:
    with pytest.raises(EngineInputError):
        llm.generate([], SamplingParams())
    with pytest.raises(EngineInputError):
        llm.generate([[1, 2], "x", 3.5], SamplingParams())  # type: ignore[list-item]
    with pytest.raises(EngineInputError) as error:
        llm.generate([[1, 99999]], SamplingParams(max_tokens=2))
    assert error.value.field == "prompt_token_ids"
    with pytest.raises(EngineInputError):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(EngineInputError):  # the second is refused: the first must not linger
        llm.generate([[1, 2], [1, 99999]], SamplingParams(max_tokens=2))
    assert llm.engine.num_requests == 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    with pytest.raises(EngineInputError):
        LLM(dtype="float32", device="cpu", not_an_option=1)
