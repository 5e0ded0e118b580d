"""Scheduler configuration: frozen values validated without I/O.

Also the two small validation helpers the rest of the repository shares (worker/ and cluster/
import them; this package stays standard library only): `NamedEnum`, an enum configured by member
name, and `positive_int`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from scheduler.errors import InvalidFieldError
from scheduler.state import LlmRequestState

_E = TypeVar("_E", bound="NamedEnum")


class NamedEnum(Enum):
    """An enum that configuration names by member name, case-insensitively ("max_utilization").

    A subclass says which field it configures and how to call it in errors:
    `class CapacitySchedulerPolicy(NamedEnum, field="capacity_policy", label="capacity scheduler policy")`.
    `Enum(value)` (and msgspec, which goes through `_missing_`) accepts a name in any case too.
    """

    _config_field: str
    _config_label: str

    def __init_subclass__(cls, *, field: str = "", label: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._config_field = field or cls.__name__
        cls._config_label = label or cls.__name__

    @classmethod
    def _missing_(cls, value: object) -> Any:
        return cls.__members__.get(value.upper()) if isinstance(value, str) else None

    @classmethod
    def parse(cls: type[_E], value: object, field: str | None = None) -> _E:
        """The member `value` names (a member passes through); InvalidFieldError naming `field` otherwise."""
        if isinstance(value, cls):
            return value
        member = cls.__members__.get(str(value).upper())
        if member is None:
            raise InvalidFieldError(
                field or cls._config_field,
                f"unknown {cls._config_label} {value!r}; expected one of {list(cls.__members__)}",
            )
        return member


def positive_int(field: str, value: object, error: Callable[[str, str], Exception] = InvalidFieldError) -> None:
    """Raise `error(field, message)` unless `value` is an int >= 1 (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(field, f"must be a positive integer, got {value!r}")


class CapacitySchedulerPolicy(NamedEnum, field="capacity_policy", label="capacity scheduler policy"):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class ContextChunkingPolicy(NamedEnum, field="chunking.policy", label="context chunking policy"):
    EQUAL_PROGRESS = "EQUAL_PROGRESS"
    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    FORCE_CHUNK = "FORCE_CHUNK"


class ReorderPolicy(NamedEnum, field="reorder", label="reorder policy"):
    """The hook run on the active list before admission."""

    IDENTITY = "IDENTITY"
    PRIORITY = "PRIORITY"  # priority descending, first come first served among equals


@dataclass(frozen=True)
class ChunkingConfig:
    policy: ContextChunkingPolicy
    unit_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.policy, ContextChunkingPolicy):
            raise InvalidFieldError("chunking.policy", f"must be a ContextChunkingPolicy, got {self.policy!r}")
        positive_int("chunking.unit_size", self.unit_size)


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
        positive_int("max_num_requests", self.max_num_requests)
        positive_int("max_batch_size", self.max_batch_size)
        if self.max_num_tokens is not None:
            positive_int("max_num_tokens", self.max_num_tokens)
        if self.max_context_length is not None:
            positive_int("max_context_length", self.max_context_length)
        positive_int("max_input_len_for_pause", self.max_input_len_for_pause)
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
