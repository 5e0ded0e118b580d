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
    frontend: {host: 127.0.0.1, port: 50051, tokens: [], tls_cert: null, tls_key: null, metrics_port: 9464, timeline_log: null,
              http_port: 8000, served_model_name: null, chat_template: null}
    cluster_token: null    # shared secret of the KV transfer path; generated when null
    step_log_dir: null     # each instance's engine steps as JSON lines (duet profile --deployed fits them)
    faults: null           # a fault plan (worker/kv_transfer/faults.py) for chaos runs; off by default
    kv_transfer: {data_plane: auto, sender: {num_streams: 4, num_connections: 4, max_chunk_bytes: 4194304, checksum_algorithms: [XXH3_64, CRC32]},
                  receiver: {max_open_transfers: 16}, bind_host: null, tls: auto, tls_validity_days: 365,
                  tls_certificate_chain: null, tls_private_key: null, tls_root_certificates: null, tls_server_name: null}
    ray: {address: null, num_cpus: null, dashboard_host: 127.0.0.1, include_dashboard: false}

Per instance group: `num_cpus` (fractions allowed, so 2 PREFILL + 2 GENERATION fit on 2 CPUs),
`num_gpus` (null: 1 when the Ray cluster has GPUs, else 0), `torch_threads`, `resources` (custom
Ray resources, e.g. node labels to pin roles to nodes), `engine` (overrides for that role).

Every section is a config Struct (worker/config.py); `ClusterConfig.from_dict` is `load_config`, so
every key is optional, an unknown key is an error naming its path (`instances[1].num_cpuz`), and a
null section means its defaults. The sections that other areas own and that the instances receive
as plain data (`engine`, `faults`, `kv_transfer`) stay plain data here, validated against their
declarations (EngineConfig, FaultPlan, KvTransferConfig) so that a mistake fails at load, named by
its path. Reading the YAML file (`from_yaml`) is the one piece of I/O, at this edge.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from cluster.router.config import ConfigError, ConfigSection, DisaggMode, RouterConfig, UnknownConfigKey
from worker.config import (
    ConfigProblem,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    ProblemKind,
    dataclass_compatible,
    load_config,
)
from worker.engine_types import EngineConfig
from worker.kv_transfer.config import KvTransferConfig
from worker.kv_transfer.faults import FaultPlan
from worker.protocol import EngineInputError, InstanceRole


class InstanceGroup(ConfigSection, frozen=True):
    role: InstanceRole
    """What these instances serve (PREFILL, GENERATION, MIXED; any case); required."""
    count: NonNegativeInt = 1
    """How many instances of this group."""
    num_cpus: NonNegativeFloat = 0.5
    """CPUs each instance's actor reserves (fractions allowed)."""
    num_gpus: NonNegativeFloat | None = None
    """GPUs each instance reserves; None: 1 where the Ray cluster has GPUs, else 0."""
    torch_threads: PositiveInt | None = 1
    """torch threads in each instance; None: torch's default."""
    resources: dict[str, float] = {}
    """Custom Ray resources each instance reserves (node labels pin roles to nodes: {gen_node: 0.01})."""
    engine: dict[str, Any] = {}
    """EngineConfig overrides for this group, over the cluster's `engine`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, amount in self.resources.items():
            if not name:
                raise ConfigError("resources", "resource names must be non-empty strings")
            if not (math.isfinite(amount) and amount >= 0):
                raise ConfigError(f"resources.{name}", f"must be a number >= 0, got {amount!r}")


@dataclass_compatible
class FrontendConfig(ConfigSection, frozen=True):
    host: str = "127.0.0.1"
    """Address the gRPC front end binds."""
    port: Annotated[int, Meta(ge=0, le=65535)] = 50051
    """TCP port of the gRPC front end; 0 picks a free one."""
    tokens: tuple[str, ...] = ()
    """Bearer tokens clients must present; empty: no authentication."""
    tls_cert: str | None = None
    """PEM certificate chain file of the front end (with tls_key); None: plaintext."""
    tls_key: str | None = None
    """PEM private key file (with tls_cert)."""
    tls_client_ca: str | None = None
    """PEM CA file; when set, clients must present a certificate it signed (mutual TLS)."""
    metrics_port: NonNegativeInt | None = 9464
    """Prometheus /metrics on host:metrics_port (0 picks a free port; None turns it off)."""
    timeline_log: str | None = None
    """File that gets every ended request's timeline as one JSON line (None: off)."""
    http_port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    """TCP port of the OpenAI-compatible HTTP API on the same host, tokens and TLS; 0 turns it off."""
    served_model_name: str | None = None
    """The model name the HTTP API answers to; None: the checkpoint directory's name, or duet-default."""
    chat_template: str | None = None
    """Jinja chat template file that overrides the checkpoint's (the HTTP API's chat completions)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name", "must not be empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert", "tls_cert and tls_key go together")
        # The front end's auth interceptor refuses a weak token when it starts, which is after the
        # whole deployment is up: check here, at load, so that the mistake costs no deployment.
        from worker.kv_transfer.auth import TokenError, check_token

        for index, token in enumerate(self.tokens):
            try:
                check_token(token)
            except TokenError as error:
                raise ConfigError(f"tokens[{index}]", str(error)) from None


@dataclass_compatible
class RayConfig(ConfigSection, frozen=True):
    address: str | None = None
    """Ray cluster to join; None: start an embedded local cluster (unless RAY_ADDRESS is set)."""
    num_cpus: Annotated[float, Meta(ge=1)] | None = None
    """CPUs of the embedded cluster (embedded only); None: Ray's default."""
    dashboard_host: str = "127.0.0.1"
    """Where the dashboard and job API listen: they run code for whoever reaches them."""
    include_dashboard: bool = False
    """Start Ray's dashboard (embedded cluster)."""
    namespace: str = "duet"
    """Ray namespace of the cluster's named actors."""


DEFAULT_GROUPS = (InstanceGroup(InstanceRole.PREFILL), InstanceGroup(InstanceRole.GENERATION))


@dataclass_compatible
class ClusterConfig(ConfigSection, frozen=True):
    model: str | None = None
    """A local Hugging Face checkpoint directory; None: the embedded default model."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Model and KV dtype. auto: for a checkpoint, its own dtype on CPU, and on GPU bfloat16 (float16
    where unsupported) for a float32 one (worker/device.py); for the built-in model, bfloat16 where
    the device computes it natively, else float32. The choice is logged and shown by `duet status`."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    instances: tuple[InstanceGroup, ...] = DEFAULT_GROUPS
    """The instance groups to deploy."""
    engine: dict[str, Any] = {}
    """EngineConfig settings of every instance (worker/engine_types.py), as plain data."""
    placement_strategy: Literal["spread", "pack"] = "spread"
    """Spread roles over nodes, or pack them."""
    router: RouterConfig = RouterConfig()
    """Placement, recovery, admission, health and stage timeouts (cluster/router/config.py)."""
    frontend: FrontendConfig = FrontendConfig()
    """The gRPC front end and its metrics."""
    cluster_token: str | None = None
    """Shared secret of the KV transfer path; None: generated at launch."""
    faults: dict[str, Any] | None = None
    """A fault plan (worker/kv_transfer/faults.py FaultPlan) for chaos runs, as plain data; None: off."""
    kv_transfer: dict[str, Any] = {}
    """KV transfer tuning: {sender: SenderConfig fields, receiver: ReceiverConfig fields} (KvTransferConfig)."""
    ray: RayConfig = RayConfig()
    """Which Ray cluster, and how to start an embedded one."""
    actor_start_timeout_s: Annotated[float, Meta(ge=1)] = 180.0
    """Seconds the instances get to come up before the deployment fails."""
    max_restarts: NonNegativeInt = 3
    """Times Ray restarts a dead instance actor."""
    drain_timeout_s: NonNegativeFloat = 30.0
    """Seconds in-flight requests get to finish on SIGTERM."""
    seed: int | None = None
    """Seed of the router's random choices; None: unseeded."""
    step_log_dir: str | None = None
    """Directory where each instance appends one JSON line per engine step, to `<instance id>.jsonl`
    (its batch and seconds, worker/profiler.py StepLog: what `duet profile --deployed` fits); None: off."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ConfigError("device", f"must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.cluster_token is not None:
            # Each instance checks it when it starts, after the deployment: check it here, at load.
            from worker.kv_transfer.auth import TokenError, check_token

            try:
                check_token(self.cluster_token)
            except TokenError as error:
                raise ConfigError("cluster_token", str(error)) from None
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
            settings = {**self.engine, **group.engine, "role": group.role}
            load_config(EngineConfig, settings, errors=functools.partial(_engine_error, index, group, self.engine))
        if self.faults is not None:
            load_config(FaultPlan, self.faults, "faults", errors=ConfigError.from_problem)
        load_config(KvTransferConfig, self.kv_transfer, "kv_transfer", errors=ConfigError.from_problem)

    def engine_config(self, group: InstanceGroup) -> EngineConfig:
        return EngineConfig().with_overrides(**{**self.engine, **group.engine, "role": group.role})

    @property
    def tokens_per_block(self) -> int:
        return EngineConfig().with_overrides(**self.engine).tokens_per_block

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        """Build from plain data (a parsed YAML file); ConfigError naming the path otherwise."""
        return load_config(cls, _colocated_without_prefill(data))

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        """Read and load a YAML file: a syntax error is a ConfigSyntaxError naming file, line and
        column; any other problem a ConfigError whose path says it came from this file."""
        import yaml

        text = Path(path).read_text(encoding="utf-8")
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            raise ConfigSyntaxError.from_yaml(path, error) from None
        try:
            return cls.from_dict(data)
        except ConfigError as error:
            raise error.in_file(str(path)) from None

    def with_instances(self, counts: Mapping[InstanceRole, int]) -> ClusterConfig:
        """Replace the instance counts per role (flags such as --prefill 2 --generation 2)."""
        groups = {group.role: group for group in self.instances}
        new = []
        for role in InstanceRole:
            if role in counts:
                base = groups.get(role, InstanceGroup(role))
                new.append(msgspec.structs.replace(base, count=counts[role]))
            elif role in groups:
                new.append(groups[role])
        router = self.router
        roles = {g.role for g in new if g.count}
        if InstanceRole.PREFILL not in roles and router.placement.disaggregation is not DisaggMode.NEVER:
            placement = msgspec.structs.replace(router.placement, disaggregation=DisaggMode.NEVER)
            router = msgspec.structs.replace(router, placement=placement)
        return msgspec.structs.replace(self, instances=tuple(new), router=router)


class ConfigSyntaxError(ConfigError):
    """The configuration file is not valid YAML; `path` is FILE:LINE:COLUMN (1-based)."""

    @property
    def where(self) -> str:
        return self.path

    @classmethod
    def from_yaml(cls, file: str | Path, error: Exception) -> ConfigSyntaxError:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(file)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        context = getattr(error, "context", None)
        return cls(where, f"YAML syntax error: {problem}" + (f" {context}" if context else ""))


def _colocated_without_prefill(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """A deployment whose instances include no PREFILL one is colocated serving: unless the
    router's placement is given, its disaggregation is 'never'."""
    if not isinstance(data, Mapping):
        return data
    instances, router = data.get("instances"), data.get("router") or {}
    if not isinstance(instances, list) or not isinstance(router, Mapping) or "placement" in router:
        return data
    for group in instances:
        count = group.get("count") if isinstance(group, Mapping) else None
        if isinstance(group, Mapping) and str(group.get("role", "")).upper() == "PREFILL" and count != 0:
            return data
    return {**data, "router": {**router, "placement": {"disaggregation": "never"}}}


def _engine_error(index: int, group: InstanceGroup, engine: Mapping[str, Any], problem: ConfigProblem) -> ConfigError:
    """An engine setting's problem, named where it was set: the cluster's `engine` section, or the
    group's (also for a rule between settings that neither set)."""
    error = EngineConfig.config_error(problem)
    assert isinstance(error, EngineInputError)
    key = re.split(r"[.\[]", error.field)[0]
    section = "engine" if key in engine and key not in group.engine else f"instances[{index}].engine"
    kind = UnknownConfigKey if problem.kind is ProblemKind.UNKNOWN_KEY else ConfigError
    return kind(f"{section}.{error.field}", error.message)
