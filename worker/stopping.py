"""When a request is finished, and how much of its text may be streamed now (vLLM semantics).

One `StopChecker` per request. Each step the engine passes the new token id and the text the
incremental detokenizer appended for it:

    delta = detokenizer.append(token_id)
    step = stop_checker.append(token_id, delta)
    stream(step.text_delta)
    if step.finished:
        stream(stop_checker.flush(detokenizer.finish()))  # bytes of a character left incomplete

Rules, checked in vLLM's order once more than `min_tokens` tokens exist (the sampler masks EOS
and stop ids for the first `min_tokens` positions, so a stop is always the (min_tokens+1)-th
token or later):
1. EOS (unless `ignore_eos`): STOP, `stop_reason` None (as vLLM).
2. A token in `stop_token_ids`: STOP, `stop_reason` the id.
3. A stop string in the text, possibly spanning tokens: STOP, `stop_reason` the string; the text
   is cut at the start of the stop string, or after it with `include_stop_str_in_output`. Where
   several stop strings complete in one step the earliest in the text wins (vLLM takes the first
   in the list; the earliest is what a user reading the text expects).
4. `max_tokens` tokens, or the model's context (`max_model_len`) full: LENGTH.
The text of a stop token (EOS or a stop id; empty when special tokens are skipped) is dropped unless
`include_stop_str_in_output`, as vLLM's v0 StopChecker does.

Streaming: while unfinished, the last max(len(stop))-1 characters are withheld because they could
still turn into the start of a stop string (nothing is withheld when the stop string would be
kept anyway, or without stop strings). On finish everything up to the cut is released.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from worker.sampling import SamplingParams


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class StopCheckerError(RuntimeError):
    """The checker was used out of order (a token after the request finished, a flush before)."""


@dataclass(frozen=True)
class StopStep:
    """The outcome of one token: text that may be streamed now, and the finish if any."""

    text_delta: str
    finish_reason: FinishReason | None
    # The stop token id or the stop string that matched; None for EOS, LENGTH, or not finished.
    stop_reason: int | str | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        *,
        prompt_len: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
        if max_model_len is not None and max_model_len <= prompt_len:
            raise ValueError(f"max_model_len {max_model_len} leaves no room after a prompt of {prompt_len}")
        self._params = params
        self._eos_token_ids = frozenset(eos_token_ids)
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._prompt_len = prompt_len
        self._max_model_len = max_model_len
        self._withhold_chars = (
            max(len(s) for s in params.stop) - 1
            if params.stop and not params.include_stop_str_in_output
            else 0
        )
        self._text = ""
        self._streamed_chars = 0
        self._num_tokens = 0
        self._finish_reason: FinishReason | None = None
        self._stop_reason: int | str | None = None
        self._cut_at_stop_string = False

    # ---- state ---------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """The output text so far (cut at the stop string once finished by one)."""
        return self._text

    @property
    def num_output_tokens(self) -> int:
        return self._num_tokens

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self._stop_reason

    @property
    def withheld_text(self) -> str:
        """Text produced but not yet released for streaming."""
        return self._text[self._streamed_chars :]

    # ---- steps ---------------------------------------------------------------------------

    def append(self, token_id: int, text_delta: str) -> StopStep:
        if self.finished:
            raise StopCheckerError(f"token {token_id} appended after the request finished")
        params = self._params
        self._num_tokens += 1
        self._text += text_delta
        if self._num_tokens > params.min_tokens:
            if not params.ignore_eos and token_id in self._eos_token_ids:
                self._finish_on_stop_token(FinishReason.STOP, None, text_delta)
            elif token_id in self._stop_token_ids:
                self._finish_on_stop_token(FinishReason.STOP, token_id, text_delta)
            elif params.stop and text_delta:
                self._check_stop_strings(len(text_delta))
        if not self.finished and (
            self._num_tokens >= params.max_tokens
            or (self._max_model_len is not None and self._prompt_len + self._num_tokens >= self._max_model_len)
        ):
            self._finish_reason = FinishReason.LENGTH
        return StopStep(self._release(), self._finish_reason, self._stop_reason)

    def flush(self, text_tail: str) -> str:
        """Append the detokenizer's final flush after the finish; returns the text to stream.

        The tail lies after any stop string, so it is dropped when a stop string ended the text.
        """
        if not self.finished:
            raise StopCheckerError("flush before the request finished")
        if not self._cut_at_stop_string:
            self._text += text_tail
        return self._release()

    def _finish_on_stop_token(self, reason: FinishReason, stop_reason: int | None, text_delta: str) -> None:
        self._finish_reason = reason
        self._stop_reason = stop_reason
        if text_delta and not self._params.include_stop_str_in_output:
            self._text = self._text[: -len(text_delta)]

    def _check_stop_strings(self, new_chars: int) -> None:
        text = self._text
        best: tuple[int, str] | None = None
        for stop in self._params.stop:
            # Only where the new text could complete it: the new chars plus len(stop)-1 before them.
            start = max(0, len(text) - new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, stop = best
        cut = index + len(stop) if self._params.include_stop_str_in_output else index
        if cut < self._streamed_chars:
            # The withholding rule makes this impossible; stop rather than contradict streamed text.
            raise StopCheckerError(f"stop string {stop!r} starts inside text already streamed")
        self._text = text[:cut]
        self._finish_reason = FinishReason.STOP
        self._stop_reason = stop
        self._cut_at_stop_string = True

    def _release(self) -> str:
        limit = len(self._text) if self.finished else len(self._text) - self._withhold_chars
        if limit <= self._streamed_chars:
            return ""
        released = self._text[self._streamed_chars : limit]
        self._streamed_chars = limit
        return released
