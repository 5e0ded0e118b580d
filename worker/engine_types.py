"""Engine-side typed values (no torch here: the cluster's deployment config imports them).

- `EngineConfig`: one instance's scheduler, KV pool and hand-over settings, validated without I/O.
- `Reservation`: the KV blocks a generation instance reserved for an incoming transfer.

What crosses the router/instance boundary (requests, outputs, events, loads) is in worker/protocol.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.config import CapacitySchedulerPolicy, ContextChunkingPolicy
from worker.kv_layout import KvLayout
from worker.protocol import EngineInputError, InstanceRole


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EngineInputError(name, f"must be a positive integer, got {value!r}")


def _positive_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise EngineInputError(name, f"must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    role: InstanceRole = InstanceRole.MIXED
    tokens_per_block: int = 16
    # KV pool size: `num_blocks` if given, else as many blocks as fit in kv_cache_bytes.
    num_blocks: int | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_requests: int = 64  # requests holding KV at once (capacity scheduler)
    max_batch_size: int = 64  # requests per forward step (micro-batch scheduler)
    max_num_tokens: int = 2048  # tokens per forward step
    capacity_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    chunking_policy: ContextChunkingPolicy | None = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    chunk_unit_tokens: int = 256  # a multiple of tokens_per_block
    enable_prefix_reuse: bool = True
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    max_waiting_requests: int = 4096  # requests queued in the engine beyond which submit refuses
    # Hand-over bounds: a generation-side reservation is freed if no KV commits within
    # reservation_timeout_s; a prefill-side request frees its blocks if the hand-over has not been
    # acknowledged within sender_lease_s.
    reservation_timeout_s: float = 30.0
    sender_lease_s: float = 60.0
    seed: int = 0  # mixed into the seed of requests that come without one
    record_prefix_events: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.role, InstanceRole):
            raise EngineInputError("role", f"must be an InstanceRole, got {self.role!r}")
        for name in ("tokens_per_block", "kv_cache_bytes", "max_num_requests", "max_batch_size", "max_num_tokens",
                     "chunk_unit_tokens", "max_waiting_requests"):
            _positive_int(name, getattr(self, name))
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks)
        if self.max_seq_len is not None:
            _positive_int("max_seq_len", self.max_seq_len)
        if not isinstance(self.capacity_policy, CapacitySchedulerPolicy):
            raise EngineInputError("capacity_policy", f"must be a CapacitySchedulerPolicy, got {self.capacity_policy!r}")
        if self.chunking_policy is not None and not isinstance(self.chunking_policy, ContextChunkingPolicy):
            raise EngineInputError("chunking_policy", f"must be a ContextChunkingPolicy or None, got {self.chunking_policy!r}")
        if self.chunk_unit_tokens % self.tokens_per_block:
            raise EngineInputError(
                "chunk_unit_tokens",
                f"must be a multiple of tokens_per_block={self.tokens_per_block}, got {self.chunk_unit_tokens}",
            )
        if self.chunking_policy is not None and self.chunk_unit_tokens > self.max_num_tokens:
            raise EngineInputError(
                "chunk_unit_tokens", f"{self.chunk_unit_tokens} exceeds max_num_tokens {self.max_num_tokens}"
            )
        _positive_seconds("reservation_timeout_s", self.reservation_timeout_s)
        _positive_seconds("sender_lease_s", self.sender_lease_s)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise EngineInputError("seed", f"must be a non-negative integer, got {self.seed!r}")

    def with_overrides(self, **overrides: object) -> EngineConfig:
        """A copy with some fields replaced (policy names may be given as strings)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        for name, value in overrides.items():
            if name not in values:
                raise EngineInputError(name, "unknown engine option")
            if name == "role":
                value = InstanceRole.parse(value)  # type: ignore[arg-type]
            elif name == "capacity_policy":
                value = CapacitySchedulerPolicy.parse(value)  # type: ignore[arg-type]
            elif name == "chunking_policy" and value is not None:
                value = ContextChunkingPolicy.parse(value)  # type: ignore[arg-type]
            values[name] = value
        return EngineConfig(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Reservation:
    """Blocks a generation instance reserved for a request's incoming KV."""

    request_id: str
    transfer_id: str
    num_blocks: int
    num_tokens: int
    layout: KvLayout
    expires_at_s: float
