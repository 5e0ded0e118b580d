"""Incremental detokenization: text deltas that never split a UTF-8 character.

Two strategies:
- BYTES (used when the tokenizer has `id_to_bytes`): the raw bytes of each token go through an
  incremental UTF-8 decoder (errors="replace"), which holds back the bytes of an incomplete
  character until it is complete. A token without bytes (a special token, or one the tokenizer
  cannot map) contributes `tokenizer.decode([id], skip_special_tokens)`: when that is empty (a
  skipped special) it is transparent, as in `decode`, which drops skipped specials before it joins
  the bytes; otherwise any held-back bytes are flushed as U+FFFD first and its text follows. The
  tokenizer must return bytes for every ordinary token (byte-fallback pieces included), otherwise
  use OFFSETS.
- OFFSETS (vLLM's prefix/read-offset technique, for tokenizers without byte access): decode a small
  window of ids ending at the newest token and emit the growth of that text over the window
  without the newest tokens, holding back while the decoded text ends in U+FFFD (an incomplete
  character). The window starts a few prompt tokens back so that leading-space rules see context.

Contract: the concatenated deltas plus `finish()` equal `tokenizer.decode(output_ids,
skip_special_tokens)` for tokenizers whose decoding is the concatenation of token bytes (byte-level
BPE, byte tokenizers). For tokenizers that alter text at the start of a sequence (SentencePiece's
leading-space strip), the deltas are the text in the context of the prompt, as vLLM produces.
"""

from __future__ import annotations

import codecs
import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens of context for OFFSETS.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class DetokenizerError(RuntimeError):
    """The detokenizer was used out of order (an append after finish)."""


@runtime_checkable
class DetokenizerTokenizer(Protocol):
    """The part of worker.tokenizer.Tokenizer the detokenizer needs (kept here so this module
    does not depend on the tokenizer implementations)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def id_to_bytes(self, token_id: int) -> bytes | None: ...


class DetokenizeStrategy(enum.Enum):
    AUTO = "auto"
    BYTES = "bytes"
    OFFSETS = "offsets"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: DetokenizerTokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        strategy: DetokenizeStrategy = DetokenizeStrategy.AUTO,
    ) -> None:
        if strategy is DetokenizeStrategy.AUTO:
            # BYTES only where a token's bytes are exactly what decode() yields for it
            # (`exact_token_bytes`; SentencePiece-style decoders strip a leading space, so they
            # are not); everything else uses the OFFSETS technique.
            has_bytes = callable(getattr(tokenizer, "id_to_bytes", None))
            exact = getattr(tokenizer, "exact_token_bytes", True)
            strategy = DetokenizeStrategy.BYTES if has_bytes and exact else DetokenizeStrategy.OFFSETS
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._strategy = strategy
        self._text_parts: list[str] = []
        self._output_ids: list[int] = []
        self._finished = False
        # BYTES state
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # OFFSETS state: ids = context from the prompt + outputs; offsets index into it.
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._window_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def strategy(self) -> DetokenizeStrategy:
        return self._strategy

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back bytes excluded until complete or flushed)."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def output_token_ids(self) -> list[int]:
        return list(self._output_ids)

    def append(self, token_id: int) -> str:
        """Add one output token; returns the newly completed text (possibly "")."""
        if self._finished:
            raise DetokenizerError(f"token {token_id} appended after finish()")
        self._output_ids.append(token_id)
        if self._strategy is DetokenizeStrategy.BYTES:
            delta = self._append_bytes(token_id)
        else:
            delta = self._append_offsets(token_id)
        if delta:
            self._text_parts.append(delta)
        return delta

    def finish(self) -> str:
        """Flush what is held back (incomplete UTF-8 becomes U+FFFD, as decode does); idempotent."""
        if self._finished:
            return ""
        self._finished = True
        if self._strategy is DetokenizeStrategy.BYTES:
            delta = self._utf8.decode(b"", final=True)
        else:
            prefix_text = self._decode(self._window_ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._window_ids[self._prefix_offset :])
            delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        if delta:
            self._text_parts.append(delta)
        return delta

    # ---- strategies ------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _append_bytes(self, token_id: int) -> str:
        raw = self._tokenizer.id_to_bytes(token_id)
        if raw is not None:
            return self._utf8.decode(raw)
        text = self._decode([token_id])
        if not text:
            return ""
        flushed = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return flushed + text

    def _append_offsets(self, token_id: int) -> str:
        self._window_ids.append(token_id)
        prefix_text = self._decode(self._window_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._window_ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            # Drop ids before the new prefix: the window stays a few tokens long.
            del self._window_ids[: self._read_offset]
            self._prefix_offset = 0
            self._read_offset = len(self._window_ids)
            return delta
        return ""
