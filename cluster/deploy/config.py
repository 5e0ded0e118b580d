"""The cluster configuration: what `duet serve` deploys (YAML file and flags), validated without I/O.

    model: null            # a local Hugging Face checkpoint directory, or null for the embedded default
    dtype: auto            # auto | float32 | bfloat16 | float16
    device: auto           # auto | cpu | cuda
    instances:
      - {role: PREFILL, count: 1}
      - {role: GENERATION, count: 1, num_cpus: 0.5, torch_threads: 1, resources: {gen_node: 0.01}}
    engine: {tokens_per_block: 16, capacity_policy: GUARANTEED_NO_EVICT, max_num_tokens: 2048}
    placement_strategy: spread   # spread roles over nodes, or pack them
    router: {placement: {...}, recovery: {...}, admission: {...}, health: {...}, timeouts: {...}}
    frontend: {host: 127.0.0.1, port: 50051, tokens: [], tls_cert: null, tls_key: null, metrics_port: 9464, timeline_log: null}
    cluster_token: null    # shared secret of the KV transfer path; generated when null
    faults: null           # a fault plan (worker/kv_transfer/faults.py) for chaos runs; off by default
    kv_transfer: {sender: {num_streams: 4, num_connections: 4, max_chunk_bytes: 4194304, checksum_algorithms: [XXH3_64, CRC32]}, receiver: {max_open_transfers: 16}}
    ray: {address: null, num_cpus: null, dashboard_host: 127.0.0.1, include_dashboard: false}

Per instance group: `num_cpus` (fractions allowed, so 2 PREFILL + 2 GENERATION fit on 2 CPUs),
`num_gpus` (null: 1 when the Ray cluster has GPUs, else 0), `torch_threads`, `resources` (custom
Ray resources, e.g. node labels to pin roles to nodes), `engine` (overrides for that role).
Unknown keys are errors naming their path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from cluster.router.config import ConfigError, DisaggMode, RouterConfig
from worker.engine_types import EngineConfig, EngineInputError, InstanceRole


def _check_keys(data: Mapping[str, Any], allowed: set[str], path: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", f"expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}" if path else unknown[0], f"unknown key; known keys: {sorted(allowed)}")


def _number(path: str, value: object, *, minimum: float, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < minimum:
        kind = "an integer" if integer else "a number"
        raise ConfigError(path, f"must be {kind} >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class InstanceGroup:
    role: InstanceRole
    count: int = 1
    num_cpus: float = 0.5
    num_gpus: float | None = None  # None: 1 where the Ray cluster has GPUs, else 0
    torch_threads: int | None = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    engine: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str) -> InstanceGroup:
        _check_keys(data, {f.name for f in dataclasses.fields(cls)}, path)
        if "role" not in data:
            raise ConfigError(f"{path}.role", "is required")
        try:
            role = InstanceRole.parse(data["role"])
        except EngineInputError as error:
            raise ConfigError(f"{path}.role", error.message) from None
        group = cls(**{**data, "role": role, "resources": dict(data.get("resources") or {}), "engine": dict(data.get("engine") or {})})
        group.validate(path)
        return group

    def validate(self, path: str) -> None:
        _number(f"{path}.count", self.count, minimum=0, integer=True)
        _number(f"{path}.num_cpus", self.num_cpus, minimum=0)
        if self.num_gpus is not None:
            _number(f"{path}.num_gpus", self.num_gpus, minimum=0)
        if self.torch_threads is not None:
            _number(f"{path}.torch_threads", self.torch_threads, minimum=1, integer=True)
        for name, amount in self.resources.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{path}.resources", "resource names must be non-empty strings")
            _number(f"{path}.resources.{name}", amount, minimum=0)


@dataclass(frozen=True)
class FrontendConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    tokens: tuple[str, ...] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Prometheus /metrics on host:metrics_port (0 picks a free port; null turns it off).
    metrics_port: int | None = 9464
    # Every ended request's timeline as one JSON line in this file (null: off).
    timeline_log: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str) -> FrontendConfig:
        _check_keys(data, {f.name for f in dataclasses.fields(cls)}, path)
        config = cls(**{**data, "tokens": tuple(data.get("tokens") or ())})
        _number(f"{path}.port", config.port, minimum=0, integer=True)
        if config.port > 65535:
            raise ConfigError(f"{path}.port", f"must be <= 65535, got {config.port}")
        if config.metrics_port is not None:
            _number(f"{path}.metrics_port", config.metrics_port, minimum=0, integer=True)
        if (config.tls_cert is None) != (config.tls_key is None):
            raise ConfigError(f"{path}.tls_cert", "tls_cert and tls_key go together")
        return config


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # None: start an embedded local cluster (unless RAY_ADDRESS is set)
    num_cpus: float | None = None  # embedded cluster only
    dashboard_host: str = "127.0.0.1"  # the dashboard and job API run code for whoever reaches them
    include_dashboard: bool = False
    namespace: str = "duet"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str) -> RayConfig:
        _check_keys(data, {f.name for f in dataclasses.fields(cls)}, path)
        config = cls(**data)
        if config.num_cpus is not None:
            _number(f"{path}.num_cpus", config.num_cpus, minimum=1)
        return config


DEFAULT_GROUPS = (InstanceGroup(InstanceRole.PREFILL), InstanceGroup(InstanceRole.GENERATION))


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    instances: tuple[InstanceGroup, ...] = DEFAULT_GROUPS
    engine: Mapping[str, Any] = field(default_factory=dict)
    placement_strategy: str = "spread"
    router: RouterConfig = field(default_factory=RouterConfig)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    cluster_token: str | None = None
    faults: Mapping[str, Any] | None = None
    # KV transfer tuning: {"sender": SenderConfig fields, "receiver": ReceiverConfig fields}.
    kv_transfer: Mapping[str, Any] = field(default_factory=dict)
    ray: RayConfig = field(default_factory=RayConfig)
    actor_start_timeout_s: float = 180.0
    max_restarts: int = 3
    drain_timeout_s: float = 30.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError("dtype", f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ConfigError("device", f"must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.placement_strategy not in ("spread", "pack"):
            raise ConfigError("placement_strategy", f"must be spread or pack, got {self.placement_strategy!r}")
        _number("actor_start_timeout_s", self.actor_start_timeout_s, minimum=1)
        _number("max_restarts", self.max_restarts, minimum=0, integer=True)
        _number("drain_timeout_s", self.drain_timeout_s, minimum=0)
        _check_keys(self.kv_transfer, {"sender", "receiver"}, "kv_transfer")
        if not any(group.count for group in self.instances):
            raise ConfigError("instances", "deploys no instance")
        roles = {group.role for group in self.instances if group.count}
        if InstanceRole.PREFILL in roles and not roles & {InstanceRole.GENERATION, InstanceRole.MIXED}:
            raise ConfigError("instances", "PREFILL instances need a GENERATION or MIXED instance to hand over to")
        if InstanceRole.PREFILL not in roles and self.router.placement.disaggregation is not DisaggMode.NEVER:
            raise ConfigError(
                "router.placement.disaggregation",
                "no PREFILL instance is deployed: set it to 'never' (colocated serving)",
            )
        for index, group in enumerate(self.instances):
            try:
                self.engine_config(group)
            except EngineInputError as error:
                raise ConfigError(f"instances[{index}].engine.{error.field}", error.message) from None

    def engine_config(self, group: InstanceGroup) -> EngineConfig:
        return EngineConfig().with_overrides(**{**self.engine, **group.engine, "role": group.role})

    @property
    def tokens_per_block(self) -> int:
        return EngineConfig().with_overrides(**self.engine).tokens_per_block

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        _check_keys(data, {f.name for f in dataclasses.fields(cls)}, "")
        values: dict[str, Any] = dict(data)
        if "instances" in data:
            if not isinstance(data["instances"], list):
                raise ConfigError("instances", "must be a list of instance groups")
            values["instances"] = tuple(
                InstanceGroup.from_dict(item, f"instances[{i}]") for i, item in enumerate(data["instances"])
            )
        router_data = dict(data.get("router") or {})
        if "instances" in data and "placement" not in router_data:
            # A deployment without PREFILL instances is colocated serving.
            roles = {g.role for g in values["instances"] if g.count}
            if InstanceRole.PREFILL not in roles:
                router_data["placement"] = {"disaggregation": "never"}
        try:
            values["router"] = RouterConfig.from_dict(router_data)
        except ConfigError as error:
            raise error.under("router") from None
        values["frontend"] = FrontendConfig.from_dict(data.get("frontend") or {}, "frontend")
        values["ray"] = RayConfig.from_dict(data.get("ray") or {}, "ray")
        values["engine"] = dict(data.get("engine") or {})
        values["kv_transfer"] = dict(data.get("kv_transfer") or {})
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        import yaml

        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text) or {}
        return cls.from_dict(data)

    def with_instances(self, counts: Mapping[InstanceRole, int]) -> ClusterConfig:
        """Replace the instance counts per role (flags such as --prefill 2 --generation 2)."""
        groups = {group.role: group for group in self.instances}
        new = []
        for role in InstanceRole:
            if role in counts:
                base = groups.get(role, InstanceGroup(role))
                new.append(dataclasses.replace(base, count=counts[role]))
            elif role in groups:
                new.append(groups[role])
        router = self.router
        roles = {g.role for g in new if g.count}
        if InstanceRole.PREFILL not in roles and router.placement.disaggregation is not DisaggMode.NEVER:
            placement = msgspec.structs.replace(router.placement, disaggregation=DisaggMode.NEVER)
            router = msgspec.structs.replace(router, placement=placement)
        return dataclasses.replace(self, instances=tuple(new), router=router)
