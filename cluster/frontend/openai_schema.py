"""The OpenAI-compatible API's request bodies as pydantic models (the HTTP front end's parse step).

Only shapes and types live here; the rules (ranges, the model's limits, ids) are checked by
cluster/frontend/openai_convert.py with the gRPC front end's own checks. Unknown fields are
ignored, as vLLM does; fields the engine cannot honour are declared so that openai_convert.py can
refuse them by name instead of dropping them silently.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Generation(_Body):
    """What completions and chat share: OpenAI's sampling fields, vLLM's extras, duet's own."""

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # accepted, unused
    # vLLM's extra sampling fields, at the top level as vLLM takes them.
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # duet: the request's global state timeline and the instances it used, in the response.
    return_timeline: StrictBool = False
    # vLLM's: each choice (and each stream chunk) carries its generated token ids.
    return_token_ids: StrictBool = False
    # Declared only to be refused by name when set (openai_convert.py, UNSUPPORTED_FIELDS).
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class CompletionRequest(_Generation):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None


class TextPart(_Body):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Body):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True  # vLLM's


class TokenizeCompletion(_Body):
    """vLLM's POST /tokenize with a prompt."""

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class TokenizeChat(_Body):
    """vLLM's POST /tokenize with messages (rendered with the chat template first)."""

    model: StrictStr | None = None
    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]

