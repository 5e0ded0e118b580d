"""Router events -> OpenAI response bodies and stream chunks (plain dicts, serialised once by the
HTTP front end), and OpenAI's error shape.

Token strings for logprobs are each token decoded alone, special tokens kept (as vLLM shows them).
A position without logprobs inside a delta that has some gets a null logprob, never NaN (JSON has
no NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.router.api import ErrorKind, FinalEvent, RouterError, TokenEvent
from worker.sampler_types import SampleLogprobs

# HTTP status per router error kind. DEADLINE_EXCEEDED and ABORTED are not the client's input.
_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.ALREADY_EXISTS: 409,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.ABORTED: 503,
    ErrorKind.DEADLINE_EXCEEDED: 504,
    ErrorKind.CANCELLED: 499,
    ErrorKind.INTERNAL: 500,
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def status_for(error: RouterError) -> int:
    return _STATUS[error.kind]


def router_error_body(error: RouterError) -> tuple[int, dict[str, Any]]:
    status = status_for(error)
    message = f"{error.field}: {error.message}" if error.field else error.message
    param = "X-Request-Id" if error.field == "client_request_id" else error.field
    return status, error_body(status, message, param, error.kind.value)


def final_error(event: FinalEvent) -> tuple[int, dict[str, Any]] | None:
    """The HTTP error of a request that failed (None when it ended normally)."""
    if event.error_kind is None:
        return None
    status = _STATUS[event.error_kind]
    return status, error_body(status, event.error_message or event.error_kind.value, None, event.error_kind.value)


class TokenTexts:
    """Each token id's own text, cached (logprobs name tokens by their text)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id])
        return text


def _logprob(value: float) -> float | None:
    return value if math.isfinite(value) or value == -math.inf else None


@dataclass
class CompletionLogprobs:
    """Completions' logprobs object, grown delta by delta (text offsets continue across deltas)."""

    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, event: TokenEvent, texts: TokenTexts) -> dict[str, Any]:
        """Append the event's tokens; returns the logprobs of just these tokens (a stream chunk's)."""
        start = len(self.tokens)
        entries: Sequence[SampleLogprobs | None] = event.logprobs or (None,) * len(event.token_ids)
        for token_id, entry in zip(event.token_ids, entries, strict=False):
            text = texts(token_id)
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
            else:
                self.token_logprobs.append(_logprob(entry.sampled.logprob))
                self.top_logprobs.append({texts(top.token_id): _logprob(top.logprob) for top in entry.top})
        return self.since(start)

    def since(self, start: int) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }


def chat_logprobs(event: TokenEvent, texts: TokenTexts) -> list[dict[str, Any]]:
    """Chat's logprobs.content entries of one delta."""
    out = []
    entries: Sequence[SampleLogprobs | None] = event.logprobs or (None,) * len(event.token_ids)
    for token_id, entry in zip(event.token_ids, entries, strict=False):
        text = texts(token_id)
        item: dict[str, Any] = {"token": text, "logprob": None, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
        if entry is not None:
            item["logprob"] = _logprob(entry.sampled.logprob)
            item["top_logprobs"] = [
                {"token": (t := texts(top.token_id)), "logprob": _logprob(top.logprob), "bytes": list(t.encode("utf-8"))}
                for top in entry.top
            ]
        out.append(item)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def timeline(request_id: str, index: int, event: FinalEvent) -> dict[str, Any]:
    """Duet's own value: a request's global states with their times and instances, and its hops."""
    return {
        "index": index,
        "request_id": request_id,
        "timeline": [
            {"state": e.state, "time": e.time_s, "instance_id": e.instance_id, "detail": e.detail} for e in event.timeline
        ],
        "instances": [
            {"instance_id": u.instance_id, "role": u.role.name, "phase": u.phase, "attempt": u.attempt}
            for u in event.instances
        ],
    }
