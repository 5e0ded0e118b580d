"""The chaos soak (`duet chaos`, bench/chaos_soak.py): many requests through a cluster whose KV
transfers fail on purpose and whose instances are killed, checked against a fault-free replay.

    report = run_soak(SoakConfig(requests=1000, seed=0, fault_rate=0.05, kill_every=100))
    print(report.table())
    print(report.json_line())          # DESIGN.md §8 envelope; report.ok: the four zeros hold

What it does:

1. Deploys two clusters on one Ray cluster (an embedded local one, or `address` joined): the faulty
   one (`prefill` PREFILL + `generation` GENERATION instances, the fault plan in its config, every
   recovery action in its chain) and a clean one (1 MIXED instance, colocated) for the replay.
2. Sends a seeded mix of requests (`make_requests`: token-id prompts from a few blocks to a few
   hundred tokens, a quarter of them behind shared prefixes; max_tokens 4..32; greedy and seeded
   sampling), each named "soak-<n>" so that the plan can target its hops, at most `concurrency`
   in flight.
3. Faults (`fault_plan`): one transfer-scoped rule per kind, each with probability
   fault_rate / number of kinds, matching every hop of every soak request: sender side drop,
   delay, duplicate, reorder, corrupt, truncate, stall, close; receiver side drop, expire, refuse.
   Draws are a hash of (plan seed, rule, engine request id, attempt), so the same seed gives the
   same plan and the same faults; `planned_faults` lists the faults the first transfer of each
   request draws (retries draw afresh). Kills (`kill_schedule`): after every `kill_every`
   submitted requests, a seeded choice of instance actor is killed with
   `ray.kill(actor, no_restart=False)`; Ray restarts it, the router recovers its requests and
   takes it back. Before each kill the soak waits (bounded) until the previous victim is back and
   every instance is HEALTHY, so at most one instance is down at a time.
4. Settles (nothing in flight, every instance HEALTHY and all blocks free, bounded), replays every
   completed request on the clean cluster and compares tokens.

What the report counts (`SoakReport`):

- accepted: requests the router admitted (it knows them by id); rejected ones are listed by status.
- completed; failed by status (gRPC code names): accepted requests that ended with a status the
  cluster sent (e.g. UNAVAILABLE when recovery was exhausted). Those are neither lost nor
  mismatches.
- lost: accepted requests without a final event within `lost_after_s`. The soak sets no request
  timeout, so the call's deadline is that bound; a DEADLINE_EXCEEDED therefore means the bound
  passed (whether the router or the client noticed first), and counts as lost. A stream that ends
  without a result is lost too.
- leaked blocks: after settling, the sum over instances of total - free blocks.
- token mismatches: completed requests whose tokens differ from the replay's (a replay that
  fails counts as a mismatch: the request could not be verified).
- illegal transitions: the routers' illegal_transitions + inconsistent_reports.
- recovered: completed requests with more than two hops, a "recompute" hop or an attempt > 1.
- extra latency of recovered requests: each one's end-to-end latency minus the median latency of
  the requests that completed without recovery in the same max_tokens bucket (powers of two), in
  this run. (The replay's own latency is not comparable: another cluster, another load.)
- faults that fired: the recoveries in the timelines, by cause ("checksum_mismatch",
  "instance_died", ...) and by action, the routers' transfer failure counters, and the kills.
  Faults that need no recovery (delay, duplicate, reorder) leave no trace in a timeline; the
  planned ones are listed.

This module imports no torch (Ray and the workers are reached through cluster.embedded).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import random
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.client import Completion, DuetClient, DuetError, InstanceWork, StateChange
from cluster.deploy.config import ClusterConfig
from cluster.deploy.embedded import BackgroundCluster
from worker.kv_transfer.faults import FaultInjector, FaultPlan, FaultSide

logger = logging.getLogger(__name__)

BENCH_NAME = "chaos_soak"
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
MUST_BE_ZERO = ("lost", "leaked_blocks", "token_mismatches", "illegal_transitions")
_POLL_S = 0.2


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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise SoakConfigError(name, f"must be a positive number, got {value!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise SoakConfigError("dtype", f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def num_kills(self) -> int:
        return 0 if self.kill_every == 0 else (self.requests - 1) // self.kill_every


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
        return f"{REQUEST_PREFIX}-{self.index}"

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


def kill_schedule(config: SoakConfig, instance_ids: Sequence[str]) -> tuple[PlannedKill, ...]:
    rng = random.Random(f"duet-soak-kills-{config.seed}")
    ordered = sorted(instance_ids)
    return tuple(
        PlannedKill(after_request=number * config.kill_every - 1, instance_id=rng.choice(ordered))
        for number in range(1, config.num_kills + 1)
    )


@dataclass(frozen=True)
class KillRecord:
    instance_id: str
    after_request: int
    killed_at_s: float  # since the soak's requests started
    old_incarnation: str
    back_after_s: float | None  # until the router saw a new incarnation HEALTHY; None: not seen


# ---- the clusters ------------------------------------------------------------------------------


def _router_settings() -> dict[str, Any]:
    # Fast health bounds and short stage timeouts, so that a stall or a kill costs seconds and the
    # soak exercises every recovery action.
    return {
        "health": {"heartbeat_interval_s": 0.25, "dead_after_s": 3.0},
        "timeouts": {"context_s": 60.0, "reservation_s": 10.0, "transfer_s": 6.0, "generation_s": 60.0},
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
            "engine": _engine_settings(),
            "router": router,
            # A free metrics port: a `duet serve` on this machine may hold the default one.
            "frontend": {"port": 0, "metrics_port": 0},
            "faults": fault_plan(config.seed, config.fault_rate),
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
            "frontend": {"port": 0, "metrics_port": None},
            "ray": {"address": config.address},
            "seed": config.seed,
        }
    )


# ---- one request -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRecord:
    request: SoakRequest
    status: str  # "OK" or the gRPC status code name
    accepted: bool
    lost: bool
    token_ids: tuple[int, ...] = ()
    latency_s: float = 0.0
    instances: tuple[InstanceWork, ...] = ()
    timeline: tuple[StateChange, ...] = ()
    message: str = ""

    @property
    def completed(self) -> bool:
        return self.status == "OK"

    @property
    def recovered(self) -> bool:
        return (
            len(self.instances) > 2
            or any(work.phase == "recompute" or work.attempt > 1 for work in self.instances)
        )


def run_request(client: DuetClient, request: SoakRequest, client_request_id: str | None = None) -> RequestRecord:
    """Send one request and classify how it ended (never raises for a gRPC status)."""
    import grpc

    started_s = time.monotonic()
    name = client_request_id or request.client_request_id
    try:
        done: Completion = client.complete(list(request.prompt_token_ids), client_request_id=name, **request.kwargs())
    except DuetError as error:
        elapsed_s = time.monotonic() - started_s
        result = error.result
        accepted = error.request_id is not None or result is not None or _known(client, name)
        lost = accepted and (
            error.code == grpc.StatusCode.DEADLINE_EXCEEDED
            or (result is None and error.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN))
        )
        return RequestRecord(
            request=request,
            status=error.code.name,
            accepted=accepted,
            lost=lost,
            latency_s=elapsed_s,
            instances=result.instances if result is not None else (),
            timeline=result.timeline if result is not None else (),
            message=error.message,
        )
    return RequestRecord(
        request=request,
        status="OK",
        accepted=True,
        lost=False,
        token_ids=done.token_ids,
        latency_s=done.total_s,
        instances=done.instances,
        timeline=done.timeline,
    )


def _known(client: DuetClient, client_request_id: str) -> bool:
    """Whether the router admitted a request whose call failed before any message came back."""
    import grpc

    try:
        client.get_request(client_request_id=client_request_id)
    except DuetError as error:
        if error.code == grpc.StatusCode.NOT_FOUND:
            return False
        raise SoakError(f"cannot tell whether {client_request_id} was admitted: {error}") from None
    return True


# ---- the report --------------------------------------------------------------------------------

_CAUSES = (
    (re.compile(r"KV transfer failed: ([A-Za-z_]+):"), None),
    (re.compile(r"died"), "instance_died"),
    (re.compile(r"restarted"), "instance_died"),
    (re.compile(r"exceeded its"), "stage_timeout"),
    (re.compile(r"unavailable"), "instance_unavailable"),
)
_ACTIONS = (
    ("retry transfer", "retry_transfer"),
    ("re-run prefill", "reprefill_elsewhere"),
    ("re-run colocated", "reprefill_elsewhere"),
    ("recompute locally", "recompute_local"),
)


def recovery_cause(detail: str) -> str:
    """What a recovery entry's detail says went wrong ("checksum_mismatch", "instance_died", ...)."""
    for pattern, name in _CAUSES:
        match = pattern.search(detail)
        if match:
            return name or match.group(1).lower()
    return "other"


def timeline_recoveries(timeline: Sequence[StateChange]) -> list[tuple[str, str]]:
    """(action, cause) of every recovery step in a request's timeline, and ("fail", cause) when
    recovery gave up."""
    found = []
    for entry in timeline:
        for prefix, action in _ACTIONS:
            if entry.detail.startswith(prefix):
                found.append((action, recovery_cause(entry.detail)))
                break
        else:
            if entry.state == "ERROR" and "recovery exhausted" in entry.detail:
                found.append(("fail", recovery_cause(entry.detail)))
    return found


def _percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _bucket(max_tokens: int) -> int:
    return max(0, math.ceil(math.log2(max_tokens)))


def extra_latencies(records: Sequence[RequestRecord]) -> list[float]:
    """For each recovered completed request: its latency minus the median latency of the
    non-recovered completed requests of its max_tokens bucket (skipped when that bucket has none)."""
    baseline: dict[int, list[float]] = {}
    for record in records:
        if record.completed and not record.recovered:
            baseline.setdefault(_bucket(record.request.max_tokens), []).append(record.latency_s)
    medians = {bucket: statistics.median(values) for bucket, values in baseline.items()}
    extras = []
    for record in records:
        if record.completed and record.recovered:
            median = medians.get(_bucket(record.request.max_tokens))
            if median is not None:
                extras.append(record.latency_s - median)
    return extras


@dataclass(frozen=True)
class Mismatch:
    client_request_id: str
    first_difference: int  # index of the first differing token (-1: the replay failed)
    detail: str


@dataclass(frozen=True)
class SoakReport:
    config: SoakConfig
    requests: int
    accepted: int
    completed: int
    failed_by_status: Mapping[str, int]  # accepted, ended with this status (lost ones excluded)
    rejected_by_status: Mapping[str, int]  # never admitted
    lost: int
    leaked_blocks: int
    token_mismatches: int
    illegal_transitions: int
    recovered: int
    extra_latency_p50_s: float | None
    extra_latency_p99_s: float | None
    recoveries_by_cause: Mapping[str, int]
    recoveries_by_action: Mapping[str, int]
    transfer_counters: Mapping[str, int]  # the faulty router's transfers_* counters
    planned_faults: Mapping[str, int]  # on first transfers, by "<kind>@<side>"
    kills: tuple[KillRecord, ...]
    unhealthy_after_settle: tuple[str, ...]
    duration_s: float
    replay_duration_s: float
    lost_ids: tuple[str, ...] = ()
    mismatches: tuple[Mismatch, ...] = ()
    failures: tuple[RequestRecord, ...] = ()  # accepted, not completed (lost ones included)
    instances_after: tuple[str, ...] = ()  # the faulty cluster's instances once settled

    @property
    def faults_fired(self) -> int:
        """Recovery steps seen in the timelines (each is a fault or a kill the cluster absorbed)."""
        return sum(self.recoveries_by_action.values())

    @property
    def kills_recovered(self) -> int:
        return sum(1 for kill in self.kills if kill.back_after_s is not None)

    @property
    def ok(self) -> bool:
        return all(getattr(self, name) == 0 for name in MUST_BE_ZERO)

    def figures(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "accepted": self.accepted,
            "completed": self.completed,
            "failed_by_status": dict(self.failed_by_status),
            "rejected_by_status": dict(self.rejected_by_status),
            "lost": self.lost,
            "leaked_blocks": self.leaked_blocks,
            "token_mismatches": self.token_mismatches,
            "illegal_transitions": self.illegal_transitions,
            "recovered": self.recovered,
            "extra_latency_p50_s": _round(self.extra_latency_p50_s),
            "extra_latency_p99_s": _round(self.extra_latency_p99_s),
            "faults_fired": self.faults_fired,
            "recoveries_by_cause": dict(self.recoveries_by_cause),
            "recoveries_by_action": dict(self.recoveries_by_action),
            "transfer_counters": dict(self.transfer_counters),
            "planned_faults": dict(self.planned_faults),
            "kills": len(self.kills),
            "kills_recovered": self.kills_recovered,
            "kill_back_after_s": [None if k.back_after_s is None else round(k.back_after_s, 1) for k in self.kills],
            "unhealthy_after_settle": list(self.unhealthy_after_settle),
            "duration_s": round(self.duration_s, 1),
            "replay_duration_s": round(self.replay_duration_s, 1),
            "seed": self.config.seed,
            "fault_rate": self.config.fault_rate,
            "kill_every": self.config.kill_every,
            "instances": f"{self.config.prefill} PREFILL + {self.config.generation} GENERATION",
        }

    def targets(self) -> dict[str, dict[str, Any]]:
        return {name: {"value": getattr(self, name), "target": 0, "met": getattr(self, name) == 0} for name in MUST_BE_ZERO}

    def json_line(self) -> str:
        """The DESIGN.md §8 envelope, one line."""
        return json.dumps({"bench": BENCH_NAME, "figures": self.figures(), "targets": self.targets()}, sort_keys=True)

    def table(self) -> str:
        def ms(seconds: float | None) -> str:
            return "-" if seconds is None else f"{seconds * 1000:.0f} ms"

        def counts(mapping: Mapping[str, int]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(mapping.items())) or "-"

        rows: list[tuple[str, str]] = [
            ("requests", str(self.requests)),
            ("accepted", str(self.accepted)),
            ("completed", str(self.completed)),
            ("failed with a status", f"{sum(self.failed_by_status.values())} ({counts(self.failed_by_status)})"),
            ("rejected at admission", f"{sum(self.rejected_by_status.values())} ({counts(self.rejected_by_status)})"),
            ("lost (must be 0)", str(self.lost)),
            ("leaked blocks (must be 0)", str(self.leaked_blocks)),
            ("token mismatches (must be 0)", str(self.token_mismatches)),
            ("illegal transitions (must be 0)", str(self.illegal_transitions)),
            ("recovered requests", str(self.recovered)),
            ("extra latency of recovered p50", ms(self.extra_latency_p50_s)),
            ("extra latency of recovered p99", ms(self.extra_latency_p99_s)),
            ("recoveries by cause", counts(self.recoveries_by_cause)),
            ("recoveries by action", counts(self.recoveries_by_action)),
            ("transfer counters", counts(self.transfer_counters)),
            ("faults planned on first transfers", f"{sum(self.planned_faults.values())} ({counts(self.planned_faults)})"),
            ("instance kills (back)", f"{len(self.kills)} ({self.kills_recovered})"),
            ("unhealthy after settle", ", ".join(self.unhealthy_after_settle) or "-"),
            ("soak / replay time", f"{self.duration_s:.1f} s / {self.replay_duration_s:.1f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [
            f"chaos soak: {self.config.prefill} PREFILL + {self.config.generation} GENERATION, seed {self.config.seed}, "
            f"fault rate {self.config.fault_rate:g}, kill every {self.config.kill_every or '-'}",
            "",
        ]
        lines += [f"{name.ljust(width)}  {value}" for name, value in rows]
        for record in self.failures[:10]:
            hops = ", ".join(f"{w.phase}@{w.instance_id}#{w.attempt}" for w in record.instances) or "-"
            last = record.timeline[-1].detail if record.timeline else record.message
            lines.append(f"failed: {record.request.client_request_id} {record.status} after {record.latency_s:.1f} s; hops {hops}; {last}")
        for mismatch in self.mismatches[:10]:
            lines.append(f"mismatch: {mismatch.client_request_id} at token {mismatch.first_difference}: {mismatch.detail}")
        if self.lost_ids:
            lines.append(f"lost: {', '.join(self.lost_ids[:20])}")
        if self.instances_after:
            lines.append("")
            lines += [f"after settling: {line}" for line in self.instances_after]
        lines.append("")
        lines.append("PASS" if self.ok else "FAIL: " + ", ".join(f"{name}={getattr(self, name)}" for name in MUST_BE_ZERO if getattr(self, name)))
        return "\n".join(lines) + "\n"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def build_report(
    config: SoakConfig,
    records: Sequence[RequestRecord],
    replayed: Mapping[str, RequestRecord],
    *,
    leaked_blocks: int,
    illegal_transitions: int,
    transfer_counters: Mapping[str, int],
    planned: Mapping[str, tuple[str, ...]],
    kills: Sequence[KillRecord],
    unhealthy: Sequence[str],
    duration_s: float,
    replay_duration_s: float,
    instances_after: Sequence[str] = (),
) -> SoakReport:
    """The report from the records of one soak and their replays (pure: tests feed it directly)."""
    failed: Counter = Counter()
    rejected: Counter = Counter()
    causes: Counter = Counter()
    actions: Counter = Counter()
    mismatches: list[Mismatch] = []
    lost_ids = []
    for record in records:
        if not record.accepted:
            rejected[record.status] += 1
            continue
        if record.lost:
            lost_ids.append(record.request.client_request_id)
        elif not record.completed:
            failed[record.status] += 1
        for action, cause in timeline_recoveries(record.timeline):
            actions[action] += 1
            causes[cause] += 1
        if record.completed:
            replay = replayed.get(record.request.client_request_id)
            if replay is None or not replay.completed:
                detail = "not replayed" if replay is None else f"replay failed: {replay.status} {replay.message}"
                mismatches.append(Mismatch(record.request.client_request_id, -1, detail))
            elif replay.token_ids != record.token_ids:
                first = next(
                    (i for i, (a, b) in enumerate(zip(record.token_ids, replay.token_ids, strict=False)) if a != b),
                    min(len(record.token_ids), len(replay.token_ids)),
                )
                mismatches.append(
                    Mismatch(
                        record.request.client_request_id,
                        first,
                        f"{len(record.token_ids)} tokens vs {len(replay.token_ids)} in the replay; hops "
                        + ", ".join(f"{w.phase}@{w.instance_id}#{w.attempt}" for w in record.instances),
                    )
                )
    extras = extra_latencies(records)
    planned_counts: Counter = Counter(kind for kinds in planned.values() for kind in kinds)
    return SoakReport(
        config=config,
        requests=len(records),
        accepted=sum(1 for r in records if r.accepted),
        completed=sum(1 for r in records if r.completed),
        failed_by_status=dict(sorted(failed.items())),
        rejected_by_status=dict(sorted(rejected.items())),
        lost=len(lost_ids),
        leaked_blocks=leaked_blocks,
        token_mismatches=len(mismatches),
        illegal_transitions=illegal_transitions,
        recovered=sum(1 for r in records if r.completed and r.recovered),
        extra_latency_p50_s=_percentile(extras, 50),
        extra_latency_p99_s=_percentile(extras, 99),
        recoveries_by_cause=dict(sorted(causes.items())),
        recoveries_by_action=dict(sorted(actions.items())),
        transfer_counters=dict(sorted(transfer_counters.items())),
        planned_faults=dict(sorted(planned_counts.items())),
        kills=tuple(kills),
        unhealthy_after_settle=tuple(unhealthy),
        duration_s=duration_s,
        replay_duration_s=replay_duration_s,
        lost_ids=tuple(lost_ids),
        mismatches=tuple(mismatches),
        failures=tuple(r for r in records if r.accepted and not r.completed),
        instances_after=tuple(instances_after),
    )


# ---- running it --------------------------------------------------------------------------------


@dataclass
class _Progress:
    """A tqdm bar on stderr (or nothing)."""

    total: int
    description: str
    enabled: bool
    _bar: Any = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __enter__(self) -> _Progress:
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.description, unit="req", dynamic_ncols=True, mininterval=0.5)
        return self

    def update(self, postfix: str | None = None) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._bar.update(1)
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=False)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.close()


def _instance_states(cluster: BackgroundCluster) -> dict[str, tuple[str, str]]:
    """instance id -> (incarnation, health) as the router sees it."""
    return cluster.call(
        lambda: {iid: (instance.info.incarnation, instance.health.value) for iid, instance in cluster.router.instances.items()}
    )


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)


class _Killer:
    """Kills instance actors on schedule, one at a time, and records when each came back."""

    def __init__(self, cluster: BackgroundCluster, restart_timeout_s: float, started_s: float) -> None:
        self._cluster = cluster
        self._restart_timeout_s = restart_timeout_s
        self._started_s = started_s
        self._pending: tuple[PlannedKill, str, float] | None = None  # kill, old incarnation, killed at
        self.records: list[KillRecord] = []

    def kill(self, planned: PlannedKill) -> None:
        import ray

        self.wait_for_last()
        _wait_until(lambda: all(h == "HEALTHY" for _, h in _instance_states(self._cluster).values()), self._restart_timeout_s)
        old = _instance_states(self._cluster)[planned.instance_id][0]
        actor = self._cluster.deployment.actors[planned.instance_id]
        logger.warning("chaos: killing instance %s (after request %d)", planned.instance_id, planned.after_request)
        ray.kill(actor, no_restart=False)
        self._pending = (planned, old, time.monotonic())

    def wait_for_last(self) -> None:
        """Wait (bounded) until the last victim is back: a new incarnation, HEALTHY."""
        if self._pending is None:
            return
        planned, old, killed_s = self._pending
        self._pending = None

        def back() -> bool:
            incarnation, health = _instance_states(self._cluster)[planned.instance_id]
            return incarnation != old and health == "HEALTHY"

        came_back = _wait_until(back, self._restart_timeout_s)
        if not came_back:
            logger.error("chaos: instance %s did not come back within %.0f s", planned.instance_id, self._restart_timeout_s)
        self.records.append(
            KillRecord(
                instance_id=planned.instance_id,
                after_request=planned.after_request,
                killed_at_s=killed_s - self._started_s,
                old_incarnation=old,
                back_after_s=time.monotonic() - killed_s if came_back else None,
            )
        )


def _drive(
    cluster: BackgroundCluster,
    requests: Sequence[SoakRequest],
    kills: Sequence[PlannedKill],
    config: SoakConfig,
    show_progress: bool,
    description: str,
    name: Callable[[SoakRequest], str],
) -> tuple[list[RequestRecord], list[KillRecord]]:
    """Send `requests` in order with at most `concurrency` in flight, killing on schedule."""
    kill_after = {kill.after_request: kill for kill in kills}
    started_s = time.monotonic()
    killer = _Killer(cluster, config.restart_timeout_s, started_s)
    slots = threading.BoundedSemaphore(config.concurrency)
    outcome_counts: Counter = Counter()
    with (
        _Progress(len(requests), description, show_progress) as bar,
        cluster.client(timeout_s=config.lost_after_s) as client,
        concurrent.futures.ThreadPoolExecutor(config.concurrency, thread_name_prefix="soak") as pool,
    ):

        def finished(future: concurrent.futures.Future) -> None:
            slots.release()
            record = None if future.exception() is not None else future.result()
            if record is not None:
                outcome_counts["recovered" if record.completed and record.recovered else record.status] += 1
            bar.update(", ".join(f"{k}={v}" for k, v in sorted(outcome_counts.items())))

        futures = []
        for request in requests:
            slots.acquire()
            future = pool.submit(run_request, client, request, name(request))
            future.add_done_callback(finished)
            futures.append(future)
            planned = kill_after.get(request.index)
            if planned is not None:
                killer.kill(planned)
                bar.write(f"killed {planned.instance_id} after request {planned.after_request}")
        records = [future.result() for future in futures]
    killer.wait_for_last()
    return records, killer.records


def _settle(cluster: BackgroundCluster, timeout_s: float) -> tuple[int, tuple[str, ...]]:
    """Wait (bounded) for every instance to be HEALTHY and all blocks free; (leaked, unhealthy)."""
    deadline = time.monotonic() + timeout_s
    _wait_until(lambda: all(h == "HEALTHY" for _, h in _instance_states(cluster).values()), timeout_s)
    seen = cluster.settle(timeout_s=max(1.0, deadline - time.monotonic()))
    unhealthy = tuple(sorted(iid for iid, (_, health) in _instance_states(cluster).items() if health != "HEALTHY"))
    return sum(total - free for free, total in seen.values()), unhealthy


def _instance_lines(cluster: BackgroundCluster) -> tuple[str, ...]:
    """One line per instance as the router sees it (for the report: where things stood)."""
    view = cluster.status()
    states = dict(view.requests_by_state)
    lines = [
        f"{i.instance_id} {i.health.value} free {i.free_blocks}/{i.total_blocks} queued {i.queued_requests} "
        f"running {i.running_requests} transfers {i.active_transfers}"
        for i in view.instances
    ]
    if states:
        lines.append("requests in flight by state: " + ", ".join(f"{k}={v}" for k, v in sorted(states.items())))
    return tuple(lines)


def _router_counters(cluster: BackgroundCluster) -> tuple[int, dict[str, int]]:
    extra = cluster.status().extra
    illegal = int(extra.get("illegal_transitions", 0) + extra.get("inconsistent_reports", 0))
    transfers = {key.removeprefix("transfers_"): int(value) for key, value in extra.items() if key.startswith("transfers_")}
    return illegal, transfers


def run_soak(config: SoakConfig, *, show_progress: bool = True) -> SoakReport:
    """Deploy, soak, settle, replay, report (see the module docstring). Raises SoakError when a
    cluster cannot be deployed; everything the clusters do wrong ends up in the report."""
    from cluster.deploy.launch import DeploymentError, connect_ray

    faulty_config = faulty_cluster_config(config)
    replay_config = replay_cluster_config(config)
    # Connected here so that both deployments share the Ray cluster and neither shuts it down.
    started_ray = connect_ray(faulty_config)
    faulty = BackgroundCluster(faulty_config)
    clean = BackgroundCluster(replay_config)
    try:
        try:
            with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="soak-deploy") as pool:
                starting = [pool.submit(cluster.start) for cluster in (faulty, clean)]
                for future in starting:
                    future.result()
        except DeploymentError as error:
            raise SoakError(f"cannot deploy: {error}") from None
        vocab_size = faulty.router.vocab_size
        requests = make_requests(config, vocab_size)
        plan = faulty_config.faults or {}
        planned = planned_faults(plan, requests)
        instance_ids = sorted(faulty.deployment.actors)
        schedule = kill_schedule(config, instance_ids)
        logger.info("soak: %d requests, %d planned faults on first transfers, %d kills", len(requests), len(planned), len(schedule))

        started_s = time.monotonic()
        records, kills = _drive(faulty, requests, schedule, config, show_progress, "soak", lambda r: r.client_request_id)
        leaked, unhealthy = _settle(faulty, config.settle_timeout_s)
        instances_after = _instance_lines(faulty)
        duration_s = time.monotonic() - started_s

        completed = [r.request for r in records if r.completed]
        replay_started_s = time.monotonic()
        replay_records, _ = _drive(
            clean, completed, (), config, show_progress, "replay", lambda r: f"{REPLAY_PREFIX}-{r.index}"
        )
        replay_duration_s = time.monotonic() - replay_started_s
        replayed = {record.request.client_request_id: record for record in replay_records}

        illegal_faulty, transfers = _router_counters(faulty)
        illegal_clean, _ = _router_counters(clean)
        return build_report(
            config,
            records,
            replayed,
            leaked_blocks=leaked,
            illegal_transitions=illegal_faulty + illegal_clean,
            transfer_counters=transfers,
            planned=planned,
            kills=kills,
            unhealthy=unhealthy,
            duration_s=duration_s,
            replay_duration_s=replay_duration_s,
            instances_after=instances_after,
        )
    finally:
        for cluster in (faulty, clean):
            try:
                cluster.stop()
            except Exception as error:  # noqa: BLE001 - stop both, report the first problem in the log
                logger.error("stopping a soak cluster: %s", error)
        if started_ray:
            import ray

            ray.shutdown()
