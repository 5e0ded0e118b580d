"""Scheduler configuration: frozen values validated without I/O."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from scheduler.errors import InvalidFieldError
from scheduler.state import LlmRequestState


class CapacitySchedulerPolicy(Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"

    @classmethod
    def parse(cls, value: str | CapacitySchedulerPolicy, field: str = "capacity_policy") -> CapacitySchedulerPolicy:
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise InvalidFieldError(
                field, f"unknown capacity scheduler policy {value!r}; expected one of {[p.name for p in cls]}"
            ) from None


class ContextChunkingPolicy(Enum):
    EQUAL_PROGRESS = "EQUAL_PROGRESS"
    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    FORCE_CHUNK = "FORCE_CHUNK"

    @classmethod
    def parse(cls, value: str | ContextChunkingPolicy, field: str = "chunking.policy") -> ContextChunkingPolicy:
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise InvalidFieldError(
                field, f"unknown context chunking policy {value!r}; expected one of {[p.name for p in cls]}"
            ) from None


class ReorderPolicy(Enum):
    """The hook run on the active list before admission."""

    IDENTITY = "IDENTITY"
    PRIORITY = "PRIORITY"  # priority descending, first come first served among equals

    @classmethod
    def parse(cls, value: str | ReorderPolicy, field: str = "reorder") -> ReorderPolicy:
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise InvalidFieldError(field, f"unknown reorder policy {value!r}") from None


def _positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidFieldError(field, f"must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ChunkingConfig:
    policy: ContextChunkingPolicy
    unit_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.policy, ContextChunkingPolicy):
            raise InvalidFieldError("chunking.policy", f"must be a ContextChunkingPolicy, got {self.policy!r}")
        _positive_int("chunking.unit_size", self.unit_size)


@dataclass(frozen=True)
class SchedulerConfig:
    """Both levels. `None` limits mean "no limit"."""

    max_num_requests: int
    max_batch_size: int
    max_num_tokens: int | None = None
    capacity_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    chunking: ChunkingConfig | None = None
    max_context_length: int | None = None
    enable_prefix_aware_scheduling: bool = True
    max_input_len_for_pause: int = 0x7FFFFFFF  # "recompute pause": nothing is truncated
    reorder: ReorderPolicy = ReorderPolicy.IDENTITY
    # Schedulable windows: a scheduler accepts a request iff until <= state < after.
    capacity_until: LlmRequestState = LlmRequestState.CONTEXT_INIT
    capacity_after: LlmRequestState = LlmRequestState.GENERATION_COMPLETE
    microbatch_until: LlmRequestState = LlmRequestState.CONTEXT_INIT
    microbatch_after: LlmRequestState = LlmRequestState.GENERATION_TO_COMPLETE

    def __post_init__(self) -> None:
        _positive_int("max_num_requests", self.max_num_requests)
        _positive_int("max_batch_size", self.max_batch_size)
        if self.max_num_tokens is not None:
            _positive_int("max_num_tokens", self.max_num_tokens)
        if self.max_context_length is not None:
            _positive_int("max_context_length", self.max_context_length)
        _positive_int("max_input_len_for_pause", self.max_input_len_for_pause)
        if not isinstance(self.capacity_policy, CapacitySchedulerPolicy):
            raise InvalidFieldError("capacity_policy", f"must be a CapacitySchedulerPolicy, got {self.capacity_policy!r}")
        if self.chunking is not None and not isinstance(self.chunking, ChunkingConfig):
            raise InvalidFieldError("chunking", f"must be a ChunkingConfig or None, got {self.chunking!r}")
        if (
            self.chunking is not None
            and self.chunking.policy is ContextChunkingPolicy.FORCE_CHUNK
            and self.max_context_length is not None
            and self.max_context_length < self.chunking.unit_size
        ):
            raise InvalidFieldError(
                "max_context_length",
                f"FORCE_CHUNK needs max_context_length >= chunk unit {self.chunking.unit_size}, got {self.max_context_length}",
            )
        if not isinstance(self.enable_prefix_aware_scheduling, bool):
            raise InvalidFieldError("enable_prefix_aware_scheduling", "must be a bool")

    def check_block_alignment(self, tokens_per_block: int) -> None:
        """Non-last context chunks must end on block boundaries (published blocks are full)."""
        if self.chunking is not None and self.chunking.unit_size % tokens_per_block != 0:
            raise InvalidFieldError(
                "chunking.unit_size",
                f"must be a multiple of tokens_per_block={tokens_per_block}, got {self.chunking.unit_size}",
            )
