"""The offline API of one instance, as users of vLLM know it.

    from worker import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model, no download
    outputs = llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].text)

`LLM(model=None, *, dtype="auto", device="auto", **engine_options)`: `model` is None for the
embedded default or a local Hugging Face checkpoint directory; `engine_options` are fields of
`EngineConfig` (e.g. `tokens_per_block=16`, `capacity_policy="MAX_UTILIZATION"`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine import Engine
from worker.engine_types import EngineConfig
from worker.protocol import EngineInputError, RequestOutput, SubmitRequest
from worker.sampler import SampleLogprobs
from worker.sampling import SamplingParams
from worker.stopping import FinishReason
from worker.tokenizer import ChatMessages, chat_prompt_ids

PromptInput = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort" or "error" (vLLM's strings)
    stop_reason: int | str | None
    logprobs: list[SampleLogprobs] | None
    num_cached_tokens: int


def _normalise_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise EngineInputError("prompts", "give a string, a list of strings, a list of token ids, or a list of such lists")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]  # one prompt of token ids
    normalised: list[PromptInput] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            normalised.append(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            normalised.append(list(prompt))
        else:
            raise EngineInputError(f"prompts[{index}]", "must be a string or a list of token ids")
    return normalised


class LLM:
    def __init__(self, model: str | Path | None = None, *, dtype: str = "auto", device: str = "auto", **engine_options) -> None:
        if model is None:
            from worker.default_model import build_default_model

            decoder, tokenizer, generation_config = build_default_model(dtype=dtype, device=device)
        else:
            from worker.loader import load_model

            decoder, tokenizer, generation_config = load_model(model, dtype=dtype, device=device)
        config = EngineConfig().with_overrides(**engine_options)
        self.engine = Engine(decoder, tokenizer, config, generation_config=generation_config, instance_id="llm")
        self.tokenizer = tokenizer
        self._counter = 0

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[CompletionOutput]:
        """Generate the assistant's reply to a conversation (a list of {"role", "content"}) or to
        each of a list of conversations, rendered with the model's chat template (or
        `chat_template`, which overrides it) exactly as the front ends render them."""
        conversations = [messages] if _is_conversation(messages) else list(messages)  # type: ignore[list-item]
        prompts = [
            chat_prompt_ids(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt, template=chat_template)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; one output per prompt, in order."""
        items = _normalise_prompts(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise EngineInputError("sampling_params", f"{len(params_list)} given for {len(items)} prompts")
        request_ids = []
        texts: dict[str, str | None] = {}
        prompt_ids: dict[str, list[int]] = {}
        for prompt, params in zip(items, params_list, strict=True):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            try:
                self.engine.add_request(SubmitRequest(request_id, tuple(ids), params))
            except Exception:
                # All or nothing: what this call queued already must not run on unseen.
                for queued in request_ids:
                    self.engine.abort(queued, "another prompt of the same call was refused")
                while self.engine.has_work():
                    self.engine.step()
                raise
            request_ids.append(request_id)
            texts[request_id] = prompt if isinstance(prompt, str) else None
            prompt_ids[request_id] = ids
        collected: dict[str, list[RequestOutput]] = {rid: [] for rid in request_ids}
        pending = set(request_ids)
        with torch.inference_mode():
            while pending:
                for output in self.engine.step():
                    if output.request_id in collected:
                        collected[output.request_id].append(output)
                        if output.finished:
                            pending.discard(output.request_id)
        results = []
        for request_id in request_ids:
            parts = collected[request_id]
            final = parts[-1]
            logprobs = [lp for part in parts for lp in part.logprobs] if parts and parts[0].logprobs else None
            reason = final.finish_reason
            results.append(
                CompletionOutput(
                    prompt=texts[request_id],
                    prompt_token_ids=prompt_ids[request_id],
                    token_ids=[t for part in parts for t in part.new_token_ids],
                    text="".join(part.text_delta for part in parts),
                    finish_reason=reason.value if isinstance(reason, FinishReason) else None,
                    stop_reason=final.stop_reason,
                    logprobs=logprobs,
                    num_cached_tokens=final.num_cached_tokens,
                )
            )
        return results


def _is_conversation(value: object) -> bool:
    """One conversation (a sequence of mappings), as opposed to a sequence of conversations."""
    return isinstance(value, Sequence) and bool(value) and all(isinstance(item, Mapping) for item in value)
