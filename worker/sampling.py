"""Per-request sampling parameters: vLLM's names, defaults and validation ranges.

No torch here: the cluster front end validates requests with this module before anything reaches a
worker, and a `SamplingParams` crosses to an instance as a typed field of worker/protocol.py's
SubmitRequest (the instance's decoder runs `__post_init__` again). `to_dict` / `from_dict` are a
plain-dict view for JSON and other tools.

Notes for users coming from vLLM:
- `top_k`: -1 (the default) and 0 both mean "off"; any value >= 1 keeps the k most likely tokens
  (ties at the k-th value are kept, as in vLLM).
- `temperature`: 0 means greedy. Like vLLM, a positive temperature below `MIN_TEMPERATURE` is raised
  to it (with a warning): dividing logits by a tinier value overflows float32.
- `seed`: None means "let the engine pick one"; the engine assigns a seed at admission
  (`with_seed`) so a request replays identically after a pause, a recompute or a recovery.
- `stop` accepts a single string, a list, or None; it is stored as a tuple. `stop_token_ids`
  likewise (a list or None).
- `logprobs`: how many top logprobs to return per generated token (the sampled token's logprob
  is always returned in addition); None returns none.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MIN_TEMPERATURE = 1e-2
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
# Size limits: parameters arrive from network clients, and every stop string is searched on
# every step and withholds up to len(stop)-1 characters of streamed text.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKENS_LIMIT = 1 << 24


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range or of the wrong type; `.field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # Also accepts a str or a list of str; normalised to a tuple in __post_init__.
    stop: tuple[str, ...] = ()
    # Also accepts a list of int; normalised to a tuple in __post_init__.
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._check_int("max_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
        self._check_float("temperature")
        if self.temperature < 0.0:
            raise InvalidSamplingParams("temperature", f"must be >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s; raised to %s to avoid overflow",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        self._check_int("top_k")
        if self.top_k < -1:
            raise InvalidSamplingParams("top_k", f"must be -1 or 0 (off) or >= 1, got {self.top_k}")
        self._check_float("top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams("top_p", f"must be in (0, 1], got {self.top_p}")
        self._check_float("min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams("min_p", f"must be in [0, 1], got {self.min_p}")
        self._check_float("repetition_penalty")
        if self.repetition_penalty <= 0.0:
            raise InvalidSamplingParams(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            self._check_float(name)
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidSamplingParams(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None:
            self._check_int("seed", minimum=0, maximum=MAX_SEED)
        self._normalise_stop()
        self._normalise_stop_token_ids()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            self._check_int("logprobs", minimum=0, maximum=MAX_LOGPROBS)
        self._check_int("min_tokens", minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams(
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )

    def _check_int(self, name: str, minimum: int | None = None, maximum: int | None = None) -> None:
        value = getattr(self, name)
        if not _is_int(value):
            raise InvalidSamplingParams(name, f"must be an int, got {value!r}")
        if minimum is not None and value < minimum:
            raise InvalidSamplingParams(name, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise InvalidSamplingParams(name, f"must be <= {maximum}, got {value}")

    def _check_float(self, name: str) -> None:
        value = getattr(self, name)
        if not _is_number(value):
            raise InvalidSamplingParams(name, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise InvalidSamplingParams(name, f"must be finite, got {value}")
        object.__setattr__(self, name, float(value))

    def _normalise_stop(self) -> None:
        stop: Any = self.stop
        if stop is None:  # JSON clients send null for "no stop strings", as vLLM accepts
            stop = ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise InvalidSamplingParams("stop", f"must be a str or a list of str, got {type(stop).__name__}")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidSamplingParams("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for item in stop:
            if not isinstance(item, str):
                raise InvalidSamplingParams("stop", f"stop strings must be str, got {item!r}")
            if not item:
                raise InvalidSamplingParams("stop", "stop strings must not be empty")
            if len(item) > MAX_STOP_STRING_CHARS:
                raise InvalidSamplingParams(
                    "stop", f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters"
                )
        object.__setattr__(self, "stop", tuple(stop))

    def _normalise_stop_token_ids(self) -> None:
        ids: Any = self.stop_token_ids
        if ids is None:
            ids = ()
        if not isinstance(ids, (list, tuple)):
            raise InvalidSamplingParams(
                "stop_token_ids", f"must be a list of int, got {type(ids).__name__}"
            )
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidSamplingParams(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
            )
        for item in ids:
            if not _is_int(item) or item < 0:
                raise InvalidSamplingParams(
                    "stop_token_ids", f"must be non-negative ints, got {item!r}"
                )
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    # ---- derived views -------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        """Temperature 0: the sampler takes the argmax of the penalised logits."""
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int | None:
        """The k of top-k, or None when off (top_k of -1 or 0)."""
        return self.top_k if self.top_k >= 1 else None

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate_against(self, vocab_size: int) -> None:
        """Check the parameters that depend on the model's vocabulary."""
        if not _is_int(vocab_size) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise InvalidSamplingParams(
                    "stop_token_ids", f"id {token_id} is outside the vocabulary of {vocab_size}"
                )

    def with_seed(self, seed: int) -> SamplingParams:
        return dataclasses.replace(self, seed=seed)

    # ---- transport ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (lists, not tuples), so msgpack and JSON both carry it."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from `to_dict()` output; missing keys take defaults, unknown keys are an error."""
        if not isinstance(data, Mapping):
            raise InvalidSamplingParams("<root>", f"must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise InvalidSamplingParams(str(key), "unknown sampling parameter")
        return cls(**dict(data))
