"""What the chaos soak (cluster/loadgen/chaos.py) does, decided before anything runs: its settings,
its seeded workload, the fault plan on the KV transfer path, the instance kills, and the two
cluster configurations. Pure: nothing here deploys or sends anything.

- The workload (`make_requests`): token-id prompts from a few blocks to a few hundred tokens, a
  quarter of them behind shared prefixes; max_tokens 4..32; greedy and seeded sampling. Each is
  named "soak-<n>" so that the plan can target its hops.
- Faults (`fault_plan`): one transfer-scoped rule per kind, each with probability
  fault_rate / number of kinds, matching every hop of every soak request: sender side drop,
  delay, duplicate, reorder, corrupt, truncate, stall, close; receiver side drop, expire, refuse.
  Draws are a hash of (plan seed, rule, engine request id, attempt), so the same seed gives the
  same plan and the same faults; `planned_faults` lists the faults the first transfer of each
  request draws (retries draw afresh).
- Kills (`kill_schedule`): after every `kill_every` submitted requests, a seeded choice of
  instance.
- The clusters: the faulty one (`prefill` PREFILL + `generation` GENERATION instances, the fault
  plan in its config, every recovery action in its chain) and a clean one (1 MIXED instance,
  colocated) for the replay.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.deploy.config import ClusterConfig
from worker.kv_transfer.config import DATA_PLANES
from worker.kv_transfer.faults import FaultInjector, FaultPlan, FaultSide

REQUEST_PREFIX = "soak"
REPLAY_PREFIX = "replay"
# (kind, side) of the transfer-scoped rules; a hit acts on the transfer's first chunk.
FAULT_KINDS: tuple[tuple[str, str], ...] = (
    ("drop", "sender"),
    ("delay", "sender"),
    ("duplicate", "sender"),
    ("reorder", "sender"),
    ("corrupt", "sender"),
    ("truncate", "sender"),
    ("stall", "sender"),
    ("close", "sender"),
    ("drop", "receiver"),
    ("expire", "receiver"),
    ("refuse", "receiver"),
)
DELAY_FAULT_S = 0.2
NUM_SHARED_PREFIXES = 4
SHARED_PREFIX_FRACTION = 0.25


class SoakConfigError(ValueError):
    """An invalid soak setting; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class SoakError(RuntimeError):
    """The soak could not run (a cluster did not come up, a kill was refused, ...)."""


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 1000
    seed: int = 0
    fault_rate: float = 0.05  # fraction of KV transfers that draw a fault
    kill_every: int = 100  # kill an instance after every this many submitted requests; 0: never
    prefill: int = 2
    generation: int = 2
    concurrency: int = 8
    address: str | None = None  # a Ray cluster to join; None: an embedded local one
    model: str | None = None  # a Hugging Face checkpoint directory; None: the built-in tiny model
    dtype: str = "float32"
    device: str = "auto"
    min_prompt_tokens: int = 20
    max_prompt_tokens: int = 300
    min_max_tokens: int = 4
    max_max_tokens: int = 32
    num_cpus_per_instance: float = 0.25  # fractions, so that 2 + 2 + 1 instances fit on 2 cores
    lost_after_s: float = 300.0  # an accepted request without a final event by then is lost
    settle_timeout_s: float = 90.0  # bound on waiting for instances to come back and free blocks
    restart_timeout_s: float = 180.0  # bound on waiting for a killed instance to serve again
    kill_role: str | None = None  # "prefill" | "generation": kill only instances of that role
    data_plane: str = "auto"  # kv_transfer.data_plane of the faulty cluster: auto, grpc or shm
    stream_interval_ms: float = 0.0  # engine.stream_interval_ms of the faulty cluster (the replay reports every step)

    def __post_init__(self) -> None:
        _int_at_least("requests", self.requests, 1)
        _int_at_least("seed", self.seed, 0)
        _int_at_least("kill_every", self.kill_every, 0)
        _int_at_least("prefill", self.prefill, 1)
        _int_at_least("generation", self.generation, 1)
        _int_at_least("concurrency", self.concurrency, 1)
        _int_at_least("min_prompt_tokens", self.min_prompt_tokens, 1)
        _int_at_least("max_prompt_tokens", self.max_prompt_tokens, self.min_prompt_tokens)
        _int_at_least("min_max_tokens", self.min_max_tokens, 1)
        _int_at_least("max_max_tokens", self.max_max_tokens, self.min_max_tokens)
        if isinstance(self.fault_rate, bool) or not isinstance(self.fault_rate, int | float) or not 0.0 <= self.fault_rate <= 1.0:
            raise SoakConfigError("fault_rate", f"must be a number in [0, 1], got {self.fault_rate!r}")
        for name in ("num_cpus_per_instance", "lost_after_s", "settle_timeout_s", "restart_timeout_s"):
            _finite_number(name, getattr(self, name), zero_allowed=False)
        _finite_number("stream_interval_ms", self.stream_interval_ms, zero_allowed=True)
        if self.kill_role not in (None, "prefill", "generation"):
            raise SoakConfigError("kill_role", f"must be prefill or generation, got {self.kill_role!r}")
        if self.data_plane not in DATA_PLANES:
            raise SoakConfigError("data_plane", f"must be one of {', '.join(DATA_PLANES)}, got {self.data_plane!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise SoakConfigError("dtype", f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def num_kills(self) -> int:
        return 0 if self.kill_every == 0 else (self.requests - 1) // self.kill_every


def _finite_number(name: str, value: object, *, zero_allowed: bool) -> None:
    if (
        isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        or value < 0 or (value == 0 and not zero_allowed)
    ):
        raise SoakConfigError(name, f"must be a {'non-negative' if zero_allowed else 'positive'} number, got {value!r}")


def _int_at_least(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SoakConfigError(name, f"must be an integer >= {minimum}, got {value!r}")


# ---- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakRequest:
    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    seed: int  # always set, so that a sampled request replays exactly

    @property
    def client_request_id(self) -> str:
        return soak_request_id(self.index)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of DuetClient.complete (the prompt aside)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "ignore_eos": True,
        }


def soak_request_id(index: int) -> str:
    """The client request id of the soak's request `index` (its replay has another)."""
    return f"{REQUEST_PREFIX}-{index}"


def make_requests(config: SoakConfig, vocab_size: int) -> tuple[SoakRequest, ...]:
    """The seeded workload: the same config and vocabulary give the same requests."""
    rng = random.Random(f"duet-soak-requests-{config.seed}")
    id_range = min(vocab_size, 256)  # plain byte ids for the built-in model; arbitrary ids otherwise
    prefix_len_max = max(1, min(64, config.max_prompt_tokens // 2))
    prefixes = [
        [rng.randrange(id_range) for _ in range(rng.randint(max(1, prefix_len_max // 2), prefix_len_max))]
        for _ in range(NUM_SHARED_PREFIXES)
    ]
    requests = []
    for index in range(config.requests):
        length = rng.randint(config.min_prompt_tokens, config.max_prompt_tokens)
        prompt: list[int] = []
        if rng.random() < SHARED_PREFIX_FRACTION:
            prompt = list(rng.choice(prefixes))[: max(0, length - 1)]
        prompt += [rng.randrange(id_range) for _ in range(length - len(prompt))]
        greedy = rng.random() < 0.5
        requests.append(
            SoakRequest(
                index=index,
                prompt_token_ids=tuple(prompt),
                max_tokens=rng.randint(config.min_max_tokens, config.max_max_tokens),
                temperature=0.0 if greedy else rng.choice((0.7, 1.0)),
                top_p=1.0 if greedy else rng.choice((0.9, 1.0)),
                seed=rng.randrange(2**31),
            )
        )
    return tuple(requests)


# ---- the fault plan and the kills --------------------------------------------------------------


def fault_plan(seed: int, fault_rate: float, request_pattern: str = f"{REQUEST_PREFIX}-*") -> dict[str, Any]:
    """The plan (worker/kv_transfer/faults.py format) for ClusterConfig.faults: one
    transfer-scoped rule per kind in FAULT_KINDS, fault_rate spread evenly over them."""
    probability = fault_rate / len(FAULT_KINDS)
    rules = []
    for kind, side in FAULT_KINDS:
        rule: dict[str, Any] = {
            "kind": kind,
            "side": side,
            "scope": "transfer",
            "probability": probability,
            "request_ids": [request_pattern],
        }
        if kind == "delay":
            rule["seconds"] = DELAY_FAULT_S
        rules.append(rule)
    return {"enabled": fault_rate > 0, "seed": seed, "rules": rules}


def planned_faults(plan: Mapping[str, Any], requests: Sequence[SoakRequest]) -> dict[str, tuple[str, ...]]:
    """The faults the first KV transfer of each request draws ("<kind>@<side>"), by client id.

    Worked out with the injector the instances run (same plan, same draws): the first transfer of
    request "soak-7" is its generation hop "soak-7.g1"; a retried transfer ("soak-7.g2") draws
    afresh and is not listed. A request that never gets to transfer (its prefill hop died with a
    killed instance, say) has its faults listed but not fired.
    """
    injector = FaultInjector(FaultPlan.from_mapping(dict(plan)), kill=_no_kill)
    planned: dict[str, tuple[str, ...]] = {}
    quiet = _DropRecords()
    injector_logger = logging.getLogger(FaultInjector.__module__)
    injector_logger.addFilter(quiet)  # the injector logs every hit; these are only drawn, not done
    try:
        for request in requests:
            engine_id = f"{request.client_request_id}.g1"
            kinds: list[str] = []
            sender = injector.begin_transfer(FaultSide.SENDER, "plan", engine_id)
            kinds += [f"{kind}@sender" for kind in _chunk_fault_kinds(sender.on_chunk(0))]
            receiver = injector.begin_transfer(FaultSide.RECEIVER, "plan", engine_id)
            if receiver.refuse():
                kinds.append("refuse@receiver")  # nothing reaches a refused receiver
            else:
                kinds += [f"{kind}@receiver" for kind in _chunk_fault_kinds(receiver.on_chunk(0))]
            if kinds:
                planned[request.client_request_id] = tuple(kinds)
    finally:
        injector_logger.removeFilter(quiet)
    return planned


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _no_kill() -> None:
    raise SoakError("the soak's plan never kills through the injector")


def _chunk_fault_kinds(faults: Any) -> list[str]:
    kinds = [name for name in ("drop", "duplicate", "reorder", "corrupt", "truncate", "stall", "close", "expire") if getattr(faults, name)]
    if faults.delay_s:
        kinds.append("delay")
    return kinds


@dataclass(frozen=True)
class PlannedKill:
    after_request: int  # the kill happens once this request (index) has been submitted
    instance_id: str


def kill_schedule(
    config: SoakConfig, instance_ids: Sequence[str], roles: Mapping[str, str] | None = None
) -> tuple[PlannedKill, ...]:
    """Which instance dies after which request. With `config.kill_role`, only instances whose role
    (`roles`: instance id -> "prefill" | "generation") is that one."""
    rng = random.Random(f"duet-soak-kills-{config.seed}")
    ordered = sorted(instance_ids)
    if config.kill_role is not None:
        ordered = [i for i in ordered if (roles or {}).get(i) == config.kill_role]
        if not ordered:
            raise SoakConfigError("kill_role", f"no {config.kill_role} instance to kill")
    return tuple(
        PlannedKill(after_request=number * config.kill_every - 1, instance_id=rng.choice(ordered))
        for number in range(1, config.num_kills + 1)
    )


# ---- the clusters ------------------------------------------------------------------------------


def _router_settings() -> dict[str, Any]:
    # Fast health bounds and short stage timeouts, so that a stall or a kill costs seconds and the
    # soak exercises every recovery action. A transfer's stall bound of 1 s + its bytes at 50 MB/s:
    # the soak's transfers are a few KB, which a healthy path moves in milliseconds even on a
    # loaded machine (the default 2 s leaves room for a SIGSTOP of a third of the health bound).
    return {
        "health": {"heartbeat_interval_s": 0.25, "dead_after_s": 3.0},
        "timeouts": {"context_s": 60.0, "reservation_s": 10.0, "transfer_s": 6.0, "generation_s": 60.0},
        "handover": {"stall_base_s": 1.0},
    }


def _engine_settings() -> dict[str, Any]:
    # Leases shorter than the settle bound, so that a hand-over nobody finishes is freed in time.
    return {"num_blocks": 512, "tokens_per_block": 16, "reservation_timeout_s": 15.0, "sender_lease_s": 15.0}


def faulty_cluster_config(config: SoakConfig) -> ClusterConfig:
    router = _router_settings()
    router["recovery"] = {
        "chain": [
            {"action": "retry_transfer", "max_attempts": 1},
            {"action": "reprefill_elsewhere", "max_attempts": 1},
            {"action": "recompute_local", "max_attempts": 1},
            # The only instance of a role killed (--kill-only-role): wait for Ray to restart it.
            {"action": "wait_for_instance", "max_attempts": 2, "max_wait_s": 60.0},
            {"action": "fail", "max_attempts": 1},
        ]
    }
    return ClusterConfig.from_dict(
        {
            "model": config.model,
            "dtype": config.dtype,
            "device": config.device,
            "instances": [
                {"role": "PREFILL", "count": config.prefill, "num_cpus": config.num_cpus_per_instance},
                {"role": "GENERATION", "count": config.generation, "num_cpus": config.num_cpus_per_instance},
            ],
            "engine": {**_engine_settings(), **({"stream_interval_ms": config.stream_interval_ms} if config.stream_interval_ms else {})},
            "router": router,
            # A free metrics port: a `duet serve` on this machine may hold the default one.
            "frontend": {"port": 0, "metrics_port": 0, "http_port": 0},
            "faults": fault_plan(config.seed, config.fault_rate),
            # The same fault points apply on every data plane (worker/kv_transfer/sender.py).
            "kv_transfer": {"data_plane": config.data_plane},
            "ray": {"address": config.address},
            "max_restarts": config.num_kills + 3,
            "seed": config.seed,
        }
    )


def replay_cluster_config(config: SoakConfig) -> ClusterConfig:
    router = _router_settings()
    router["placement"] = {"disaggregation": "never"}
    return ClusterConfig.from_dict(
        {
            "model": config.model,
            "dtype": config.dtype,
            "device": config.device,
            "instances": [{"role": "MIXED", "count": 1, "num_cpus": config.num_cpus_per_instance}],
            "engine": _engine_settings(),
            "router": router,
            "frontend": {"port": 0, "metrics_port": None, "http_port": 0},
            "ray": {"address": config.address},
            "seed": config.seed,
        }
    )


