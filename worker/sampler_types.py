"""Sampling results as plain values (no torch): they travel to the router and the client."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class SampleLogprobs:
    """The sampled token's logprob, its 1-based rank, and the top-n (most likely first)."""

    sampled: TokenLogprob
    rank: int
    top: tuple[TokenLogprob, ...]
