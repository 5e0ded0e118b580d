"""OpenAI request bodies -> validated router requests, with the gRPC front end's rules.

A completions or chat body becomes a `Plan`: one `ClientRequest` per (prompt, choice), each
already tokenized and checked against the model's limits (`validated=True`), so the router takes
them as they are. The checks are cluster/frontend/convert.py's (prompt length and vocabulary,
request ids under worker/kv_transfer/ids.py's rule) and `SamplingParams`' own; a violation is
`RequestValidationError` naming the body's field ("temperature", "messages[1].content[0].type").

Fields the engine cannot honour (tools, logit_bias, a response_format other than text, suffix,
best_of other than n) are refused by name rather than ignored: a client that relies on them must
learn that they did nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.frontend.convert import (
    DEFAULT_MAX_TOKENS,
    MAX_PROMPT_TEXT_BYTES,
    ModelLimits,
    RequestValidationError,
    check_prompt_length,
    check_request_id,
)
from cluster.frontend.openai_schema import ChatCompletionRequest, ChatMessage, CompletionRequest
from cluster.router.api import ClientRequest
from worker.sampling import MAX_SEED, InvalidSamplingParams, SamplingParams
from worker.tokenizer import ChatTemplateError, chat_prompt_ids

MAX_CHOICES = 128  # n
MAX_BATCH_PROMPTS = 256
REQUEST_ID_HEADER = "X-Request-Id"
# Choice i > 0 of a seeded request samples with seed + i * this (mod 2**63): independent streams,
# and the same seed always gives the same n texts.
_SEED_STRIDE = 0x9E3779B97F4A7C15

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_FIELDS = ("top_k", "seed", "min_tokens")


class ModelNotFound(LookupError):
    """The body names a model this server does not serve (404)."""


@dataclass(frozen=True)
class Choice:
    index: int  # the choice's index in the response: prompt_index * n + i
    prompt_index: int
    request: ClientRequest


@dataclass(frozen=True)
class Plan:
    """What one completions or chat body asks for, validated."""

    choices: tuple[Choice, ...]
    prompts: tuple[tuple[int, ...], ...]
    stream: bool
    include_usage: bool
    return_timeline: bool
    logprobs: int | None  # top alternatives per token; None: no logprobs
    echo_texts: tuple[str, ...] = ()  # completions' echo: each prompt's text, put before its choices
    return_token_ids: bool = False


class ChatFormatter:
    """Messages -> prompt token ids with the served model's chat template, or `template`, which
    overrides it (`--chat-template FILE`); worker/tokenizer.py's chat_prompt_ids renders them, in
    jinja2's sandbox."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._template = template

    def encode(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return chat_prompt_ids(
            self._tokenizer, messages, add_generation_prompt=add_generation_prompt, template=self._template
        )


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """String content, or the texts of `{"type": "text"}` parts joined; any other part is refused."""
    if not messages:
        raise RequestValidationError("messages", "must not be empty")
    out = []
    for index, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if part.type != "text":
                    raise RequestValidationError(
                        f"messages[{index}].content[{part_index}].type",
                        f'only {{"type": "text", "text": ...}} parts are supported, got type {part.type!r}',
                    )
                if part.text is None:
                    raise RequestValidationError(f"messages[{index}].content[{part_index}].text", "a text part needs its text")
                texts.append(part.text)
            content = "".join(texts)
        out.append({"role": message.role, "content": content or ""})
    return out


def check_model(name: str, served: str) -> None:
    if name != served:
        raise ModelNotFound(f"the model `{name}` does not exist; this server serves `{served}`")


def _refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.tools:
        raise RequestValidationError("tools", "tool calling is not supported")
    if body.functions:
        raise RequestValidationError("functions", "function calling is not supported")
    if body.tool_choice not in (None, "none"):
        raise RequestValidationError("tool_choice", "tool calling is not supported")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise RequestValidationError("response_format", "only {\"type\": \"text\"} is supported")
    if body.logit_bias:
        raise RequestValidationError("logit_bias", "is not supported")
    if body.suffix:
        raise RequestValidationError("suffix", "is not supported")
    if body.best_of is not None and body.best_of != body.n:
        raise RequestValidationError("best_of", f"only best_of == n is supported, got best_of {body.best_of}, n {body.n}")
    if not 1 <= body.n <= MAX_CHOICES:
        raise RequestValidationError("n", f"must be in [1, {MAX_CHOICES}], got {body.n}")


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice 0 keeps the request's seed (n=1 samples as the gRPC API does); the others derive theirs."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice * _SEED_STRIDE) % (MAX_SEED + 1)


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    max_tokens_field: str,
    logprobs: int | None,
    logprobs_field: str,
    vocab_size: int,
) -> SamplingParams:
    """The body's sampling fields; a range error names the body's field."""
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "stop": () if body.stop is None else body.stop,
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "ignore_eos": body.ignore_eos,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
        "logprobs": logprobs,
    }
    for name in _FLOAT_FIELDS:
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = float(value)
    for name in _INT_FIELDS:
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    renamed = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}
    try:
        params = SamplingParams(**kwargs)
        params.validate_against(vocab_size)
    except InvalidSamplingParams as error:
        raise RequestValidationError(renamed.get(error.field, error.field), error.message) from None
    return params


def _prompts_of(body: CompletionRequest, limits: ModelLimits, tokenize: Callable[[str], list[int]]) -> list[tuple[int, ...]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(item, int) for item in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise RequestValidationError("prompt", "must not be empty")
    if len(items) > MAX_BATCH_PROMPTS:
        raise RequestValidationError("prompt", f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(items)}")
    field_of = (lambda i: "prompt") if len(items) == 1 else (lambda i: f"prompt[{i}]")
    prompts = []
    for index, item in enumerate(items):
        field = field_of(index)
        if isinstance(item, str):
            if not item:
                raise RequestValidationError(field, "must not be empty")
            size = len(item.encode("utf-8"))
            if size > MAX_PROMPT_TEXT_BYTES:
                raise RequestValidationError(field, f"must be at most {MAX_PROMPT_TEXT_BYTES} bytes of UTF-8, got {size}")
            ids = tuple(tokenize(item))
            if not ids:
                raise RequestValidationError(field, "tokenizes to no tokens")
        else:
            ids = tuple(item)
            if not ids:
                raise RequestValidationError(field, "must not be empty")
            largest, smallest = max(ids), min(ids)
            if smallest < 0 or largest >= limits.vocab_size:
                bad = smallest if smallest < 0 else largest
                raise RequestValidationError(field, f"id {bad} is outside the vocabulary of {limits.vocab_size}")
        check_prompt_length(len(ids), field, limits)
        prompts.append(ids)
    return prompts


def _choices(
    prompts: Sequence[tuple[int, ...]],
    body: CompletionRequest | ChatCompletionRequest,
    params_for: Callable[[tuple[int, ...]], SamplingParams],
    request_id: str | None,
    timeout_s: float | None,
) -> tuple[Choice, ...]:
    base = None if request_id is None else check_request_id(request_id, REQUEST_ID_HEADER)
    total = len(prompts) * body.n
    choices = []
    for prompt_index, prompt in enumerate(prompts):
        params = params_for(prompt)
        for i in range(body.n):
            index = prompt_index * body.n + i
            client_id = None
            if base is not None:
                # One request keeps the client's id; a batch's or n's requests each get a derived
                # one, under the same rule (so that each can be found and aborted by its id).
                client_id = base if total == 1 else check_request_id(f"{base}-{index}", REQUEST_ID_HEADER)
            seeded = params if params.seed is None else params.with_seed(choice_seed(params.seed, i))
            choices.append(
                Choice(
                    index,
                    prompt_index,
                    ClientRequest(
                        prompt_text=None,
                        prompt_token_ids=prompt,
                        sampling=seeded,
                        client_request_id=client_id,
                        timeout_s=timeout_s,
                        validated=True,
                    ),
                )
            )
    return tuple(choices)


def _check_context(prompt: tuple[int, ...], max_tokens: int, field: str, limits: ModelLimits) -> None:
    if len(prompt) + max_tokens > limits.max_seq_len:
        raise RequestValidationError(
            field,
            f"prompt ({len(prompt)} tokens) + {field} ({max_tokens}) exceeds the model's context of "
            f"{limits.max_seq_len} tokens",
        )


def completion_plan(
    body: CompletionRequest,
    limits: ModelLimits,
    tokenize: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
    *,
    request_id: str | None = None,
    timeout_s: float | None = None,
) -> Plan:
    _refuse_unsupported(body)
    if body.echo and body.logprobs is not None:
        raise RequestValidationError("echo", "echo with logprobs needs prompt logprobs, which this server does not compute")
    prompts = _prompts_of(body, limits, tokenize)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens

    def params_for(prompt: tuple[int, ...]) -> SamplingParams:
        params = sampling_params(
            body,
            max_tokens=max_tokens,
            max_tokens_field="max_tokens",
            logprobs=body.logprobs,
            logprobs_field="logprobs",
            vocab_size=limits.vocab_size,
        )
        _check_context(prompt, params.max_tokens, "max_tokens", limits)
        return params

    choices = _choices(prompts, body, params_for, request_id, timeout_s)
    echo_texts: tuple[str, ...] = ()
    if body.echo:
        prompt = body.prompt
        texts = [prompt] if isinstance(prompt, str) else None
        if texts is None and all(isinstance(item, str) for item in prompt):
            texts = list(prompt)  # type: ignore[arg-type]
        echo_texts = tuple(texts) if texts is not None else tuple(decode(ids) for ids in prompts)
    return Plan(
        choices=choices,
        prompts=tuple(prompts),
        stream=body.stream,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        return_timeline=body.return_timeline,
        logprobs=body.logprobs,
        echo_texts=echo_texts,
        return_token_ids=body.return_token_ids,
    )


def chat_plan(
    body: ChatCompletionRequest,
    limits: ModelLimits,
    formatter: ChatFormatter,
    *,
    request_id: str | None = None,
    timeout_s: float | None = None,
) -> Plan:
    _refuse_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestValidationError("top_logprobs", "needs logprobs: true")
    messages = chat_messages(body.messages)
    try:
        prompt = tuple(formatter.encode(messages, body.add_generation_prompt))
    except ChatTemplateError as error:
        raise RequestValidationError("messages", str(error)) from None
    if not prompt:
        raise RequestValidationError("messages", "render to no tokens")
    check_prompt_length(len(prompt), "messages", limits)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # Chat's default is the rest of the context, as vLLM's.
    max_tokens = limits.max_seq_len - len(prompt) if requested is None else requested
    logprobs = (body.top_logprobs or 0) if body.logprobs else None

    def params_for(ids: tuple[int, ...]) -> SamplingParams:
        params = sampling_params(
            body,
            max_tokens=max_tokens,
            max_tokens_field=field,
            logprobs=logprobs,
            logprobs_field="top_logprobs",
            vocab_size=limits.vocab_size,
        )
        _check_context(ids, params.max_tokens, field, limits)
        return params

    return Plan(
        choices=_choices((prompt,), body, params_for, request_id, timeout_s),
        prompts=(prompt,),
        stream=body.stream,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        return_timeline=body.return_timeline,
        logprobs=logprobs,
        return_token_ids=body.return_token_ids,
    )
