"""A simulated cluster: the real router (cluster/router/driver.py) over simulated instances, on virtual time.

    outcome = simulate(config, SimSettings(load_profile("cpu-builtin")), requests, PoissonArrivals(8.0))

The cluster configuration is the one `duet serve` reads (instance groups, `engine`, `router`,
`faults`), so a simulated cluster and a served one differ only in the model: each instance is a
cluster/sim/instance.py SimInstance with the profile's step times, KV transfers take the link
model's time, and the load runner of `duet bench` (cluster/loadgen/runner.py) sends the workload
through the router's own API (cluster/sim/client.py). Everything runs on one VirtualTimeLoop
(cluster/sim/vclock.py): the driver's poll loops, watchdog, health bounds and stage timeouts run
on simulated time, as do the runner's arrival schedule and every latency it records.

Faults: the configuration's `faults` plan (worker/kv_transfer/faults.py) acts on simulated
transfers; `SimSettings.deaths` kill instances at given times (and restart them, optionally).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cluster.deploy.config import ClusterConfig, InstanceGroup
from cluster.loadgen.arrivals import Arrivals
from cluster.loadgen.metrics import RequestRecord, Slo, compute_metrics
from cluster.loadgen.runner import LoadRunner, PointResult, SamplingSpec
from cluster.loadgen.workloads import BenchRequest
from cluster.router.api import ErrorKind
from cluster.router.driver import Router
from cluster.sim.capacity import pool_blocks
from cluster.sim.client import RouterClient
from cluster.sim.instance import SimInstance, SimNetwork
from cluster.sim.link import DATA_PLANES, DEFAULT_PLANE, LinkModel, Network
from cluster.sim.profile import StepProfile
from cluster.sim.vclock import run_virtual
from scheduler.block_hash import memoise_prompts
from worker.kv_transfer.faults import FaultInjector
from worker.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

SIM_VOCAB_SIZE = 32000
PROMPT_MEMO = 8192  # prompts whose block keys, hashes and events are kept (scheduler/block_hash.py memoise_prompts)
DEFAULT_RPC_LATENCY_S = 0.5e-3  # a Ray actor call on one host, where no profile measured it


@dataclass(frozen=True)
class InstanceDeath:
    """Kill `instance_id` at simulated second `at_s` (from the run's start); restart it after
    `restart_after_s` if given (a new incarnation, empty)."""

    instance_id: str
    at_s: float
    restart_after_s: float | None = None


@dataclass(frozen=True)
class SimSettings:
    profile: StepProfile
    link: LinkModel = DATA_PLANES[DEFAULT_PLANE]
    # One router/instance call's latency, seconds: a call acts this long after it is made, and a
    # poll's answer arrives this long after its mail (a Ray actor call). None: the profile's measured
    # one (StepProfile.rpc_latency_s), else DEFAULT_RPC_LATENCY_S.
    rpc_latency_s: float | None = None
    # The front end's one-way latency per message, seconds: a request reaches the router this long
    # after the client sends it, and each of its streamed messages reaches the client this long after
    # the router emits it (cluster/sim/client.py). None: the profile's measured one
    # (StepProfile.frontend_latency_s), else 0 (requests enter Router.submit directly).
    frontend_latency_s: float | None = None
    # cluster/sim/instance.py: 0 reports every step's tokens at once; None: each instance's engine.stream_interval_ms
    stream_interval_s: float | None = None
    max_seq_len: int = 16384
    deaths: tuple[InstanceDeath, ...] = ()
    sampling: SamplingSpec = SamplingSpec(timeout_s=None)
    seed: int = 0

    @property
    def rpc_s(self) -> float:
        if self.rpc_latency_s is not None:
            return self.rpc_latency_s
        measured = self.profile.rpc_latency_s
        return DEFAULT_RPC_LATENCY_S if measured is None else measured

    @property
    def frontend_s(self) -> float:
        if self.frontend_latency_s is not None:
            return self.frontend_latency_s
        return self.profile.frontend_latency_s or 0.0


@dataclass(frozen=True)
class InstanceReport:
    instance_id: str
    role: str
    utilisation: float  # busy (stepping) time / the run's duration
    steps: int
    context_tokens: int
    generated_tokens: int
    pauses: int
    transfers_sent: int
    transfers_failed: int
    bytes_sent: int
    bytes_received: int
    request_limited_steps: int = 0  # steps at engine.max_num_requests / max_batch_size with more requests waiting

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SimOutcome:
    point: PointResult
    instances: list[InstanceReport]
    router: dict[str, Any]
    virtual_s: float
    wall_s: float
    leaked_blocks: int = 0  # blocks live instances still held once they settled (simulate_async)
    held_requests: int = 0  # requests live instances still held once they settled
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def transfer_bytes(self) -> int:
        return sum(report.bytes_sent for report in self.instances)

    @property
    def request_limited_by_role(self) -> dict[str, float]:
        return request_limited_by_role((r.role, r.request_limited_steps, r.steps) for r in self.instances)

    def summary(self) -> dict[str, Any]:
        roles: dict[str, list[float]] = {}
        for report in self.instances:
            roles.setdefault(report.role, []).append(report.utilisation)
        return {
            "virtual_s": round(self.virtual_s, 3),
            "wall_s": round(self.wall_s, 3),
            "utilisation_by_role": {role: round(sum(u) / len(u), 4) for role, u in sorted(roles.items())},
            "request_limited_by_role": self.request_limited_by_role,
            "transfer_bytes": self.transfer_bytes,
            "transfers": sum(r.transfers_sent for r in self.instances),
            "transfers_failed": sum(r.transfers_failed for r in self.instances),
            "pauses": sum(r.pauses for r in self.instances),
            "leaked_blocks": self.leaked_blocks,
            "held_requests": self.held_requests,
            "router": self.router,
        }


# The engine settings that size an instance's KV pool.
_POOL_SETTINGS = ("num_blocks", "kv_cache_bytes")


def _sizes_pool(engine: dict[str, Any]) -> bool:
    """Whether these engine settings (a configuration's or a group's) size the KV pool."""
    return any(name in engine for name in _POOL_SETTINGS)


def with_profile_pool(config: ClusterConfig, profile: StepProfile) -> ClusterConfig:
    """The configuration with the profile's KV pool (`kv_pool_bytes`: a roofline's estimate of the
    device's memory) as engine.kv_cache_bytes when its engine section sizes none (a group that
    sizes its own keeps it). The engine's default pool (256 MiB) is a CPU instance's: it holds one
    2,048-token request of an 8B model, and a GPU simulated with it would serve one request at a
    time. duet sim and duet plan apply it, so that the YAML duet plan writes says what was simulated."""
    if profile.kv_pool_bytes is None or _sizes_pool(config.engine):
        return config
    if all(_sizes_pool(group.engine) for group in config.instances):
        return config  # every group sizes its own
    return msgspec.structs.replace(config, engine={**config.engine, "kv_cache_bytes": profile.kv_pool_bytes})


def pool_summary(config: ClusterConfig, profile: StepProfile) -> str:
    """The instances' KV pool in blocks and tokens, per instance group where they differ, in words
    (duet sim and duet plan print it)."""
    parts = {}
    for group in config.instances:
        engine = config.engine_config(group)
        blocks = pool_blocks(engine, profile)
        parts[group.role.name] = f"{blocks:,} blocks ({blocks * engine.tokens_per_block:,} tokens)"
    if len(set(parts.values())) == 1:
        return next(iter(parts.values()))
    return "; ".join(f"{role} {text}" for role, text in parts.items())


def pool_shortfalls(
    config: ClusterConfig, profile: StepProfile, requests: Sequence[BenchRequest], groups: Sequence[InstanceGroup] | None = None
) -> list[tuple[str, int]]:
    """For each instance group (default: the config's) whose KV pool cannot hold some of `requests`
    at their longest (prompt + max_tokens; a follow-up turn's history not counted): a sentence
    saying so, and how many. Those requests are refused at submission (worker/engine_types.py
    kv_pool_refusal); this says it before a simulation runs."""
    lengths = [
        (len(r.prompt.encode()) if isinstance(r.prompt, str) else len(r.prompt)) + r.max_tokens for r in requests
    ]
    shortfalls = []
    for group in groups if groups is not None else [g for g in config.instances if g.count]:
        engine = config.engine_config(group)
        blocks = pool_blocks(engine, profile)
        capacity_tokens = blocks * engine.tokens_per_block
        too_long = [length for length in lengths if length > capacity_tokens]
        if too_long:
            shortfalls.append((
                f"a {group.role.name} instance's KV pool of {blocks} blocks ({capacity_tokens} tokens of {profile.model}) "
                f"cannot hold {len(too_long)} of the {len(requests)} requests (prompt + max_tokens up to {max(too_long)} "
                "tokens): they would be refused; raise engine.num_blocks or engine.kv_cache_bytes (--config), or shorten "
                "the workload",
                len(too_long),
            ))
    return shortfalls


def instance_id(role_name: str, index: int) -> str:
    """A simulated instance's id (what `duet sim --kill` names): its role in lower case and its index
    within the role's group."""
    return f"{role_name.lower()}-{index}"


def instance_ids_summary(config: ClusterConfig) -> str:
    """The ids `config` simulates, a range per group: "prefill-0 to prefill-63, generation-0 to ..."."""
    return ", ".join(
        instance_id(group.role.name, 0) if group.count == 1
        else f"{instance_id(group.role.name, 0)} to {instance_id(group.role.name, group.count - 1)}"
        for group in config.instances if group.count
    )


def check_deaths(config: ClusterConfig, deaths: Sequence[InstanceDeath]) -> None:
    """Raise ValueError for a death of an instance `config` does not simulate (instance_id)."""
    known = {instance_id(group.role.name, index) for group in config.instances for index in range(group.count)}
    for death in deaths:
        if death.instance_id not in known:
            raise ValueError(f"no instance {death.instance_id!r} (instances: {instance_ids_summary(config)})")


def build_instances(config: ClusterConfig, settings: SimSettings) -> tuple[list[SimInstance], SimNetwork]:
    # Every request's prompt is cut into blocks and hashed by the router and both its instances, all
    # in this process: each prompt once, for the last PROMPT_MEMO prompts (a request's generation
    # instance publishes its prompt up to its time to first token after the router hashed it).
    memoise_prompts(PROMPT_MEMO)
    faults = FaultInjector.from_mapping(config.faults) if config.faults else None
    network = SimNetwork(Network(settings.link), faults)
    instances = []
    for group in config.instances:
        engine = config.engine_config(group)
        for index in range(group.count):
            name = instance_id(group.role.name, index)
            instances.append(
                SimInstance(
                    name, engine, settings.profile, network,
                    vocab_size=SIM_VOCAB_SIZE, max_seq_len=settings.max_seq_len, rpc_latency_s=settings.rpc_s,
                    stream_interval_s=engine.stream_interval_ms / 1e3 if settings.stream_interval_s is None else settings.stream_interval_s,
                    rng=random.Random(f"{settings.seed}:{name}"),
                )
            )
    return instances, network


async def simulate_async(
    config: ClusterConfig,
    settings: SimSettings,
    requests: Sequence[BenchRequest],
    arrivals: Arrivals,
    slo: Slo | None = None,
    *,
    on_done: Any = None,
    on_start: Any = None,
    on_first_token: Any = None,
    instances_out: list[SimInstance] | None = None,
) -> SimOutcome:
    """`on_done(record)` for each request as it ends; `on_first_token(index)` as the first tokens of
    the request of that index arrive; `on_start(loop_time_s)` when the first request
    could be sent (the instances registered): the time the arrivals' offsets count from;
    `instances_out` receives the simulated instances (their stats, should the run be cancelled)."""
    check_deaths(config, settings.deaths)  # before any work
    loop = asyncio.get_running_loop()
    wall_started = time.perf_counter()
    instances, network = build_instances(config, settings)
    if instances_out is not None:
        instances_out.extend(instances)
    router = Router(
        config.router,
        ByteTokenizer(),
        vocab_size=SIM_VOCAB_SIZE,
        max_seq_len=settings.max_seq_len,
        tokens_per_block=config.tokens_per_block,
        clock=loop.time,
        wall_clock=loop.time,
        seed=settings.seed,
        request_id_prefix=f"sim{settings.seed}",  # the same ids, so the same fault draws, in every run
    )
    await router.start()
    for instance in instances:
        await router.add_instance(instance)
    by_id = {instance.instance_id: instance for instance in instances}
    started_s = loop.time()
    for death in settings.deaths:
        instance = by_id[death.instance_id]  # check_deaths
        loop.call_at(started_s + death.at_s, instance.kill)
        if death.restart_after_s is not None:
            loop.call_at(started_s + death.at_s + death.restart_after_s, instance.restart)
    runner = LoadRunner(
        RouterClient(router, settings.frontend_s), settings.sampling, clock=loop.time, on_done=on_done, on_first_token=on_first_token
    )
    if on_start is not None:
        on_start(started_s)
    outcome = await runner.run(requests, arrivals, seed=settings.seed)
    virtual_s = loop.time() - started_s
    await _settle(instances, settle_limit_s(config))
    await router.stop()
    reports = []
    leaked = held = 0
    for instance in instances:
        stats = instance.stats
        if not instance.dead:
            instance.check_integrity()
            # Blocks still referenced once the instances settled (cached prefix blocks are free).
            leaked += instance.blocks.num_blocks - instance.blocks.num_free_blocks
            held += instance.num_requests
        reports.append(
            InstanceReport(
                instance.instance_id, instance.role.name, stats.busy_s / max(virtual_s, 1e-9), stats.steps,
                stats.context_tokens, stats.generated_tokens, stats.pauses, stats.transfers_sent,
                stats.transfers_failed, stats.bytes_sent, network.network.bytes_received.get(instance.instance_id, 0),
                stats.request_limited_steps,
            )
        )
    point = PointResult(arrivals, outcome, compute_metrics(outcome.records, outcome.duration_s, slo or Slo()))
    router_figures = {
        "illegal_transitions": router.illegal_transitions,
        "inconsistent_reports": router.inconsistent_reports,
        # By name: the figures are written as JSON with sorted keys (enums do not sort).
        "recovery_actions": {action.value: count for action, count in router.recovery_actions.items()},
        "transfers": dict(router.transfers),
    }
    return SimOutcome(point, reports, router_figures, virtual_s, time.perf_counter() - wall_started, leaked, held)


SETTLE_POLL_S = 0.05  # how often the settling looks at the instances, simulated seconds


def settle_limit_s(config: ClusterConfig) -> float:
    """How long, in simulated seconds, the instances may still hold requests after the last one
    ended: a push in flight runs to its deadline (router.timeouts.transfer_s, and a stall's half
    second past it), then a failed one's request waits out its sender lease, a reservation its
    timeout. Past this, what an instance holds is a leak."""
    engines = [config.engine_config(group) for group in config.instances]
    lease_s = max(max(engine.sender_lease_s, engine.reservation_timeout_s) for engine in engines)
    return config.router.timeouts.transfer_s + lease_s + 1.0


async def _settle(instances: Sequence[SimInstance], limit_s: float) -> None:
    """Wait, on simulated time and at most `limit_s`, until no live instance holds a request. A
    request can outlive its end at the router: a push still in flight to a stalled receiver when
    the run's last request ends, a failed push's request waiting out its sender lease, a
    reservation its timeout. The leak check comes after (simulate_async); the run's figures are
    taken before."""
    loop = asyncio.get_running_loop()
    until_s = loop.time() + limit_s
    while any(instance.num_requests for instance in instances if not instance.dead) and loop.time() < until_s:
        await asyncio.sleep(SETTLE_POLL_S)


def request_limited_by_role(counts: Iterable[tuple[str, int, int]]) -> dict[str, float]:
    """Per role, the share of its instances' steps taken at the engine's request limits
    (engine.max_num_requests, engine.max_batch_size) with more requests waiting, from
    (role, request-limited steps, steps) per instance (InstanceStats.request_limited_steps)."""
    totals: dict[str, list[int]] = {}
    for role, limited, steps in counts:
        total = totals.setdefault(role, [0, 0])
        total[0] += limited
        total[1] += steps
    return {role: round(limited / max(steps, 1), 4) for role, (limited, steps) in sorted(totals.items())}


# A role whose steps ran at the request limits this often was capped by them (duet sim and plan warn).
# Near a configuration's highest rate some steps reach any limit; in a duet plan of 2 H100s (roofline,
# 256 / 128 tokens) 72 % of the steps at the best rate ran at limits of 64 and raising them to 256
# lifted the rate 1.8x, while 45 % ran at 256 and raising them to 1,024 lifted it 1.06x.
REQUEST_LIMITED_WARN_SHARE = 0.5


def request_limit_warning(config: ClusterConfig, shares: dict[str, float]) -> str | None:
    """A sentence when the engine's request limit capped some role's batches, else None."""
    capped = {role: share for role, share in shares.items() if share >= REQUEST_LIMITED_WARN_SHARE}
    if not capped:
        return None
    where = " and ".join(f"{share:.0%} of the {role} instances' steps" for role, share in capped.items())
    return (
        f"{where} ran at the engine's request limits ({request_limits(config, capped)}) with more requests waiting: those "
        "limits, not the KV pool or the step time, capped their batches; raise them in --config for the device you simulate"
    )


def request_limits(config: ClusterConfig, roles: Collection[str] | None = None) -> str:
    """engine.max_num_requests and engine.max_batch_size of the instance groups (of `roles`), in words."""
    engines = [config.engine_config(g) for g in config.instances if roles is None or g.role.name in roles]
    requests = sorted({engine.max_num_requests for engine in engines})
    batches = sorted({engine.max_batch_size for engine in engines})
    return (
        f"engine.max_num_requests: {', '.join(map(str, requests))}, engine.max_batch_size: {', '.join(map(str, batches))}"
    )


def refused_at_admission(record: RequestRecord) -> bool:
    """Whether the router refused the request at its admission limit (RESOURCE_EXHAUSTED is that
    refusal and no other, cluster/router/api.py)."""
    return record.status == ErrorKind.RESOURCE_EXHAUSTED.value


def simulate(
    config: ClusterConfig,
    settings: SimSettings,
    requests: Sequence[BenchRequest],
    arrivals: Arrivals,
    slo: Slo | None = None,
    *,
    on_done: Any = None,
) -> SimOutcome:
    """Run one simulation to completion on a fresh virtual-time loop (takes only wall time for the
    callbacks it runs)."""
    return run_virtual(simulate_async(config, settings, requests, arrivals, slo, on_done=on_done))
