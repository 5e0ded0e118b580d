"""A step-time profile measured as deployed: the instances' own steps while a real cluster serves.

`duet profile` (worker/profiler.py) times the engine in one process with the cores to itself. A
served instance does not run like that: it is a Ray actor (`num_cpus`, `torch_threads` of its
group) that shares the host's cores with the other instances, the router, the front end and the
client, and answers the router's calls on its own threads between and during steps. On a small
shared host its steps are slower and less regular than the profiler's, and the calls and the
hand-over around them cost more (bench/sim_validation.py measured both). So `duet profile
--deployed` measures the deployment instead:

1. It deploys the cluster configuration (by default one of the two bench/sim_validation.py
   validates, `default_config`: 1 PREFILL + 1 GENERATION or 2 MIXED, built-in model, `num_cpus`
   0.5, `torch_threads` 1 on a 2-CPU Ray) with `step_log_dir` set, so that every instance logs each
   engine step it runs (its batch, and the seconds from the step's start until its outputs were
   handed on: worker/profiler.py StepLog), and with the front end's timeline log.
2. It serves a calibration load through the gRPC client, as `duet bench` does (not the workloads
   bench/sim_validation.py compares): a first pass of fixed shapes at fixed concurrency, from one
   request alone to a full decode batch (FIRST_PASS), fitted only to estimate the cluster's
   capacity; then loaded passes of Poisson arrivals at 70 % of that estimate (SECOND_PASS),
   repeated while the estimate moves (SETTLED, MAX_LOADED_PASSES), each pass with prompts of its
   own. One loaded point shares prefixes among its prompts, so that the engine reuses their cached
   KV and runs short chunks that attend long caches: the steps that tell the cost per attended pair
   from the cost per token.
3. It fits the step model to the loaded passes' steps (worker/profiler.py `fit(mean=True)`: the
   mean step of each shape, slow steps included, since a queue waits for those too) together with
   how much the instances slow each other (`contention`: the steps' time over the model's, against
   the number of the other instances whose logged steps cover the step's start; the model is
   refitted to the steps with it taken out, until the slope settles), and records their
   spread around the whole (`step_time_ratios`, and `context_step_time_ratios` for the steps that
   run context, which scatter less relative to their time; the one spread of all steps is kept in
   the fit as `all_steps_time_ratios`).
4. The control path, from the router's timelines set against the step logs and the load's own
   records (loaded passes): `rpc_latency_s`, the mean of the median ways of a call, a submit's way
   to an idle instance (admission to the start of its next step) and a poll answer's way back (that
   step's start, where it publishes "prefill started", to the router's CONTEXT_IN_PROGRESS);
   `frontend_latency_s`, the mean of the median ways in (client send to admission) and out (the
   router's first token to the client's); `handover_fixed_s`, the median time from the end of the
   prefill step that finished a request's context to the start of the generation step that took it
   up, less the link model's time for its KV bytes, over the requests whose generation instance was
   idle in between (0 where nothing is handed over; deployment_logs.handover_seconds says why not the router's
   TRANSMISSION to GENERATING, which it was until profiles measured on 2026-12-03). Where fewer than
   MIN_IDLE_HANDOVERS requests of the loaded passes found it idle (a short calibration keeps it
   busy), over those of the first pass as well. `handover_busy_s`, the median of the loaded passes'
   hand-overs to a busy generation instance (each known only to an interval: deployment_logs.censored_median),
   where there are MIN_IDLE_HANDOVERS of them: they take longer (the receiver shares the instance's
   cores), and the simulator charges it to a push whose receiver is mid-step.

The profile's `fit` records all of it: the configuration, the passes and their fits, the
percentiles of every control-path measurement, the host's load average before and after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from cluster.deploy.config import ClusterConfig
from cluster.loadgen.workloads import WorkloadConfig, WorkloadKind
from cluster.sim import deployment_logs as logs
from cluster.sim.capacity import cluster_rps
from cluster.sim.profile import StepProfile
from worker.protocol import InstanceRole


@dataclass(frozen=True)
class CalibrationPoint:
    """`num_requests` fixed-shape requests: `concurrency` at once (the first pass), or Poisson
    arrivals at `load` x the cluster's capacity as the first pass's fit estimates it (the second).
    With `shared_prefix_tokens`, the first that many of each prompt's `prompt_tokens` are a prefix
    shared by groups of SUFFIXES_PER_PREFIX requests (sent shuffled): after a group's first request
    the engine reuses the prefix's cached KV and runs only the rest, a short context chunk that
    attends a long cache."""

    prompt_tokens: int
    output_tokens: int
    num_requests: int
    concurrency: int | None = None
    load: float | None = None
    shared_prefix_tokens: int = 0

    @property
    def computed_prompt_tokens(self) -> float:
        """The prompt tokens the engine runs per request on average: a shared prefix once per group."""
        return self.prompt_tokens - self.shared_prefix_tokens * (1 - 1 / SUFFIXES_PER_PREFIX)

    def workload(self) -> WorkloadConfig:
        if not self.shared_prefix_tokens:
            return WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=self.num_requests,
                                  input_len=self.prompt_tokens, output_len=self.output_tokens)
        return WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, num_prefixes=max(1, self.num_requests // SUFFIXES_PER_PREFIX),
                              suffixes_per_prefix=SUFFIXES_PER_PREFIX, prefix_len=self.shared_prefix_tokens,
                              input_len=self.prompt_tokens - self.shared_prefix_tokens, output_len=self.output_tokens)


# First pass: every shape, from one request alone to a full decode batch; fitted only to aim the
# second. Second pass: Poisson loads at 70 % of that capacity, whose steps the profile is fitted to
# (how much the processes of a small host slow each other depends on how busy they are: a profile
# measured at saturation is too slow for a cluster run below it, one measured alone too fast).
FIRST_PASS = (
    CalibrationPoint(32, 2, 6, concurrency=1),
    CalibrationPoint(128, 2, 6, concurrency=1),
    CalibrationPoint(384, 2, 8, concurrency=2),
    CalibrationPoint(1024, 2, 6, concurrency=2),
    CalibrationPoint(64, 48, 8, concurrency=2),
    CalibrationPoint(64, 48, 24, concurrency=8),
    CalibrationPoint(96, 32, 48, concurrency=24),
)
SECOND_PASS = (
    CalibrationPoint(384, 8, 48, load=0.7),
    CalibrationPoint(192, 24, 48, load=0.7),
    CalibrationPoint(96, 48, 48, load=0.7),
    CalibrationPoint(704, 12, 48, load=0.7),  # decode at long contexts (what a step pays per context token)
    # Prefix reuse: 64-token chunks attending 448 cached tokens. Without steps whose attended pairs
    # are many per token, the fit cannot tell the per-pair cost from the per-token one (in the
    # other shapes the two grow together): it put the pairs' cost on the tokens, and a prefix hit's
    # short chunk on a long cache then ran 1.4-1.8x the model (the validation's shared-prefix case).
    CalibrationPoint(512, 12, 48, load=0.7, shared_prefix_tokens=448),
)
SUFFIXES_PER_PREFIX = 8  # requests per shared prefix in a CalibrationPoint with shared_prefix_tokens
# The loaded pass is repeated, each at 70 % of the capacity its predecessor's fit estimates, until
# the estimate moves by less than SETTLED (at most MAX_LOADED_PASSES), so that the load the profile
# is measured at approaches the load it predicts for rather than the first pass's guess of it; the
# profile is fitted to the steps of all loaded passes.
MAX_LOADED_PASSES = 3
SETTLED = 0.15
SPREAD_POINTS = 20  # quantiles of StepProfile.step_time_ratios
CONTENTION_ROUNDS = 6  # refits of the step model with the contention taken out (it settles in 2-3)
CONTENTION_SETTLED = 0.005
MIN_IDLE_HANDOVERS = 10  # loaded-pass hand-overs to an idle instance below which the first pass's count too
TABLE_ROWS = 250  # fitted steps kept in the profile's fit.samples_table
QUICK_FIRST_PASS = (CalibrationPoint(64, 2, 3, concurrency=1), CalibrationPoint(512, 2, 4, concurrency=2), CalibrationPoint(48, 16, 8, concurrency=4))
QUICK_SECOND_PASS = (CalibrationPoint(192, 16, 8, load=0.7),)


TOPOLOGIES = {  # the clusters bench/sim_validation.py runs
    "1p1g": [{"role": "PREFILL", "count": 1}, {"role": "GENERATION", "count": 1}],
    "2mixed": [{"role": "MIXED", "count": 2}],
}


def default_config(topology: str = "1p1g") -> ClusterConfig:
    """The cluster bench/sim_validation.py runs as `topology`: built-in model, float32 on the CPU,
    each instance a Ray actor with num_cpus 0.5 and 1 torch thread, on a 2-CPU embedded Ray."""
    return ClusterConfig.from_dict({
        "dtype": "float32", "device": "cpu",
        "instances": [dict(group, num_cpus=0.5, torch_threads=1) for group in TOPOLOGIES[topology]],
        "engine": {"num_blocks": 1024, "tokens_per_block": 16, "max_num_tokens": 512, "chunk_unit_tokens": 256,
                   "max_num_requests": 32, "max_batch_size": 32},
        "frontend": {"port": 0, "metrics_port": None, "http_port": 0},
        "ray": {"num_cpus": 2},
        "seed": 0,
    })


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"n": len(ordered), "p10": ordered[len(ordered) // 10], "p50": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))]}


class _WallClock:
    """time.time for a LoadRunner, remembering its first reading: the run's start, so that its
    records (seconds since the start) can be set against the router's wall-clock timelines."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self) -> float:
        now = time.time()
        if self.first is None:
            self.first = now
        return now


@dataclass
class _PointRun:
    point: CalibrationPoint
    started_s: float  # wall clock
    ended_s: float
    records: tuple[Any, ...]  # RequestRecord


# Step-model coefficients a deployed fit holds at 0. `prefill_s_per_cached_token` (what a chunk pays
# per cached token it attends, which `duet profile` measures in one process: 1.5 us here): fitted
# to a calibration's steps, whose context chunks on a cache attend pairs in proportion to it, it
# traded off against the per-pair cost and took the prefill's superlinear cost with it (one
# validation run, 2026-12-03: per pair 0 instead of 1.9-3.3e-8 s, per cached token 17 us, 1P+1G
# prefill-heavy TTFT p50 0.96 too slow in the simulator against 0.41-0.49 in the two runs without
# it). Without it the per-pair cost stands for both, and the calibration's prefix hits size it.
DEPLOYED_WITHOUT = ("prefill_s_per_cached_token",)


def _fit_contended(steps: list[logs.LoggedStep], as_profile: Callable[[dict[str, float], float], StepProfile]) -> tuple[StepProfile, dict[str, Any]]:
    """The step model of a step run alone and the contention on it (the module docstring, step 3):
    the fitted profile (`as_profile(coefficients, contention)`) and the fit's quality and rounds."""
    from worker.profiler import fit

    busy = [step.busy for step in steps]
    mean_busy = statistics.fmean(busy)
    variance = statistics.fmean([(b - mean_busy) ** 2 for b in busy])
    def alone(contention: float) -> list[Any]:  # the steps with their contention taken out
        return [dataclasses.replace(step.sample, step_s=step.sample.step_s / (1 + contention * step.busy)) for step in steps]

    contention = 0.0
    rounds = []
    # One instance, or never any overlap: nothing to measure, and the plain fit below is the model.
    for _ in range(CONTENTION_ROUNDS if variance > 0 else 0):
        coefficients, _ = fit(alone(contention), trim_fraction=0.0, mean=True, without=DEPLOYED_WITHOUT)
        model = as_profile(coefficients, 0.0)
        ratios = [step.sample.step_s / logs.modelled_s(model, step.sample) for step in steps]
        mean_ratio = statistics.fmean(ratios)
        slope = statistics.fmean([(b - mean_busy) * (r - mean_ratio) for b, r in zip(busy, ratios, strict=True)]) / variance
        intercept = mean_ratio - slope * mean_busy
        settled, contention = contention, max(0.0, slope / intercept) if intercept > 0 else 0.0
        rounds.append({"intercept": round(intercept, 4), "slope": round(slope, 4), "contention": round(contention, 4)})
        if abs(contention - settled) < CONTENTION_SETTLED:
            break
    coefficients, quality = fit(alone(contention), trim_fraction=0.0, mean=True, without=DEPLOYED_WITHOUT)
    profile = as_profile(coefficients, contention)
    errors = sorted(abs(logs.speed_of(step, profile) - 1) for step in steps)
    quality = {
        **quality,
        # The whole model's (alone x contended) error on the logged steps; the entries above are the
        # step model's on the steps with their contention taken out.
        "contended_median_relative_error": round(statistics.median(errors), 4),
        "mean_busy_instances": round(mean_busy, 4),
        "contention_rounds": rounds,
    }
    return profile, quality


def _coefficients(profile: StepProfile) -> dict[str, float]:
    """The step model's coefficients (worker/profiler.py COLUMNS) of `profile`."""
    from worker.profiler import COLUMNS

    return {name: getattr(profile, name) for name in COLUMNS}


def keep_calibration(source: Path, keep_dir: Path) -> None:
    """Copy a calibration's step logs and timelines (`source`: its working directory) to `keep_dir`."""
    keep_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source / "steps", keep_dir / "steps", dirs_exist_ok=True)
    timelines = source / "timelines.jsonl"
    if timelines.exists():
        shutil.copy2(timelines, keep_dir / "timelines.jsonl")


def _table_row(step: logs.LoggedStep) -> list[float]:
    s = step.sample
    return [s.context_tokens, s.context_pairs, s.decode_sequences, s.decode_context_tokens, round(s.step_s, 7), round(step.busy, 4), s.context_cached_tokens]


def _spread(steps: list[logs.LoggedStep], profile: StepProfile, points: int = SPREAD_POINTS) -> list[float]:
    """Measured / modelled time of each step (contention included), at the quantiles (i + 0.5) /
    points, scaled so that their mean is 1 (the fit meets the mean step; the spread is only how
    steps scatter around it)."""
    ratios = sorted(logs.speed_of(step, profile) for step in steps)
    picked = [ratios[min(len(ratios) - 1, int((i + 0.5) / points * len(ratios)))] for i in range(points)]
    mean = sum(picked) / len(picked)
    return [round(r / mean, 4) for r in picked]


def measure_deployed(
    config: ClusterConfig | None = None,
    *,
    name: str,
    quick: bool = False,
    progress: Callable[[str], None] = lambda _m: None,
    keep_dir: Path | None = None,
) -> dict[str, Any]:
    """Deploy `config`, serve the calibration load, and return the fitted profile document.
    `keep_dir`: copy the calibration's step logs (`steps/`) and the front end's timelines there,
    to study the steps the profile was fitted to (bench/sim_validation.py --keep-steps)."""
    from cluster.client.sdk import AsyncDuetClient
    from cluster.deploy.embedded import BackgroundCluster
    from cluster.loadgen.arrivals import FixedConcurrency, PoissonArrivals
    from cluster.loadgen.runner import LoadRunner, SamplingSpec
    from cluster.loadgen.workloads import build_workload
    from cluster.router.instance_client import RayInstanceClient

    config = config or default_config()
    first_pass, second_pass = (QUICK_FIRST_PASS, QUICK_SECOND_PASS) if quick else (FIRST_PASS, SECOND_PASS)
    engine = config.engine_config(config.instances[0])
    counts = {role: sum(g.count for g in config.instances if g.role is role) for role in InstanceRole}
    load_before = _load_average()
    runs: list[_PointRun] = []

    def capacity_of(profile: StepProfile, point: CalibrationPoint) -> float:
        return cluster_rps(
            profile, engine, num_prefill=counts[InstanceRole.PREFILL], num_generation=counts[InstanceRole.GENERATION],
            num_mixed=counts[InstanceRole.MIXED], mean_prompt_tokens=point.computed_prompt_tokens, mean_output_tokens=point.output_tokens,
        )

    with tempfile.TemporaryDirectory(prefix="duet-profile-") as tmp:
        steps_dir = Path(tmp) / "steps"
        timeline_path = Path(tmp) / "timelines.jsonl"
        deployed = msgspec.structs.replace(
            config, step_log_dir=str(steps_dir), frontend=msgspec.structs.replace(config.frontend, timeline_log=str(timeline_path))
        )
        progress("deploying the cluster ...")
        with BackgroundCluster(deployed) as cluster:

            async def serve(points: tuple[CalibrationPoint, ...], provisional: StepProfile | None, tag: str, seed: int) -> None:
                client = AsyncDuetClient(cluster.target)
                try:
                    if provisional is None:  # first calls: channels, allocator, caches
                        await LoadRunner(client).warmup(build_workload(WorkloadConfig(num_requests=4, input_len=64, output_len=4), 99))
                    for index, point in enumerate(points):
                        workload = point.workload()
                        if point.concurrency is not None:
                            arrivals: Any = FixedConcurrency(point.concurrency)
                        else:
                            assert provisional is not None and point.load is not None
                            arrivals = PoissonArrivals(point.load * capacity_of(provisional, point))
                        shared = f" ({point.shared_prefix_tokens} a shared prefix)" if point.shared_prefix_tokens else ""
                        progress(f"{tag} {index + 1}/{len(points)}: {point.prompt_tokens} prompt{shared} / {point.output_tokens} output tokens, {arrivals.label}")
                        clock = _WallClock()
                        # Each pass its own prompts: a repeated one would hit the prefix cache the
                        # previous pass left, a shape the pass does not mean to measure.
                        outcome = await LoadRunner(client, SamplingSpec(), clock=clock).run(
                            build_workload(workload, seed + index), arrivals, seed=seed + index)
                        assert clock.first is not None
                        runs.append(_PointRun(point, clock.first, time.time(), outcome.records))
                finally:
                    await client.close()

            asyncio.run(serve(first_pass, None, "first pass", 0))
            info = cluster.run(RayInstanceClient(*next(iter(cluster.deployment.actors.items()))).get_info())
            layout = info.layout
            kv_bytes_per_token = layout.run_bytes(layout.num_layers, 1) // layout.tokens_per_block
            first_steps = logs.logged_steps(steps_dir)
            if len(first_steps) < 8:
                raise RuntimeError(f"the deployment logged {len(first_steps)} steps in the first pass; too few to fit")

            def as_profile(coefficients: dict[str, float], contention: float) -> StepProfile:
                return StepProfile(
                    "provisional", "measured", "cpu", "m", handover_fixed_s=0.0, kv_bytes_per_token=kv_bytes_per_token,
                    contention=contention, **coefficients,
                )

            def capacities(profile: StepProfile) -> list[float]:
                return [capacity_of(profile, point) for point in second_pass]

            provisional, _ = _fit_contended(first_steps, as_profile)
            provisional_first = provisional
            pass_fits = []
            second_s = time.time()
            for number in range(1 if quick else MAX_LOADED_PASSES):
                pass_s = time.time()
                asyncio.run(serve(second_pass, provisional, f"loaded pass {number + 1}", 100 * (number + 1)))
                steps = logs.logged_steps(steps_dir, since_s=pass_s)
                if len(steps) < 8:
                    raise RuntimeError(f"the deployment logged {len(steps)} steps in a loaded pass; too few to fit")
                fitted, _ = _fit_contended(steps, as_profile)
                moved = max(abs(new / old - 1) for new, old in zip(capacities(fitted), capacities(provisional), strict=True))
                pass_fits.append({"coefficients": _coefficients(fitted), "contention": fitted.contention, "capacity_moved": round(moved, 4)})
                provisional = fitted
                if moved < SETTLED:
                    break
            # The profile: every loaded pass's steps (each pass's own fit is noisy on a shared host).
            steps = logs.logged_steps(steps_dir, since_s=second_s)
            fitted, quality = _fit_contended(steps, as_profile)
            all_ratios = _spread(steps, fitted)
            # Context steps scatter less, relative to their time, than decode-only ones: a spread each
            # (StepProfile.context_step_time_ratios), where both kinds logged enough steps to have one.
            with_context = [step for step in steps if step.sample.context_tokens]
            without = [step for step in steps if not step.sample.context_tokens]
            if len(with_context) >= SPREAD_POINTS and len(without) >= SPREAD_POINTS:
                ratios, context_ratios = _spread(without, fitted), _spread(with_context, fitted)
            else:
                ratios, context_ratios = all_ratios, []
        spans = logs.step_spans(steps_dir)
        timelines = logs.request_timelines(timeline_path)
        idle_handovers, busy_handovers = logs.handover_seconds(timelines, spans, engine.tokens_per_block, kv_bytes_per_token, second_s)
        handovers_from = "loaded passes"
        if len(idle_handovers) < MIN_IDLE_HANDOVERS:  # a generation instance rarely idle (a short calibration)
            idle_handovers, _ = logs.handover_seconds(timelines, spans, engine.tokens_per_block, kv_bytes_per_token, runs[0].started_s)
            handovers_from = "all passes"
        calls = logs.call_ways(timelines, spans, second_s)
        if keep_dir is not None:
            keep_calibration(Path(tmp), keep_dir)
    ways_in, ways_out = logs.frontend_ways(runs, timelines)
    way_in, way_out = _percentiles(ways_in), _percentiles(ways_out)
    call_there, call_back = (_percentiles(ways) for ways in calls)
    handover = _percentiles(idle_handovers)
    busy_handover = logs.censored_median([], busy_handovers) if len(busy_handovers) >= MIN_IDLE_HANDOVERS else None
    groups = ", ".join(f"{g.count} {g.role.name} (num_cpus {g.num_cpus}, torch_threads {g.torch_threads})" for g in config.instances)
    table_every = max(1, math.ceil(len(steps) / TABLE_ROWS))  # every n-th fitted step goes in the profile
    return {
        "format": "duet.step_profile.v1",
        "name": name,
        "source": "measured",
        "device": f"cpu as deployed: {groups} on a {config.ray.num_cpus or os.cpu_count()}-CPU Ray, {os.cpu_count()}-core host",
        "model": "builtin" if config.model is None else Path(config.model).name,
        **_coefficients(fitted),
        "contention": fitted.contention,
        "handover_fixed_s": handover.get("p50", 0.0),
        "handover_busy_s": busy_handover,
        "kv_bytes_per_token": kv_bytes_per_token,
        "combine": "sum",
        "step_time_ratios": ratios,
        "context_step_time_ratios": context_ratios,
        "rpc_latency_s": (call_there["p50"] + call_back["p50"]) / 2 if call_there and call_back else None,
        "frontend_latency_s": (way_in["p50"] + way_out["p50"]) / 2 if way_in and way_out else None,
        "notes": (
            "measured as deployed by duet profile --deployed (cluster/sim/deployed.py): each instance's own steps "
            "(start to outputs handed on) while the cluster served the calibration load through the gRPC front end, "
            "fitted to the mean step of each shape (the second pass, at 70 % of the first pass's capacity estimate); "
            "rpc_latency_s is the mean of the median ways of the router's calls (second pass, requests that found "
            "their prefill instance idle): a submit's way there (admission to the instance's next step) and a poll's "
            "answer's way back (that step's start to the router hearing the prefill started); "
            "frontend_latency_s the mean of the median ways in (client send to admission) and out (the router's "
            "first token to the client's); handover_fixed_s is the median time from the end of the prefill "
            "step that finished a request's context to the start of the generation step that took it up, over "
            f"requests whose generation instance was idle in between, less the {logs.HANDOVER_PLANE} link time of its KV "
            f"(over all passes where the loaded ones had fewer than {MIN_IDLE_HANDOVERS} such requests)"
        ),
        "fit": {
            **quality,
            "dtype": config.dtype,
            "deployment": {"instances": groups, "engine": dict(config.engine), "ray_num_cpus": config.ray.num_cpus},
            "first_pass": [point.__dict__ for point in first_pass],
            "loaded_pass": [point.__dict__ for point in second_pass],
            "first_pass_fit": {**_coefficients(provisional_first), "contention": provisional_first.contention},
            "loaded_pass_fits": pass_fits,
            "call_way_there_s": call_there,
            "call_way_back_s": call_back,
            "frontend_way_in_s": way_in,
            "frontend_way_out_s": way_out,
            "handover_control_s": {**handover, "from": handovers_from},  # to an idle generation instance
            # To a busy one (loaded passes), known to an interval each: the profile's handover_busy_s.
            "handover_busy_control_s": {"n": len(busy_handovers), "p50": busy_handover},
            "all_steps_time_ratios": all_ratios,
            "load_average_before": load_before,
            "load_average_after": _load_average(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            # Every `samples_table_every`-th fitted step (a few thousand would make the file large).
            "samples_table_every": table_every,
            # context tokens, context pairs, decode sequences, their context tokens, seconds, how
            # many of the other instances were mid-step as the step started, and the cached tokens
            # the context chunks attended
            "samples_table": [_table_row(step) for step in steps[::table_every]],
        },
    }

