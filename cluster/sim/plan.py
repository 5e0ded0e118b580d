"""Capacity planning in the simulator: which split of N instances, under which placement policy, serves
the most requests per second per instance within the SLOs (DistServe's "goodput per GPU").

Candidates: all N MIXED (colocated), and every P:D split with P + D = N, P, D >= 1 (disaggregated);
each under every placement policy for the decision that matters there (the prefill instance's
choice for a split, the MIXED instance's choice for colocated). For each candidate the search
finds the highest Poisson rate at which at least `attainment` of the requests meet both SLOs: the
rate doubles from a start until a probe fails, then bisects between the last pass and the first
failure. Goodput per instance is that rate / N. Every probe is a full simulation (cluster/sim/
cluster.py) of `duration_s` of arrivals at its rate (so an overload has time to build a queue),
taken from the front of one seeded pool of requests, so candidates are compared on identical
requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from cluster.deploy.config import ClusterConfig, InstanceGroup
from cluster.loadgen.arrivals import PoissonArrivals
from cluster.loadgen.metrics import RequestRecord, Slo
from cluster.loadgen.workloads import BenchRequest
from cluster.router.config import DisaggMode, KvAwareParams, LeastLoadedParams, RoundRobinParams
from cluster.sim.cluster import SimSettings, simulate
from worker.protocol import InstanceRole

POLICIES = {"round_robin": RoundRobinParams(), "least_loaded": LeastLoadedParams(), "kv_aware": KvAwareParams()}


@dataclass(frozen=True)
class Candidate:
    num_prefill: int  # 0: all MIXED
    num_generation: int
    policy: str

    @property
    def label(self) -> str:
        split = f"{self.num_generation} MIXED" if self.num_prefill == 0 else f"{self.num_prefill}P:{self.num_generation}D"
        return f"{split} {self.policy}"

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_generation

    def config(self, base: ClusterConfig) -> ClusterConfig:
        """`base` with this split and policy: what `duet serve` would run."""
        groups = {group.role: group for group in base.instances}
        placement = base.router.placement
        policy = POLICIES[self.policy]
        if self.num_prefill == 0:
            roles = {InstanceRole.MIXED: self.num_generation}
            placement = msgspec.structs.replace(placement, disaggregation=DisaggMode.NEVER, generation_policy=policy)
        else:
            roles = {InstanceRole.PREFILL: self.num_prefill, InstanceRole.GENERATION: self.num_generation}
            disaggregation = DisaggMode.ALWAYS if placement.disaggregation is DisaggMode.NEVER else placement.disaggregation
            placement = msgspec.structs.replace(placement, disaggregation=disaggregation, prefill_policy=policy)
        instances = tuple(
            msgspec.structs.replace(groups.get(role, InstanceGroup(role)), count=count) for role, count in roles.items()
        )
        router = msgspec.structs.replace(base.router, placement=placement)
        return msgspec.structs.replace(base, instances=instances, router=router)


def candidates(num_instances: int, policies: Sequence[str] = tuple(POLICIES)) -> list[Candidate]:
    splits = [(0, num_instances)] + [(p, num_instances - p) for p in range(1, num_instances)]
    return [Candidate(p, d, policy) for p, d in splits for policy in policies]


@dataclass
class Probe:
    rate_per_s: float
    attainment: float
    completed: int


@dataclass
class CandidateResult:
    candidate: Candidate
    max_rate_per_s: float  # the highest probed rate that met the attainment (0: none did)
    probes: list[Probe] = field(default_factory=list)

    @property
    def goodput_per_instance(self) -> float:
        return self.max_rate_per_s / self.candidate.num_instances


def slo_attainment(records: Sequence[RequestRecord], slo: Slo) -> float:
    if not records:
        return 0.0
    return sum(1 for record in records if record.ok and slo.met_by(record)) / len(records)


def search(
    candidate: Candidate,
    base: ClusterConfig,
    settings: SimSettings,
    requests: Sequence[BenchRequest],
    slo: Slo,
    *,
    attainment: float = 0.9,
    start_rate_per_s: float = 1.0,
    duration_s: float = 30.0,
    min_requests: int = 40,
    max_doublings: int = 12,
    bisections: int = 4,
) -> CandidateResult:
    config = candidate.config(base)
    result = CandidateResult(candidate, 0.0)

    def passes(rate: float) -> bool:
        count = max(min_requests, min(len(requests), round(rate * duration_s)))
        outcome = simulate(config, settings, requests[:count], PoissonArrivals(rate), slo)
        share = slo_attainment(outcome.point.outcome.records, slo)
        result.probes.append(Probe(rate, share, outcome.point.metrics.completed))
        return share >= attainment

    low, high = 0.0, start_rate_per_s
    for _ in range(max_doublings):
        if not passes(high):
            break
        low, high = high, high * 2
    else:
        result.max_rate_per_s = low
        return result
    for _ in range(bisections):
        middle = (low + high) / 2 if low else high / 2
        if passes(middle):
            low = middle
        else:
            high = middle
    result.max_rate_per_s = low
    return result


def plan(
    base: ClusterConfig,
    settings: SimSettings,
    requests: Sequence[BenchRequest],
    slo: Slo,
    num_instances: int,
    *,
    policies: Sequence[str] = tuple(POLICIES),
    attainment: float = 0.9,
    duration_s: float = 30.0,
    progress: Callable[[str], None] = lambda _m: None,
) -> list[CandidateResult]:
    """Every candidate's search; the best is the one with the highest goodput per instance."""
    # One rate to start every search from: an instance's share of a modest rate, so that the
    # doubling phase is short for every candidate.
    start = max(0.25, num_instances / 4)
    results = []
    for candidate in candidates(num_instances, policies):
        started = time.perf_counter()
        result = search(
            candidate, base, settings, requests, slo, attainment=attainment, start_rate_per_s=start, duration_s=duration_s
        )
        progress(
            f"{candidate.label}: {result.max_rate_per_s:.3g} req/s within the SLOs "
            f"({len(result.probes)} simulations, {time.perf_counter() - started:.1f}s)"
        )
        results.append(result)
    return results


def best(results: Sequence[CandidateResult]) -> CandidateResult:
    return max(results, key=lambda r: (r.goodput_per_instance, -r.candidate.num_prefill))
