"""Seeded request generators: fixed and log-normal lengths, shared-prefix groups, multi-turn
conversations and ShareGPT files.

A workload is a tuple of `BenchRequest`s in dispatch order. Prompts are token ids (drawn from
`token_range`, printable ASCII by default, which is valid in the built-in byte vocabulary and in any
real one) so that input lengths are exact; ShareGPT prompts are text the server tokenizes. A
multi-turn request names the turn it follows (`after`): the runner sends that turn's prompt and
output followed by this request's tokens, so every turn resends its conversation's history.

    requests = build_workload(WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, num_prefixes=4), seed=0)
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from scheduler.config import positive_int

logger = logging.getLogger(__name__)

# ShareGPT filters, as vLLM's: drop tiny pairs, cap lengths (in estimated tokens).
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048
# Warm-up workloads are drawn with seed + this, so their prompts never coincide with measured ones.
WARMUP_SEED_OFFSET = 1_000_003
# A dataset file is read whole: refuse anything absurd before reading it.
MAX_DATASET_BYTES = 2 * 1024 * 1024 * 1024


class WorkloadError(ValueError):
    """A workload setting or dataset that cannot produce requests; `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class WorkloadKind(Enum):
    FIXED = "fixed"
    LOGNORMAL = "lognormal"
    SHARED_PREFIX = "shared-prefix"
    MULTI_TURN = "multi-turn"
    SHAREGPT = "sharegpt"


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `prompt` is the new content: for a multi-turn request it is
    appended to the history of the turn named by `after` (that turn's prompt and output)."""

    index: int
    prompt: tuple[int, ...] | str
    max_tokens: int
    conversation: int | None = None  # multi-turn: which conversation
    turn: int = 0
    after: int | None = None  # index of the request whose prompt + output this one extends
    group: int | None = None  # shared-prefix: which prefix

    @property
    def new_prompt_tokens(self) -> int | None:
        """Length of the new content in tokens (None for text, which the server tokenizes)."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


@dataclass(frozen=True)
class SharegptPair:
    """The first human turn of a ShareGPT conversation and the reply to it."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class WorkloadConfig:
    """Lengths are in tokens. `input_len` is the whole prompt (fixed, log-normal mean), the suffix
    after the shared prefix (shared-prefix), or each turn's new user message (multi-turn)."""

    kind: WorkloadKind = WorkloadKind.FIXED
    num_requests: int = 100  # shared-prefix sends num_prefixes x suffixes_per_prefix instead
    input_len: int = 128
    output_len: int = 64
    lognormal_sigma: float = 0.5  # sigma of the underlying normal; the mean stays input/output_len
    max_input_len: int = 2048  # log-normal draws are clamped to [1, max]
    max_output_len: int = 1024
    num_prefixes: int = 4
    prefix_len: int = 256
    suffixes_per_prefix: int = 8
    turns: int = 4
    dataset_path: str | None = None
    # ShareGPT lengths are estimated client-side (the client has no tokenizer): UTF-8 bytes per
    # token. 4 suits BPE vocabularies on English; the built-in byte tokenizer is exactly 1.
    sharegpt_bytes_per_token: float = 4.0
    token_range: tuple[int, int] = (32, 127)  # [low, high) of drawn token ids

    def __post_init__(self) -> None:
        if not isinstance(self.kind, WorkloadKind):
            raise WorkloadError("kind", f"must be a WorkloadKind, got {self.kind!r}")
        for name in ("num_requests", "input_len", "output_len", "max_input_len", "max_output_len",
                     "num_prefixes", "prefix_len", "suffixes_per_prefix", "turns"):
            positive_int(name, getattr(self, name), WorkloadError)
        for name in ("lognormal_sigma", "sharegpt_bytes_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise WorkloadError(name, f"must be a positive number, got {value!r}")
        low, high = self.token_range
        if not (isinstance(low, int) and isinstance(high, int) and 0 <= low < high):
            raise WorkloadError("token_range", f"must be [low, high) with 0 <= low < high, got {self.token_range!r}")
        if self.kind is WorkloadKind.SHAREGPT and not self.dataset_path:
            raise WorkloadError("dataset_path", "the sharegpt workload needs a dataset file")

    @property
    def total_requests(self) -> int:
        if self.kind is WorkloadKind.SHARED_PREFIX:
            return self.num_prefixes * self.suffixes_per_prefix
        return self.num_requests


def warmup_config(config: WorkloadConfig, count: int) -> WorkloadConfig:
    """A warm-up workload like `config` with `count` requests (shared-prefix: plain prompts of the
    same total length, so that the warm-up caches no prefix a measured request would hit)."""
    if config.kind is WorkloadKind.SHARED_PREFIX:
        return replace(config, kind=WorkloadKind.FIXED, num_requests=count, input_len=config.prefix_len + config.input_len)
    return replace(config, num_requests=count)


def _tokens(rng: random.Random, count: int, token_range: tuple[int, int]) -> tuple[int, ...]:
    low, high = token_range
    return tuple(rng.randrange(low, high) for _ in range(count))


def lognormal_length(rng: random.Random, mean: int, sigma: float, maximum: int) -> int:
    """A log-normal draw whose mean is `mean` (mu = ln(mean) - sigma^2 / 2), clamped to [1, maximum]."""
    mu = math.log(mean) - sigma * sigma / 2.0
    return max(1, min(maximum, int(round(rng.lognormvariate(mu, sigma)))))


def build_workload(
    config: WorkloadConfig, seed: int, dataset: Sequence[SharegptPair] | None = None
) -> tuple[BenchRequest, ...]:
    """The requests of `config`, the same for the same seed. ShareGPT needs `dataset`
    (`load_sharegpt(config.dataset_path)`); reading files is the caller's job."""
    rng = random.Random(seed)
    kind = config.kind
    if kind is WorkloadKind.FIXED:
        return tuple(
            BenchRequest(i, _tokens(rng, config.input_len, config.token_range), config.output_len)
            for i in range(config.num_requests)
        )
    if kind is WorkloadKind.LOGNORMAL:
        requests = []
        for i in range(config.num_requests):
            input_len = lognormal_length(rng, config.input_len, config.lognormal_sigma, config.max_input_len)
            output_len = lognormal_length(rng, config.output_len, config.lognormal_sigma, config.max_output_len)
            requests.append(BenchRequest(i, _tokens(rng, input_len, config.token_range), output_len))
        return tuple(requests)
    if kind is WorkloadKind.SHARED_PREFIX:
        return _shared_prefix(config, rng)
    if kind is WorkloadKind.MULTI_TURN:
        return _multi_turn(config, rng)
    if dataset is None:
        raise WorkloadError("dataset", "the sharegpt workload needs the loaded dataset (load_sharegpt)")
    return _sharegpt(config, rng, dataset)


def _shared_prefix(config: WorkloadConfig, rng: random.Random) -> tuple[BenchRequest, ...]:
    prefixes = [_tokens(rng, config.prefix_len, config.token_range) for _ in range(config.num_prefixes)]
    pairs = [(group, suffix) for group in range(config.num_prefixes) for suffix in range(config.suffixes_per_prefix)]
    # Shuffled, so that no policy gets the groups in an order that happens to suit it (round robin
    # over N instances with N prefixes in strict rotation would look like perfect affinity).
    rng.shuffle(pairs)
    return tuple(
        BenchRequest(
            index,
            prefixes[group] + _tokens(rng, config.input_len, config.token_range),
            config.output_len,
            group=group,
        )
        for index, (group, _suffix) in enumerate(pairs)
    )


def _multi_turn(config: WorkloadConfig, rng: random.Random) -> tuple[BenchRequest, ...]:
    """ceil(num_requests / turns) conversations, the last one cut short so that exactly
    num_requests requests are sent; ordered turn by turn (every conversation's first turn, then
    every second turn, ...), so a later turn rarely waits for its predecessor to finish. Within a
    turn the conversations come in a seeded random order: in a fixed order, round robin over as
    many instances as divide the number of conversations would send every turn of a conversation
    to the same instance and look cache-aware."""
    conversations = math.ceil(config.num_requests / config.turns)
    lengths = [config.turns] * conversations
    lengths[-1] = config.num_requests - config.turns * (conversations - 1)
    requests: list[BenchRequest] = []
    last_index: dict[int, int] = {}
    for turn in range(config.turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for conversation in order:
            if turn >= lengths[conversation]:
                continue
            index = len(requests)
            requests.append(
                BenchRequest(
                    index,
                    _tokens(rng, config.input_len, config.token_range),
                    config.output_len,
                    conversation=conversation,
                    turn=turn,
                    after=last_index.get(conversation),
                )
            )
            last_index[conversation] = index
    return tuple(requests)


def estimated_tokens(text: str, bytes_per_token: float) -> int:
    return max(1, math.ceil(len(text.encode("utf-8")) / bytes_per_token))


def _sharegpt(config: WorkloadConfig, rng: random.Random, dataset: Sequence[SharegptPair]) -> tuple[BenchRequest, ...]:
    usable = []
    for pair in dataset:
        prompt_len = estimated_tokens(pair.prompt, config.sharegpt_bytes_per_token)
        output_len = min(config.max_output_len, estimated_tokens(pair.completion, config.sharegpt_bytes_per_token))
        if prompt_len < SHAREGPT_MIN_TOKENS or output_len < SHAREGPT_MIN_TOKENS:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_TOKENS or prompt_len + output_len > SHAREGPT_MAX_TOTAL_TOKENS:
            continue
        usable.append((pair.prompt, output_len))
    if not usable:
        raise WorkloadError("dataset", "no conversation in the dataset passes the length filters")
    order = list(range(len(usable)))
    rng.shuffle(order)
    if len(order) < config.num_requests:
        logger.warning(
            "the dataset has %d usable conversations for %d requests: some are sent more than once",
            len(order), config.num_requests,
        )
    return tuple(
        BenchRequest(i, usable[order[i % len(order)]][0], usable[order[i % len(order)]][1])
        for i in range(config.num_requests)
    )


def parse_sharegpt(data: object) -> tuple[SharegptPair, ...]:
    """ShareGPT JSON: a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}.
    The first two turns of each conversation with at least two are used (as vLLM does)."""
    if not isinstance(data, list):
        raise WorkloadError("dataset", f"expected a JSON list of conversations, got {type(data).__name__}")
    pairs = []
    for position, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise WorkloadError(f"dataset[{position}]", "expected an object with a 'conversations' list")
        turns = entry["conversations"]
        if len(turns) < 2:
            continue
        texts = []
        for turn_index, turn in enumerate(turns[:2]):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise WorkloadError(f"dataset[{position}].conversations[{turn_index}]", "expected an object with a string 'value'")
            texts.append(turn["value"])
        pairs.append(SharegptPair(prompt=texts[0], completion=texts[1]))
    return tuple(pairs)


def load_sharegpt(path: str | Path) -> tuple[SharegptPair, ...]:
    path = Path(path)
    try:
        size_bytes = path.stat().st_size
        if size_bytes > MAX_DATASET_BYTES:
            raise WorkloadError("dataset", f"{path} is {size_bytes} bytes; the limit is {MAX_DATASET_BYTES}")
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise WorkloadError("dataset", f"cannot read {path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WorkloadError("dataset", f"{path} is not JSON: {error}") from None
    return parse_sharegpt(data)
