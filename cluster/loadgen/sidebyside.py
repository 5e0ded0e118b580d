"""Several embedded clusters measured side by side in one run, for the comparison benchmarks.

The clusters start together (actors start in parallel; the bench waits once) and are then measured
one at a time with the same seeded workload. Runs are interleaved in rounds, and each round
rotates the order of the variants, so that drift in the machine's background load (a shared 2-core
box is noisy) falls on every variant alike; each round draws its workload with seed + round, so a
later round never hits prefix-cache entries an earlier one left. Results of a variant's rounds are
pooled (`merge_outcomes`).

    with ray_session(first_config):
        clusters = start_clusters([Variant("disagg", a), Variant("colocated", b)])
        try:
            warm_up(clusters, workload, count=4, seed=0)
            results = compare(clusters, Scenario("decode-heavy", workload, PoissonArrivals(4.0)), rounds=2, seed=0)
        finally:
            stop_clusters(clusters)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from cluster.client import AsyncDuetClient
from cluster.deploy.config import ClusterConfig
from cluster.deploy.embedded import BackgroundCluster
from cluster.deploy.launch import connect_ray
from cluster.loadgen.arrivals import Arrivals
from cluster.loadgen.metrics import Slo, compute_metrics
from cluster.loadgen.runner import LoadRunner, PointResult, RunOutcome, SamplingSpec, merge_outcomes
from cluster.loadgen.workloads import (
    WARMUP_SEED_OFFSET,
    BenchRequest,
    WorkloadConfig,
    build_workload,
    warmup_config,
)

logger = logging.getLogger(__name__)

GREEDY = SamplingSpec()  # greedy, ignore_eos: output lengths are the workload's
Progress = Callable[[str], None]


class SideBySideError(RuntimeError):
    """A cluster of the comparison did not start or did not settle."""


@dataclass(frozen=True)
class Variant:
    name: str
    config: ClusterConfig


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: WorkloadConfig
    arrivals: Arrivals
    slo: Slo = field(default_factory=Slo)


def _quiet(_message: str) -> None:
    return None


@contextlib.contextmanager
def ray_session(config: ClusterConfig) -> Iterator[None]:
    """Ray for the whole comparison (started from this, the main, thread; shut down after), so
    that starting and stopping each cluster does not start and stop Ray."""
    import ray  # when a comparison runs, as cluster/deploy/launch.py does: importing this module stays cheap

    started = connect_ray(config)
    try:
        yield
    finally:
        if started and ray.is_initialized():
            ray.shutdown()


def start_clusters(variants: Sequence[Variant], *, progress: Progress = _quiet, timeout_s: float = 600.0) -> dict[str, BackgroundCluster]:
    """Start every variant's cluster at once; all of them, or none (the started ones are stopped)."""
    names = [variant.name for variant in variants]
    if len(set(names)) != len(names):
        raise SideBySideError(f"variant names must be unique, got {names}")
    clusters = {variant.name: BackgroundCluster(variant.config) for variant in variants}
    errors: dict[str, BaseException] = {}

    def start(name: str) -> None:
        try:
            clusters[name].start(timeout_s=timeout_s)
        except BaseException as error:  # noqa: BLE001 - collected and re-raised below, with the others stopped
            errors[name] = error

    started_s = time.monotonic()
    threads = [threading.Thread(target=start, args=(name,), name=f"start-{name}") for name in clusters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        stop_clusters({name: c for name, c in clusters.items() if name not in errors})
        name, error = next(iter(errors.items()))
        raise SideBySideError(f"cluster {name!r} did not start: {error}") from error
    progress(f"{len(clusters)} clusters serving ({time.monotonic() - started_s:.1f}s to start): " + ", ".join(clusters))
    return clusters


def stop_clusters(clusters: Mapping[str, BackgroundCluster]) -> None:
    for name, cluster in clusters.items():
        try:
            cluster.stop()
        except Exception:  # noqa: BLE001 - stop the others regardless; the failure is logged
            logger.exception("stopping cluster %s", name)


async def _run(target: str, requests: Sequence[BenchRequest], arrivals: Arrivals | None, seed: int, sampling: SamplingSpec) -> RunOutcome:
    async with AsyncDuetClient(target) as client:
        runner = LoadRunner(client, sampling)
        if arrivals is None:
            records = await runner.warmup(requests)
            return RunOutcome(records, 1.0, 0.0)
        return await runner.run(requests, arrivals, seed=seed)


def settle(cluster: BackgroundCluster, name: str, timeout_s: float = 30.0) -> None:
    """Wait until nothing is in flight and every block is free again: the next run starts from an
    idle cluster. Blocks that stay taken are a leak, reported loudly."""
    seen = cluster.settle(timeout_s)
    leaked = {instance: total - free for instance, (free, total) in seen.items() if free != total}
    if leaked:
        raise SideBySideError(f"cluster {name!r} did not settle within {timeout_s}s: blocks still taken {leaked}")


def warm_up(
    clusters: Mapping[str, BackgroundCluster],
    workload: WorkloadConfig,
    *,
    count: int,
    seed: int,
    sampling: SamplingSpec = GREEDY,
    progress: Progress = _quiet,
) -> None:
    """Unmeasured requests on every cluster (first-call costs: channels, allocator, kernels)."""
    requests = build_workload(warmup_config(workload, count), seed + WARMUP_SEED_OFFSET)
    for name, cluster in clusters.items():
        outcome = asyncio.run(_run(cluster.target, requests, None, seed, sampling))
        failed = [r for r in outcome.records if not r.ok]
        if failed:
            raise SideBySideError(f"warm-up on {name!r}: {len(failed)} of {len(requests)} failed (first: {failed[0].error})")
        settle(cluster, name)
    progress(f"warmed up: {count} requests on each of {', '.join(clusters)}")


def compare(
    clusters: Mapping[str, BackgroundCluster],
    scenario: Scenario,
    *,
    rounds: int,
    seed: int,
    sampling: SamplingSpec = GREEDY,
    progress: Progress = _quiet,
) -> dict[str, PointResult]:
    """The scenario on every cluster, `rounds` times, interleaved; per variant, its pooled result."""
    if rounds < 1:
        raise SideBySideError(f"rounds must be >= 1, got {rounds}")
    names = list(clusters)
    outcomes: dict[str, list[RunOutcome]] = {name: [] for name in names}
    for round_index in range(rounds):
        requests = build_workload(scenario.workload, seed + round_index)
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            outcome = asyncio.run(_run(clusters[name].target, requests, scenario.arrivals, seed + round_index, sampling))
            settle(clusters[name], name)
            outcomes[name].append(outcome)
            done = sum(r.ok for r in outcome.records)
            progress(
                f"{scenario.name} round {round_index + 1}/{rounds} {name}: {done}/{len(requests)} done in {outcome.duration_s:.1f}s"
            )
    results = {}
    for name in names:
        merged = merge_outcomes(outcomes[name])
        results[name] = PointResult(scenario.arrivals, merged, compute_metrics(merged.records, merged.duration_s, scenario.slo))
    return results
