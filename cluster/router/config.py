"""The router's configuration: placement, recovery, admission, health bounds and stage timeouts.

Frozen msgspec Structs (worker/config.py), validated on construction and on loading without any
I/O; `RouterConfig.from_dict` (`load_config`) builds one from plain data (a parsed YAML section,
say) and names a bad or unknown key by its dotted path. Loading files is the caller's business. The
deployment part of the cluster config (roles, counts, resources) lives in cluster/deploy/config.py
and composes with `RouterConfig`; both word their errors as `ConfigError` (`ConfigSection`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Annotated, Any

import msgspec

from worker.config import (
    ConfigProblem,
    ConfigStruct,
    DistinctSet,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ProblemKind,
    join_path,
    load_config,
)


class ConfigError(ValueError):
    """An invalid configuration value; `path` is the dotted path of the offending field."""

    def __init__(self, path: str, message: str, file: str | None = None) -> None:
        self.path = path
        self.detail = message
        # The file the configuration came from, when it came from one (ClusterConfig.from_yaml).
        self.file = file
        super().__init__(f"{path}: {message}")

    @property
    def where(self) -> str:
        """Where the problem is: its path, and the file when known ("engine.x in cluster.yaml")."""
        return f"{self.path} in {self.file}" if self.file else self.path

    def under(self, prefix: str) -> ConfigError:
        """The same error with `prefix` prepended to its path (a rule of a section at `prefix`)."""
        if not prefix:
            return self
        return type(self)(join_path(prefix, self.path), self.detail, self.file)

    def in_file(self, file: str) -> ConfigError:
        """The same error, saying which file it came from."""
        return type(self)(self.path, self.detail, file)

    @classmethod
    def from_problem(cls, problem: ConfigProblem) -> ConfigError:
        """How the cluster's configuration words a problem (worker/config.py's load_config)."""
        if problem.kind is ProblemKind.UNKNOWN_KEY:
            known = list(problem.owner.__struct_fields__) if problem.owner is not None else []
            return UnknownConfigKey(problem.path, f"unknown key (expected one of {known})")
        if problem.kind is ProblemKind.RULE and isinstance(problem.cause, ConfigError):
            return problem.cause.under(problem.path)
        return ConfigError(problem.path, problem.detail)


class UnknownConfigKey(ConfigError):
    """A key that no config field has (a typo, or an option from another version)."""


class StageTimeoutBelowHealthBound(ConfigError):
    """A per-stage timeout shorter than the time it takes to declare an instance dead."""


class ConfigSection(ConfigStruct, frozen=True):
    """A section of the cluster's configuration: its errors are ConfigErrors naming the path."""

    @classmethod
    def config_error(cls, problem: ConfigProblem) -> Exception:
        return ConfigError.from_problem(problem)


# --- Placement ----------------------------------------------------------------------------------
#
# A policy is configured by name with its parameters (`prefill_policy: {name: kv_aware,
# temperature: 0.5}`): a tagged union of structs, one per policy (cluster/router/placement.py builds
# the policy from it).


class _PolicyParams(ConfigSection, frozen=True, tag_field="name"):
    """Base of the placement policies' parameters; `name` picks the policy."""


class RoundRobinParams(_PolicyParams, frozen=True, tag="round_robin"):
    """Instances in turn. No parameters."""


class LeastLoadedParams(_PolicyParams, frozen=True, tag="least_loaded"):
    """The instance with the most free KV blocks net of queued work (Llumnix-style freeness). No parameters."""


class KvAwareParams(_PolicyParams, frozen=True, tag="kv_aware"):
    """Dynamo's cost: prefill_weight x max(uncached + active prefill blocks, 0) + decode blocks.

    temperature 0 picks the lowest cost; above 0 samples from softmax(-cost / temperature).
    """

    prefill_weight: NonNegativeFloat = 1.0
    """Weight of a prefill block against a decode block in the cost (dimensionless)."""
    temperature: NonNegativeFloat = 0.0
    """Softmax temperature over -cost, in blocks; 0 is argmin."""


PolicyParams = RoundRobinParams | LeastLoadedParams | KvAwareParams


def policy_name(params: PolicyParams) -> str:
    """The name a policy is configured by (`kv_aware`), for what users read."""
    return str(type(params).__struct_config__.tag)


class DisaggMode(Enum):
    """ALWAYS: every request takes the prefill hop. NEVER: every request runs colocated on a
    GENERATION/MIXED instance (a colocated deployment). CONDITIONAL: the thresholds decide."""

    ALWAYS = "always"
    CONDITIONAL = "conditional"
    NEVER = "never"


class ConditionalDisaggConfig(ConfigSection, frozen=True):
    """A request skips the prefill hop when its prompt is shorter than `colocate_below_prompt_tokens`
    or when the fraction of its prompt not cached on the chosen generation instance is below
    `colocate_below_uncached_fraction`. 0 disables a rule."""

    colocate_below_prompt_tokens: NonNegativeInt = 256
    """Prompts shorter than this many tokens run colocated; 0: no length rule."""
    colocate_below_uncached_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    """Prompts whose uncached fraction (0..1) on the generation instance is below this run colocated; 0: off."""


class FallbackKind(Enum):
    # No healthy PREFILL instance: the chosen GENERATION/MIXED instance runs the whole request.
    COLOCATE_WHEN_NO_PREFILL = "colocate_when_no_prefill"


# What an unset `generation_policy` stands for (cluster/router/placement.py Placer): a decode hop's
# policy, and that of a request that runs colocated by configuration.
DEFAULT_GENERATION_POLICY: PolicyParams = LeastLoadedParams()
DEFAULT_COLOCATED_POLICY: PolicyParams = KvAwareParams()


class PlacementConfig(ConfigSection, frozen=True):
    prefill_policy: PolicyParams = KvAwareParams()
    """Picks the PREFILL instance of a disaggregated request."""
    generation_policy: PolicyParams | None = None
    """Picks the GENERATION (or MIXED) instance. Unset: least_loaded picks the decode instance of a
    request that may take the prefill hop, and kv_aware picks the instance of one that runs
    colocated by configuration (disaggregation: never, or no PREFILL instance registered), where
    the prompt is computed too, so its cached prefix and the prefill work waiting there count
    (as Dynamo's KV router places in aggregated serving). Set: this policy picks every one."""
    disaggregation: DisaggMode = DisaggMode.ALWAYS
    """Whether requests take the prefill hop."""
    conditional: ConditionalDisaggConfig = ConditionalDisaggConfig()
    """The thresholds of disaggregation: conditional."""
    allowed_fallbacks: DistinctSet[FallbackKind] = DistinctSet()
    """Opt-in fallbacks: without one, an empty pool is a NoInstanceAvailable error, never a silent
    change of serving mode."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.disaggregation is DisaggMode.CONDITIONAL and (
            self.conditional.colocate_below_prompt_tokens == 0
            and self.conditional.colocate_below_uncached_fraction == 0.0
        ):
            raise ConfigError(
                "conditional", "disaggregation is conditional but both thresholds are 0 (use 'always')"
            )


def generation_policy_summary(placement: PlacementConfig) -> str:
    """The generation policy by its configuration name; unset, what it stands for."""
    if placement.generation_policy is not None:
        return policy_name(placement.generation_policy)
    colocated = policy_name(DEFAULT_COLOCATED_POLICY)
    if placement.disaggregation is DisaggMode.NEVER:
        return f"{colocated} (unset: every request runs colocated)"
    return f"{policy_name(DEFAULT_GENERATION_POLICY)} ({colocated} where requests run colocated)"


def placement_summary(placement: PlacementConfig) -> str:
    """The placement settings by their configuration names (`kv_aware`, not the Python class)."""
    fallbacks = ",".join(sorted(kind.value for kind in placement.allowed_fallbacks)) or "none"
    return (
        f"prefill={policy_name(placement.prefill_policy)}, generation={generation_policy_summary(placement)}, "
        f"disaggregation={placement.disaggregation.value}, allowed_fallbacks={fallbacks}"
    )


# --- Recovery -----------------------------------------------------------------------------------


class RecoveryAction(Enum):
    RETRY_TRANSFER = "retry_transfer"
    REPREFILL_ELSEWHERE = "reprefill_elsewhere"
    RECOMPUTE_LOCAL = "recompute_local"
    # No healthy instance can take the request: wait (back in QUEUED, stage timers paused) for one,
    # bounded by max_wait_s and the request's deadline, then recompute prompt + tokens streamed.
    WAIT_FOR_INSTANCE = "wait_for_instance"
    FAIL = "fail"


class RecoveryStep(ConfigSection, frozen=True):
    action: RecoveryAction
    """What to do after a transfer failure (required)."""
    max_attempts: PositiveInt = 1
    """How many times per request this action may be taken before the next step's."""
    max_wait_s: PositiveFloat = 60.0
    """wait_for_instance only: seconds a request waits for a healthy instance before it fails."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.action is RecoveryAction.FAIL and self.max_attempts != 1:
            raise ConfigError("max_attempts", "FAIL ends the request; it has exactly one attempt")


def recovery_step_summary(step: RecoveryStep) -> str:
    """"retry_transfer x2"; a step taken once is its action's name alone."""
    return step.action.value if step.max_attempts == 1 else f"{step.action.value} x{step.max_attempts}"


class RecoveryConfig(ConfigSection, frozen=True):
    """What the router does after a transfer failure, in order; each action is tried up to its
    max_attempts (counted per request) before the next one. The chain must end with FAIL, so
    recovery is bounded."""

    chain: tuple[RecoveryStep, ...] = (
        RecoveryStep(RecoveryAction.RETRY_TRANSFER, 1),
        RecoveryStep(RecoveryAction.RECOMPUTE_LOCAL, 1),
        RecoveryStep(RecoveryAction.WAIT_FOR_INSTANCE, 2),
        RecoveryStep(RecoveryAction.FAIL, 1),
    )
    """The steps, in order; each action at most once, the last one `fail`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.chain or self.chain[-1].action is not RecoveryAction.FAIL:
            raise ConfigError("chain", "must end with 'fail' so that recovery is bounded")
        actions = [step.action for step in self.chain]
        for index, action in enumerate(actions):
            if actions.index(action) != index:
                raise ConfigError(f"chain[{index}].action", f"{action.value!r} appears more than once")

    def step(self, action: RecoveryAction) -> RecoveryStep | None:
        """The chain's step for `action` (None: the chain does not take it)."""
        return next((step for step in self.chain if step.action is action), None)

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


class AdmissionConfig(ConfigSection, frozen=True):
    max_queued_requests: PositiveInt = 1024
    """Requests in flight beyond which new ones get RESOURCE_EXHAUSTED."""
    max_buffered_events: PositiveInt = 4096
    """Events (token deltas) held for a client that does not read its stream; beyond this the
    request is aborted ("the client stopped reading"), so a stalled client cannot hold KV forever."""


class HealthConfig(ConfigSection, frozen=True):
    """Instances heartbeat every `heartbeat_interval_s`; silence for `dead_after_s` declares one dead."""

    heartbeat_interval_s: PositiveFloat = 1.0
    """Seconds between an instance's heartbeats (polls)."""
    dead_after_s: PositiveFloat = 5.0
    """Seconds of silence after which an instance is declared dead; above heartbeat_interval_s."""
    probe_after_s: PositiveFloat = 0.2
    """Seconds a poll may run past its wait before the instance is probed (a Ping): a probe that
    Ray refuses, or that answers from a new incarnation, confirms the suspicion at once (a killed
    actor's in-flight poll hangs for about 1.5 s before Ray fails it); a slow probe does not."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dead_after_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "dead_after_s",
                f"{self.dead_after_s} must exceed heartbeat_interval_s {self.heartbeat_interval_s} "
                "(one late heartbeat must not kill an instance)",
            )


# --- The KV hand-over --------------------------------------------------------------------------------


class ReserveAt(Enum):
    """When a disaggregated request's generation hop is submitted, so that its instance reserves the
    KV blocks: with the prefill hop (AT_ADMISSION), when the prefill's first chunk is scheduled
    (AT_CONTEXT_START), or once its first token is out (AT_CONTEXT_DONE, the hand-over on the
    critical path). An early reservation is relayed to the prefill instance, which pushes the moment
    its KV is final; a generation pool too full to reserve early reserves later, as AT_CONTEXT_DONE
    does."""

    AT_ADMISSION = "at_admission"
    AT_CONTEXT_START = "at_context_start"
    AT_CONTEXT_DONE = "at_context_done"


class HandoverConfig(ConfigSection, frozen=True):
    reserve: ReserveAt = ReserveAt.AT_CONTEXT_START
    """When the generation instance reserves the request's KV blocks."""
    stall_base_s: PositiveFloat = 2.0
    """A transfer still uncommitted stall_base_s + its bytes / stall_min_bytes_per_s after the
    request entered TRANSMISSION (at most timeouts.transfer_s) is taken for stalled and recovered:
    a few KB need not wait out a deadline sized for gigabytes."""
    stall_min_bytes_per_s: PositiveFloat = 50e6
    """The slowest transfer rate, in bytes per second, a healthy KV path is expected to keep."""


class StageTimeouts(ConfigSection, frozen=True):
    """Per-stage deadlines of a request, in seconds (no wait is unbounded). Each must outlast
    health.dead_after_s (RouterConfig checks)."""

    context_s: PositiveFloat = 600.0
    """Seconds in CONTEXT_WAIT + CONTEXT_IN_PROGRESS."""
    reservation_s: PositiveFloat = 30.0
    """Seconds in GENERATION_INIT (the generation instance reserving KV blocks)."""
    transfer_s: PositiveFloat = 60.0
    """Seconds in TRANSMISSION (KV in flight)."""
    generation_s: PositiveFloat = 1800.0
    """Seconds in GENERATING."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return cls.__struct_fields__


class RouterConfig(ConfigSection, frozen=True):
    placement: PlacementConfig = PlacementConfig()
    """Where requests run."""
    recovery: RecoveryConfig = RecoveryConfig()
    """What happens after a transfer failure."""
    admission: AdmissionConfig = AdmissionConfig()
    """Bounds on requests and buffered events."""
    health: HealthConfig = HealthConfig()
    """When an instance is declared dead."""
    timeouts: StageTimeouts = StageTimeouts()
    """Per-stage deadlines."""
    handover: HandoverConfig = HandoverConfig()
    """How the KV moves from the prefill to the generation instance."""

    def __post_init__(self) -> None:
        super().__post_init__()
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
        return load_config(cls, data)

    def to_dict(self) -> dict[str, Any]:
        """The plain-data form that from_dict reads back to an equal config."""
        plain = msgspec.to_builtins(self)
        assert isinstance(plain, dict)
        return plain
