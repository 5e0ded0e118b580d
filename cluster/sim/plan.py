"""Capacity planning in the simulator: which split of N instances, under which placement policy, serves
the most requests per second per instance within the SLOs (DistServe's "goodput per GPU").

Candidates: all N MIXED (colocated), and every P:D split with P + D = N, P, D >= 1 (disaggregated);
each under every placement policy for the decision that matters there (the prefill instance's
choice for a split, the MIXED instance's choice for colocated). For each candidate the search
finds the highest Poisson rate at which at least `attainment` of the requests meet both SLOs: the
rate doubles from a start until a probe fails, then bisects between the last pass and the first
failure. Goodput per instance is that rate / N.

A probe at rate R is a full simulation (cluster/sim/cluster.py) of `duration_s` of arrivals at R:
R x duration_s requests (so an overload has the whole window to build a queue), taken from the
front of one seeded pool, so candidates are compared on identical requests. A pool shorter than
the window is followed by copies of itself whose token ids are shifted (the same lengths, no
prefix shared with an earlier copy), never cut short: a probe that sent only the pool would be a
burst the size of the pool at any rate, which a large enough cluster absorbs at every rate.

A request has missed the SLOs, whether or not it ever finishes, once it is certain: it has no token
by its send time + the TTFT objective; or it has not finished by its first token's time + TPOT x
(max_tokens - 1) (its TPOT, the mean gap after the first token, is then over the objective however
many tokens it ends with), or by its send time + the e2e objective. A probe ends as soon as its
verdict is certain (enough requests met the SLOs, or too many missed them), so an overloaded probe
costs a fraction of its window, not the drain of its queue: a prompt queue shows within the TTFT
objective, a decode queue within a request's TPOT allowance. The verdict is the one the whole run
would give.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import multiprocessing
import queue
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from cluster.deploy.config import ClusterConfig, InstanceGroup
from cluster.loadgen.arrivals import PoissonArrivals
from cluster.loadgen.metrics import RequestRecord, Slo
from cluster.loadgen.workloads import BenchRequest
from cluster.router.config import DisaggMode, KvAwareParams, LeastLoadedParams, RoundRobinParams
from cluster.sim.cluster import (
    SIM_VOCAB_SIZE,
    SimSettings,
    refused_at_admission,
    request_limited_by_role,
    simulate_async,
)
from cluster.sim.instance import SimInstance
from cluster.sim.vclock import run_virtual
from worker.protocol import InstanceRole

POLICIES = {"round_robin": RoundRobinParams(), "least_loaded": LeastLoadedParams(), "kv_aware": KvAwareParams()}
# Bisection steps after the doubling phase: the doubled bracket [R, 2R] narrows to R / 2**steps.
DEFAULT_BISECTIONS = 4
MAX_BISECTIONS = 12


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


def candidates(
    num_instances: int, policies: Sequence[str] = tuple(POLICIES), prefill_counts: Sequence[int] | None = None
) -> list[Candidate]:
    """All MIXED (prefill count 0) and every P:D split with P + D = `num_instances`, under each policy;
    `prefill_counts` keeps only those splits (0: all MIXED), in increasing order."""
    counts = range(num_instances) if prefill_counts is None else sorted(set(prefill_counts))
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < num_instances:
            raise ValueError(f"prefill instance counts from 0 (all MIXED) to {num_instances - 1}, got {count!r}")
    if not counts:
        raise ValueError("no split to search")
    splits = [(p, num_instances if p == 0 else num_instances - p) for p in counts]
    return [Candidate(p, d, policy) for p, d in splits for policy in policies]


@dataclass
class Probe:
    rate_per_s: float
    # The share of the probe's requests that met both SLOs; when `decided_early`, the bound that
    # decided it (at least this share met them on a pass, at most this share could on a failure).
    attainment: float
    completed: int  # requests that ended (met or not) before the verdict
    passed: bool = False
    requests: int = 0
    decided_early: bool = False
    # Requests the router refused at its admission limit (router.admission.max_queued_requests):
    # misses the configuration caused, not the instances.
    refused: int = 0
    # Per role, the share of steps at the engine's request limit with requests waiting (the limit,
    # not the simulated device, capped those batches: cluster/sim/cluster.py request_limited_by_role).
    request_limited: dict[str, float] = field(default_factory=dict)
    # Simulated seconds from the first send to the verdict (or to the run's end): how much of its
    # window the probe took.
    simulated_s: float = 0.0


@dataclass
class CandidateResult:
    candidate: Candidate
    max_rate_per_s: float  # the highest probed rate that met the attainment (0: none did)
    probes: list[Probe] = field(default_factory=list)
    # Set when the search stopped at the rate to beat (the best candidate's so far), which this one
    # did not sustain: its own maximum is below it, and was not searched further.
    below_rate_per_s: float | None = None
    # Set when every rate the search doubled to passed: its maximum is at least max_rate_per_s,
    # not that (the search stopped at its limit of doublings, not at a failure).
    unbounded: bool = False

    @property
    def goodput_per_instance(self) -> float:
        return self.max_rate_per_s / self.candidate.num_instances


def slo_attainment(records: Sequence[RequestRecord], slo: Slo) -> float:
    if not records:
        return 0.0
    return sum(1 for record in records if record.ok and slo.met_by(record)) / len(records)


# Token ids of a copy of the pool are shifted by this much per copy (mod the vocabulary): a prime,
# so that copies share no block of content with each other or with the pool.
COPY_TOKEN_SHIFT = 7919


def window_requests(pool: Sequence[BenchRequest], count: int) -> list[BenchRequest]:
    """The first `count` requests of the pool followed by copies of it (token ids shifted per copy,
    indexes and follow-ups renumbered): a probe's window is never cut short by the pool's size."""
    if not pool:
        raise ValueError("the request pool is empty")
    size = len(pool)
    requests = list(pool[:count])
    for index in range(size, count):
        copy, position = divmod(index, size)
        original = pool[position]
        prompt = original.prompt
        if isinstance(prompt, str):
            prompt = f"[{copy}] {prompt}"
        else:
            prompt = tuple((token + copy * COPY_TOKEN_SHIFT) % SIM_VOCAB_SIZE for token in prompt)
        requests.append(dataclasses.replace(
            original, index=original.index + copy * size, prompt=prompt,
            after=None if original.after is None else original.after + copy * size,
        ))
    return requests


def slo_deadline_s(slo: Slo, max_tokens: int) -> float:
    """The longest a request of `max_tokens` output tokens may take from its send to its end and still
    meet `slo`: TTFT + TPOT x (max_tokens - 1) when both are set (e2e = TTFT + TPOT x (n - 1) for
    n >= 2 tokens, and n <= max_tokens), the e2e objective if smaller; infinite when neither bounds it."""
    bound_s = math.inf
    if slo.ttft_ms is not None and slo.tpot_ms is not None:
        bound_s = (slo.ttft_ms + slo.tpot_ms * max(0, max_tokens - 1)) / 1e3
    if slo.e2e_ms is not None:
        bound_s = min(bound_s, slo.e2e_ms / 1e3)
    return bound_s


# Slack on a deadline for the clock's rounding: a request is sent at its offset to within it.
DEADLINE_SLACK_S = 1e-6
# A probe's window should hold this many lives of a request (its SLO deadline): requests sent in a
# window shorter than their life all meet a cluster that is still filling up and have until their
# deadline to finish, so such a probe measures how large a burst the cluster absorbs, not the rate
# it sustains (a decode-heavy request at TPOT 50 ms lives ~50 s).
MIN_WINDOW_LIVES = 3


def request_life_s(slo: Slo, requests: Sequence[BenchRequest]) -> float:
    """The median of the requests' SLO deadlines (send to the latest end that meets the SLOs); 0
    when the SLOs bound no request's end."""
    lives = sorted(slo_deadline_s(slo, request.max_tokens) for request in requests)
    life = lives[len(lives) // 2] if lives else 0.0
    return 0.0 if math.isinf(life) else life


def probe_window_s(life_s: float, at_least_s: float = 30.0) -> float:
    """A probe window that measures a sustained rate: `at_least_s`, or MIN_WINDOW_LIVES lives of a
    request (`request_life_s`) when that is longer."""
    return max(at_least_s, MIN_WINDOW_LIVES * life_s)


class _Verdict:
    """Counts a probe's requests as they end or pass a deadline unfinished, and decides the probe as
    soon as the outcome is certain."""

    def __init__(self, slo: Slo, attainment: float, count: int, decided: asyncio.Future) -> None:
        self.slo = slo
        self.count = count
        self.needed = math.ceil(attainment * count - 1e-9)  # met requests a pass needs
        self.met = self.missed = self.ended = self.refused = 0
        self._finished: set[int] = set()
        self._late: set[int] = set()  # counted as missed at a deadline, unfinished
        self._first_token: set[int] = set()
        self.decided = decided

    def on_first_token(self, index: int) -> None:
        self._first_token.add(index)

    def on_first_token_deadline(self, index: int) -> None:
        """The TTFT objective has passed since the request's send: missed unless a token came."""
        if index not in self._first_token:
            self.on_deadline(index)

    def on_done(self, record: RequestRecord) -> None:
        self._finished.add(record.index)
        self.ended += 1
        self.refused += refused_at_admission(record)
        if record.index in self._late:
            return
        if self.slo.met_by(record):
            self.met += 1
        else:
            self.missed += 1
        self._check()

    def on_deadline(self, index: int) -> None:
        if index not in self._finished and index not in self._late:
            self._late.add(index)
            self.missed += 1
            self._check()

    def _check(self) -> None:
        if self.decided.done():
            return
        if self.met >= self.needed:
            self.decided.set_result(True)
        elif self.count - self.missed < self.needed:
            self.decided.set_result(False)


def _request_limited(instances: Sequence[SimInstance]) -> dict[str, float]:
    """A probe's request-limited share of steps per role, read off its instances (a probe decided
    early cancels the simulation before it reports them)."""
    return request_limited_by_role((i.role.name, i.stats.request_limited_steps, i.stats.steps) for i in instances)


async def _probe(
    config: ClusterConfig, settings: SimSettings, requests: Sequence[BenchRequest], rate: float, slo: Slo, attainment: float
) -> Probe:
    loop = asyncio.get_running_loop()
    arrivals = PoissonArrivals(rate)
    verdict = _Verdict(slo, attainment, len(requests), loop.create_future())
    offsets_s = arrivals.offsets_s(len(requests), settings.seed)  # the runner's schedule (the same seed)
    # (deadline from the start, request index, what is checked): the send time's deadlines, in order.
    deadlines = sorted(
        [(offset + slo_deadline_s(slo, request.max_tokens) + DEADLINE_SLACK_S, request.index, verdict.on_deadline)
         for offset, request in zip(offsets_s, requests, strict=True)]
        + ([] if slo.ttft_ms is None else [
            (offset + slo.ttft_ms / 1e3 + DEADLINE_SLACK_S, request.index, verdict.on_first_token_deadline)
            for offset, request in zip(offsets_s, requests, strict=True)
        ]),
        key=lambda deadline: deadline[:2],
    )
    max_tokens = {request.index: request.max_tokens for request in requests}

    def on_first_token(index: int) -> None:
        """The TPOT deadline counts from the first token: TPOT x (max_tokens - 1) after it."""
        verdict.on_first_token(index)
        if slo.tpot_ms is not None and max_tokens[index] >= 2:
            loop.call_at(
                loop.time() + slo.tpot_ms / 1e3 * (max_tokens[index] - 1) + DEADLINE_SLACK_S, verdict.on_deadline, index
            )

    started: asyncio.Future = loop.create_future()

    async def watch() -> None:
        started_s = await started
        for deadline_s, index, check in deadlines:
            if deadline_s == math.inf:
                return
            wait_s = started_s + deadline_s - loop.time()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            check(index)

    watcher = loop.create_task(watch())
    instances: list[SimInstance] = []
    simulation = loop.create_task(
        simulate_async(
            config, settings, requests, arrivals, slo, on_done=verdict.on_done, on_start=started.set_result,
            on_first_token=on_first_token, instances_out=instances,
        )
    )
    await asyncio.wait({simulation, verdict.decided}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    simulated_s = loop.time() - started.result() if started.done() else 0.0
    if simulation.done():
        simulation.result()  # a bug in the simulation is raised, not taken for a verdict
        records = simulation.result().point.outcome.records
        met = sum(1 for record in records if slo.met_by(record))
        refused = sum(refused_at_admission(record) for record in records)
        return Probe(
            rate, met / len(requests), len(records), met >= verdict.needed, len(requests), refused=refused,
            request_limited=_request_limited(instances), simulated_s=simulated_s,
        )
    simulation.cancel()  # decided: the rest of the window cannot change the verdict
    passed = verdict.decided.result()
    share = verdict.met if passed else verdict.count - verdict.missed
    return Probe(
        rate, share / len(requests), verdict.ended, passed, len(requests), decided_early=True, refused=verdict.refused,
        request_limited=_request_limited(instances), simulated_s=simulated_s,
    )



def probe(
    config: ClusterConfig, settings: SimSettings, requests: Sequence[BenchRequest], rate: float, slo: Slo, attainment: float
) -> Probe:
    """One probe: `requests` sent at `rate` (Poisson, the settings' seed) until the verdict on
    `attainment` is certain."""
    return run_virtual(_probe(config, settings, requests, rate, slo, attainment))


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
    bisections: int = DEFAULT_BISECTIONS,
    beat_rate_per_s: float | None = None,
    on_probe: Callable[[str], None] | None = None,
) -> CandidateResult:
    """The candidate's highest rate within the SLOs. With `beat_rate_per_s` (the best rate of the
    candidates searched before), the first probe is at that rate: a candidate that fails it cannot
    be the best and is left there (`below_rate_per_s`); one that passes is searched as without it,
    on the same rates, so to the same maximum, except that a rate at or below one it passed is
    taken as passed without a simulation (the search takes a pass to mean a pass at every lower
    rate anyway: that is what bisecting between the last pass and the first failure assumes).
    `on_probe` gets a line per probe as it ends (a long search's progress)."""
    config = candidate.config(base)
    result = CandidateResult(candidate, 0.0)
    verdicts: dict[float, bool] = {}

    def passes(rate: float) -> bool:
        if rate not in verdicts and any(passed and rate <= probed for probed, passed in verdicts.items()):
            return True
        if rate not in verdicts:
            count = max(min_requests, round(rate * duration_s))
            started_s = time.perf_counter()
            done = probe(config, settings, window_requests(requests, count), rate, slo, attainment)
            result.probes.append(done)
            verdicts[rate] = done.passed
            if on_probe is not None:
                on_probe(
                    f"  {candidate.label} at {rate:.4g} req/s: {'passed' if done.passed else 'failed'} "
                    f"({done.simulated_s:.1f} s simulated in {time.perf_counter() - started_s:.1f} s)"
                )
        return verdicts[rate]

    if beat_rate_per_s and not passes(beat_rate_per_s):
        result.below_rate_per_s = beat_rate_per_s
        return result
    low, high = 0.0, start_rate_per_s
    for _ in range(max_doublings):
        if not passes(high):
            break
        low, high = high, high * 2
    else:
        result.max_rate_per_s = low
        result.unbounded = True
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
    prune: bool = True,
    jobs: int = 1,
    prefill_counts: Sequence[int] | None = None,
    bisections: int = DEFAULT_BISECTIONS,
    progress: Callable[[str], None] = lambda _m: None,
    probe_progress: bool = False,
) -> list[CandidateResult]:
    """Every candidate's search; the best is the one with the highest goodput per instance (all
    candidates have the same N, so the highest rate). With `prune`, each candidate is first probed
    at the best rate found so far and searched further only if it sustains it: the best and its
    rate are those of searching every candidate to its own maximum (a pass at a rate is taken to
    mean a pass at every lower one, as the bisection takes it), and a candidate left below the
    rate to beat costs one probe (which an overload ends early) instead of a whole search.

    `jobs` > 1 searches that many candidates at once, each in a worker process of its own (the
    simulations are pure Python: threads would share one interpreter lock). Candidate i is then
    pruned against the best of candidates 0 .. i - jobs, the ones certain to be done when it starts
    in order, and it waits for them: the results do not depend on the workers' timing, with one job
    they are those of the sequential search, and the best and its rate do not depend on `jobs` at
    all (pruning never changes them; how far a candidate below the best was searched may).

    `prefill_counts` searches only those splits (`candidates`): the best is then the best of them.
    `bisections`: steps after the doubling phase (each halves how far below its true maximum a
    candidate's rate may be, for one more probe per candidate).

    `progress` gets a line per candidate as its search ends; with `probe_progress`, a line per probe
    too (a candidate's search at scale takes minutes): through `progress` with one job, written to
    stderr by the worker processes (which share the caller's) with several."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if not 0 <= bisections <= MAX_BISECTIONS:
        raise ValueError(f"bisections must be in [0, {MAX_BISECTIONS}], got {bisections}")
    todo = candidates(num_instances, policies, prefill_counts)
    # One rate to start every search from: an instance's share of a modest rate, so that the
    # doubling phase is short for every candidate.
    start = max(0.25, num_instances / 4)
    options = {"attainment": attainment, "start_rate_per_s": start, "duration_s": duration_s, "bisections": bisections}
    on_probe = progress if probe_progress else None
    results: list[CandidateResult | None] = [None] * len(todo)

    def settled(index: int) -> list[CandidateResult | None]:
        """The results candidate `index` is pruned against: those of candidates 0 .. index - jobs."""
        return results[: max(0, index - jobs + 1)]

    def rate_to_beat(index: int) -> float | None:
        rate = max((r.max_rate_per_s for r in settled(index) if r is not None), default=0.0)
        return rate if prune and rate > 0 else None

    def report(result: CandidateResult, elapsed_s: float) -> None:
        found = (
            f"below {result.below_rate_per_s:.3g} req/s (the best so far)" if result.below_rate_per_s is not None
            else f"at least {result.max_rate_per_s:.3g} req/s within the SLOs (every rate tried passed)" if result.unbounded
            else f"{result.max_rate_per_s:.3g} req/s within the SLOs"
        )
        progress(f"{result.candidate.label}: {found} ({len(result.probes)} simulations, {elapsed_s:.1f}s)")

    if jobs == 1 or len(todo) == 1:
        for index, candidate in enumerate(todo):
            started = time.perf_counter()
            results[index] = search(
                candidate, base, settings, requests, slo, beat_rate_per_s=rate_to_beat(index), on_probe=on_probe, **options
            )
            report(results[index], time.perf_counter() - started)
        return results  # type: ignore[return-value]  # every slot is filled

    # spawn, not fork: the caller may hold threads (a progress bar, an event loop), which fork copies
    # mid-state. The shared inputs go to each worker once, not with every candidate. A Pool, not a
    # ProcessPoolExecutor: leaving the block for any reason (Ctrl-C, a candidate's error) terminates
    # the workers at once instead of waiting for the simulations they run, which take minutes at
    # scale; the workers ignore SIGINT, so a terminal's Ctrl-C reaches this process alone.
    context = multiprocessing.get_context("spawn")
    finished: queue.SimpleQueue[tuple[int, CandidateResult | None, BaseException | None]] = queue.SimpleQueue()
    with context.Pool(
        processes=min(jobs, len(todo)), initializer=_init_worker,
        initargs=(base, settings, tuple(requests), slo, options, logging.getLogger().getEffectiveLevel(), probe_progress),
    ) as pool:
        running: dict[int, float] = {}  # candidate index -> when its search started
        next_index = 0
        while next_index < len(todo) or running:
            while next_index < len(todo) and len(running) < jobs and all(r is not None for r in settled(next_index)):
                index = next_index
                pool.apply_async(
                    _search_in_worker, (todo[index], rate_to_beat(index)),
                    callback=lambda result, index=index: finished.put((index, result, None)),
                    error_callback=lambda error, index=index: finished.put((index, None, error)),
                )
                running[index] = time.perf_counter()
                next_index += 1
            index, result, error = finished.get()
            if error is not None:
                raise error
            started = running.pop(index)
            results[index] = result
            report(result, time.perf_counter() - started)
    return results  # type: ignore[return-value]


# A worker process's share of a parallel plan: what every candidate's search takes (set once per worker).
_worker_inputs: tuple[ClusterConfig, SimSettings, tuple[BenchRequest, ...], Slo, dict] | None = None


def _init_worker(
    base: ClusterConfig, settings: SimSettings, requests: tuple[BenchRequest, ...], slo: Slo, options: dict, log_level: int,
    probe_progress: bool,
) -> None:
    global _worker_inputs
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates the pool
    # A spawned process starts with logging unconfigured: the parent's level (duet plan --log-level)
    # keeps the simulated router's warnings as quiet here as in a sequential plan.
    logging.getLogger().setLevel(log_level)
    _worker_inputs = (base, settings, requests, slo, {**options, "on_probe": _to_stderr if probe_progress else None})


def _to_stderr(line: str) -> None:
    """A worker's progress line: its stderr is the parent's (a spawned process inherits it); one
    write per line, so lines of workers do not mix."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _search_in_worker(candidate: Candidate, beat_rate_per_s: float | None) -> CandidateResult:
    assert _worker_inputs is not None, "a plan worker runs only under plan()'s pool"
    base, settings, requests, slo, options = _worker_inputs
    return search(candidate, base, settings, requests, slo, beat_rate_per_s=beat_rate_per_s, **options)


def best(results: Sequence[CandidateResult]) -> CandidateResult:
    return max(results, key=lambda r: (r.goodput_per_instance, -r.candidate.num_prefill))
