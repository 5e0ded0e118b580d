"""The router's configuration: placement, recovery, admission, health bounds and stage timeouts.

Frozen dataclasses, validated on construction without any I/O; `RouterConfig.from_dict` builds one
from plain data (a parsed YAML file, say) and rejects unknown keys with the dotted path of the key.
Loading files is the caller's business. The deployment part of the cluster config (roles, counts,
resources) lives in separate dataclasses that compose with `RouterConfig`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar


class ConfigError(ValueError):
    """An invalid configuration value; `path` is the dotted path of the offending field."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.detail = message
        super().__init__(f"{path}: {message}")

    def under(self, prefix: str) -> ConfigError:
        """The same error with `prefix` prepended to its path (used while descending from_dict)."""
        if not prefix:
            return self
        return type(self)(f"{prefix}.{self.path}", self.detail)


class UnknownConfigKey(ConfigError):
    """A key that no config field has (a typo, or an option from another version)."""


class StageTimeoutBelowHealthBound(ConfigError):
    """A per-stage timeout shorter than the time it takes to declare an instance dead."""


# --- Placement ----------------------------------------------------------------------------------


class PolicyName(Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    KV_AWARE = "kv_aware"


@dataclass(frozen=True)
class RoundRobinParams:
    name: ClassVar[PolicyName] = PolicyName.ROUND_ROBIN


@dataclass(frozen=True)
class LeastLoadedParams:
    name: ClassVar[PolicyName] = PolicyName.LEAST_LOADED


@dataclass(frozen=True)
class KvAwareParams:
    """Dynamo's cost: prefill_weight x max(uncached + active prefill blocks, 0) + decode blocks.

    temperature 0 picks the lowest cost; above 0 samples from softmax(-cost / temperature).
    """

    name: ClassVar[PolicyName] = PolicyName.KV_AWARE
    prefill_weight: float = 1.0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        _require_finite(self, "prefill_weight", minimum=0.0)
        _require_finite(self, "temperature", minimum=0.0)


PolicyParams = RoundRobinParams | LeastLoadedParams | KvAwareParams
_POLICY_PARAMS: Mapping[PolicyName, type] = {
    PolicyName.ROUND_ROBIN: RoundRobinParams,
    PolicyName.LEAST_LOADED: LeastLoadedParams,
    PolicyName.KV_AWARE: KvAwareParams,
}


class DisaggMode(Enum):
    """ALWAYS: every request takes the prefill hop. NEVER: every request runs colocated on a
    GENERATION/MIXED instance (a colocated deployment). CONDITIONAL: the thresholds decide."""

    ALWAYS = "always"
    CONDITIONAL = "conditional"
    NEVER = "never"


@dataclass(frozen=True)
class ConditionalDisaggConfig:
    """A request skips the prefill hop when its prompt is shorter than `colocate_below_prompt_tokens`
    or when the fraction of its prompt not cached on the chosen generation instance is below
    `colocate_below_uncached_fraction`. 0 disables a rule."""

    colocate_below_prompt_tokens: int = 256
    colocate_below_uncached_fraction: float = 0.1

    def __post_init__(self) -> None:
        _require_int("colocate_below_prompt_tokens", self.colocate_below_prompt_tokens, minimum=0)
        _require_finite(self, "colocate_below_uncached_fraction", minimum=0.0)
        if self.colocate_below_uncached_fraction > 1.0:
            raise ConfigError("colocate_below_uncached_fraction", "must be at most 1.0")


class FallbackKind(Enum):
    # No healthy PREFILL instance: the chosen GENERATION/MIXED instance runs the whole request.
    COLOCATE_WHEN_NO_PREFILL = "colocate_when_no_prefill"


@dataclass(frozen=True)
class PlacementConfig:
    prefill_policy: PolicyParams = field(default_factory=KvAwareParams)
    generation_policy: PolicyParams = field(default_factory=LeastLoadedParams)
    disaggregation: DisaggMode = DisaggMode.ALWAYS
    conditional: ConditionalDisaggConfig = field(default_factory=ConditionalDisaggConfig)
    # Fallbacks are opt-in: without one, an empty pool is a NoInstanceAvailable error, never a
    # silent change of serving mode.
    allowed_fallbacks: frozenset[FallbackKind] = frozenset()

    def __post_init__(self) -> None:
        for name in ("prefill_policy", "generation_policy"):
            if not isinstance(getattr(self, name), tuple(_POLICY_PARAMS.values())):
                raise ConfigError(name, f"expected policy params, got {getattr(self, name)!r}")
        if not isinstance(self.disaggregation, DisaggMode):
            raise ConfigError("disaggregation", f"expected a DisaggMode, got {self.disaggregation!r}")
        if not isinstance(self.conditional, ConditionalDisaggConfig):
            raise ConfigError("conditional", "expected a ConditionalDisaggConfig")
        if not isinstance(self.allowed_fallbacks, frozenset) or not all(
            isinstance(kind, FallbackKind) for kind in self.allowed_fallbacks
        ):
            raise ConfigError("allowed_fallbacks", "expected a frozenset of FallbackKind")
        if self.disaggregation is DisaggMode.CONDITIONAL and (
            self.conditional.colocate_below_prompt_tokens == 0
            and self.conditional.colocate_below_uncached_fraction == 0.0
        ):
            raise ConfigError(
                "conditional", "disaggregation is conditional but both thresholds are 0 (use 'always')"
            )


# --- Recovery -----------------------------------------------------------------------------------


class RecoveryAction(Enum):
    RETRY_TRANSFER = "retry_transfer"
    REPREFILL_ELSEWHERE = "reprefill_elsewhere"
    RECOMPUTE_LOCAL = "recompute_local"
    FAIL = "fail"


@dataclass(frozen=True)
class RecoveryStep:
    action: RecoveryAction
    max_attempts: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.action, RecoveryAction):
            raise ConfigError("action", f"expected a RecoveryAction, got {self.action!r}")
        _require_int("max_attempts", self.max_attempts, minimum=1)
        if self.action is RecoveryAction.FAIL and self.max_attempts != 1:
            raise ConfigError("max_attempts", "FAIL ends the request; it has exactly one attempt")


def _default_chain() -> tuple[RecoveryStep, ...]:
    return (
        RecoveryStep(RecoveryAction.RETRY_TRANSFER, 1),
        RecoveryStep(RecoveryAction.RECOMPUTE_LOCAL, 1),
        RecoveryStep(RecoveryAction.FAIL, 1),
    )


@dataclass(frozen=True)
class RecoveryConfig:
    """What the router does after a transfer failure, in order; each action is tried up to its
    max_attempts (counted per request) before the next one. The chain must end with FAIL, so
    recovery is bounded."""

    chain: tuple[RecoveryStep, ...] = field(default_factory=_default_chain)

    def __post_init__(self) -> None:
        if not isinstance(self.chain, tuple) or not all(isinstance(s, RecoveryStep) for s in self.chain):
            raise ConfigError("chain", "expected a tuple of RecoveryStep")
        if not self.chain or self.chain[-1].action is not RecoveryAction.FAIL:
            raise ConfigError("chain", "must end with 'fail' so that recovery is bounded")
        actions = [step.action for step in self.chain]
        for index, action in enumerate(actions):
            if actions.index(action) != index:
                raise ConfigError(f"chain[{index}].action", f"{action.value!r} appears more than once")

    def next_action(
        self,
        attempts: Mapping[RecoveryAction, int],
        applicable: frozenset[RecoveryAction] = frozenset(RecoveryAction),
    ) -> RecoveryAction:
        """The first action in the chain that is applicable and has attempts left.

        `attempts` counts the actions already taken for this request; `applicable` excludes what the
        failure rules out (no RETRY_TRANSFER once the sender died, say). FAIL is always applicable.
        """
        for step in self.chain:
            if step.action is RecoveryAction.FAIL:
                return RecoveryAction.FAIL
            if step.action in applicable and attempts.get(step.action, 0) < step.max_attempts:
                return step.action
        raise AssertionError("unreachable: the chain is validated to end with FAIL")


# --- Admission, health, timeouts ----------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionConfig:
    # Beyond this many requests in flight new ones get RESOURCE_EXHAUSTED.
    max_queued_requests: int = 1024
    # Events (token deltas) held for a client that does not read its stream; beyond this the
    # request is aborted ("the client stopped reading"), so a stalled client cannot hold KV forever.
    max_buffered_events: int = 4096

    def __post_init__(self) -> None:
        _require_int("max_queued_requests", self.max_queued_requests, minimum=1)
        _require_int("max_buffered_events", self.max_buffered_events, minimum=1)


@dataclass(frozen=True)
class HealthConfig:
    """Instances heartbeat every `heartbeat_interval_s`; silence for `dead_after_s` declares one dead."""

    heartbeat_interval_s: float = 1.0
    dead_after_s: float = 5.0

    def __post_init__(self) -> None:
        _require_finite(self, "heartbeat_interval_s", minimum=0.0, exclusive=True)
        _require_finite(self, "dead_after_s", minimum=0.0, exclusive=True)
        if self.dead_after_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "dead_after_s",
                f"{self.dead_after_s} must exceed heartbeat_interval_s {self.heartbeat_interval_s} "
                "(one late heartbeat must not kill an instance)",
            )


@dataclass(frozen=True)
class StageTimeouts:
    """Per-stage deadlines of a request (DESIGN.md §6.5): in CONTEXT_WAIT + CONTEXT_IN_PROGRESS
    (context_s), GENERATION_INIT (reservation_s), TRANSMISSION (transfer_s), GENERATING (generation_s)."""

    context_s: float = 600.0
    reservation_s: float = 30.0
    transfer_s: float = 60.0
    generation_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in self.field_names():
            _require_finite(self, name, minimum=0.0, exclusive=True)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class RouterConfig:
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    timeouts: StageTimeouts = field(default_factory=StageTimeouts)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            expected = typing.get_type_hints(RouterConfig)[f.name]
            if not isinstance(getattr(self, f.name), expected):
                raise ConfigError(f.name, f"expected a {expected.__name__}")
        # A stage deadline must outlast the health bound: otherwise a dead instance shows up as a
        # stage timeout before health marks it dead, and recovery may place the request right back
        # on the dead instance.
        for name in StageTimeouts.field_names():
            value = getattr(self.timeouts, name)
            if value < self.health.dead_after_s:
                raise StageTimeoutBelowHealthBound(
                    f"timeouts.{name}",
                    f"{value} s is shorter than health.dead_after_s {self.health.dead_after_s} s",
                )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RouterConfig:
        """Build from plain data (str keys; enums by value; lists for tuples and sets)."""
        result = _build(cls, data, "")
        assert isinstance(result, RouterConfig)
        return result

    def to_dict(self) -> dict[str, Any]:
        """The plain-data form that from_dict reads back to an equal config."""
        plain = _to_plain(self)
        assert isinstance(plain, dict)
        return plain


# --- Validation and conversion helpers ----------------------------------------------------------


def _require_int(name: str, value: object, minimum: int) -> None:
    if type(value) is not int:
        raise ConfigError(name, f"expected an integer, got {type(value).__name__}")
    if value < minimum:
        raise ConfigError(name, f"must be at least {minimum}, got {value}")


def _require_finite(owner: object, name: str, minimum: float, exclusive: bool = False) -> None:
    """Check that `owner.name` is a finite number in range and store it as a float (an int is a fine
    float: `transfer_s=60`; a bool is not)."""
    value = getattr(owner, name)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ConfigError(name, f"expected a finite number, got {value!r}")
    if value < minimum or (exclusive and value == minimum):
        relation = "greater than" if exclusive else "at least"
        raise ConfigError(name, f"must be {relation} {minimum}, got {value}")
    # Frozen dataclasses normalise in __post_init__ through object.__setattr__.
    object.__setattr__(owner, name, float(value))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _build(cls: type, data: object, path: str) -> object:
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if not isinstance(key, str) or key not in names:
            raise UnknownConfigKey(_join(path, str(key)), f"unknown key (expected one of {names})")
    kwargs = {key: _convert(hints[key], value, _join(path, key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(path) from None


def _build_policy(data: object, path: str) -> object:
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping with a 'name', got {type(data).__name__}")
    if "name" not in data:
        raise ConfigError(_join(path, "name"), f"missing (one of {[p.value for p in PolicyName]})")
    name = _convert(PolicyName, data["name"], _join(path, "name"))
    params = {key: value for key, value in data.items() if key != "name"}
    return _build(_POLICY_PARAMS[name], params, path)  # type: ignore[index]


def _convert(hint: Any, value: object, path: str) -> object:
    if hint == PolicyParams:
        return _build_policy(value, path)
    origin = typing.get_origin(hint)
    if origin is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}")
        return tuple(_convert(item_hint, item, f"{path}[{i}]") for i, item in enumerate(value))
    if origin is frozenset:
        (item_hint,) = typing.get_args(hint)
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}")
        items = [_convert(item_hint, item, f"{path}[{i}]") for i, item in enumerate(value)]
        if len(set(items)) != len(items):
            raise ConfigError(path, "contains duplicates")
        return frozenset(items)
    if isinstance(hint, type) and issubclass(hint, Enum):
        if isinstance(value, hint):
            return value
        valid = [member.value for member in hint]
        if value not in valid:
            raise ConfigError(path, f"{value!r} is not one of {valid}")
        return hint(value)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if hint is bool:
        if type(value) is not bool:
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if hint is int:
        if type(value) is not int:
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if hint is float:
        # YAML writes 30 for 30.0; an integer is a fine float, a bool is not.
        if type(value) not in (int, float):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"{path}: no conversion for config type {hint!r}")


def _to_plain(obj: object) -> object:
    if isinstance(obj, Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        plain: dict[str, Any] = {}
        if isinstance(obj, (RoundRobinParams, LeastLoadedParams, KvAwareParams)):
            plain["name"] = obj.name.value
        for f in dataclasses.fields(obj):
            plain[f.name] = _to_plain(getattr(obj, f.name))
        return plain
    if isinstance(obj, tuple):
        return [_to_plain(item) for item in obj]
    if isinstance(obj, frozenset):
        return sorted(_to_plain(item) for item in obj)  # type: ignore[type-var]
    return obj
