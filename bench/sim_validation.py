"""Does the simulator predict this machine? The same workloads on real embedded clusters and in `duet sim`.

Clusters this machine can host, with the built-in model: 1 PREFILL + 1 GENERATION, and 2 MIXED.
Workloads, each at ~70 % of the cluster's capacity as the profile estimates it
(cluster/sim/capacity.py): prefill-heavy (long prompts, few outputs), decode-heavy (short prompts,
long outputs), shared-prefix (prompts on a few long prefixes: prefix reuse and KV-aware placement).
Each case runs twice on the real cluster (through the gRPC client, as `duet bench`; a fresh cluster
each time, so that the second run finds nothing of the first in the prefix cache), both times the
same requests at the same arrival times (one seed), and once in the simulator on that seed, with
the profile of that cluster measured as deployed on this machine (PROFILES: `duet profile --deployed
--topology 1p1g|2mixed`, cluster/sim/deployed.py; or --profile for all). For TTFT p50/p90 and TPOT
p50/p90: the simulator's relative error against the mean of the two real runs, and the real runs'
own disagreement (noise). One seed for all three: 36 Poisson arrivals of one seed and of the next
differ by up to 3x in TTFT p90 on the real cluster, a difference of workloads, not of the simulator
or of the host, which would inflate both the error and the noise it is judged against. A comparison
is within bound when its error is at most max(15 %, 2 x the real-vs-real error).

Figures: `<case>_<metric>_rel_error`, `median_rel_error`, `cases_within_bound` / `cases_total` (a case
is within bound when all four of its metrics are), and `metrics_within_bound` / `metrics_total`.
`<case>_real_step_speed` is how the real runs' steps took against the profile's model of them
(their instances log each step; the mean of measured over modelled time, contention included: 1.0
when the model meets them on average), and `speed_matched_median_rel_error` the median error of the
same simulations with the profile's step times scaled by it: what is left when the step model's
level is right, so that the difference between the two is the step model's (the host's speed
drifting between the profile's measurement and the real runs, or the model missing these
workloads' shapes) and the rest the queueing, scheduling and control path's. A diagnosis, not the
validation: it takes the step times from the runs it predicts.

`median_noise_floor` is the median error a perfect simulator would show against these real runs:
one that predicts each metric's expected value exactly still misses the mean of two noisy runs by
|a - b| / (a + b) on average (the mean's deviation is half the runs' difference). When it is above
the 15 % target, the host's noise alone puts the target out of reach for that run, whatever the
simulator does.

`--out DIR` writes what the real side gave (`DIR/real_runs.json`: each cluster's profile, each
case's rate and its two real runs' figures); `--replay DIR/real_runs.json` compares the simulator
with those instead of running anything real, so that a change to the simulator or a profile
(`--profile`) is judged against the same real runs, in seconds (the real runs of one full
validation take about 8 minutes and vary from run to run). `--keep-steps DIR` keeps the step logs
behind `<case>_real_step_speed` (each real run's, and with --measure the calibration's the profile
was fitted to), to find out which steps a profile misses and why, and prints how each set of kept
steps ran against its cluster's profile: all of them, and by kind (context or decode-only steps,
started alone or contended).

    python bench/sim_validation.py [--quick] [--requests N] [--profile P | --measure] [--out DIR] [--keep-steps DIR]
    python bench/sim_validation.py --replay DIR/real_runs.json [--profile P]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from cluster.cli.bench import BenchSettings, run_points  # noqa: E402
from cluster.deploy.config import ClusterConfig  # noqa: E402
from cluster.loadgen.arrivals import PoissonArrivals  # noqa: E402
from cluster.loadgen.metrics import BenchMetrics, Slo  # noqa: E402
from cluster.loadgen.runner import SamplingSpec  # noqa: E402
from cluster.loadgen.workloads import WorkloadConfig, WorkloadKind, build_workload  # noqa: E402
from cluster.sim.capacity import cluster_rps  # noqa: E402
from cluster.sim.catalog import load_profile  # noqa: E402
from cluster.sim.cluster import SimSettings, simulate  # noqa: E402
from cluster.sim.deployed import TOPOLOGIES, default_config, measure_deployed  # noqa: E402
from cluster.sim.deployment_logs import step_speed, step_speeds_by_kind  # noqa: E402
from cluster.sim.link import data_plane  # noqa: E402
from cluster.sim.profile import ProfileError, StepProfile  # noqa: E402

BENCH = "sim_validation"
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
MIN_BOUND = 0.15
LOAD = 0.7
# The profile of each cluster, measured as it is deployed here (duet profile --deployed --topology T,
# cluster/sim/deployed.py): how much a small host's processes slow each other depends on which run.
PROFILES = {"1p1g": "cpu-builtin-deployed", "2mixed": "cpu-builtin-deployed-2mixed"}


def workloads(count: int) -> dict[str, WorkloadConfig]:
    return {
        "prefill_heavy": WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=count, input_len=768, output_len=4),
        "decode_heavy": WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=count, input_len=48, output_len=96),
        "shared_prefix": WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, num_prefixes=max(1, count // 6),
                                        suffixes_per_prefix=6, prefix_len=512, input_len=32, output_len=16),
    }


def cluster_config(topology: str, seed: int) -> ClusterConfig:
    """The cluster `duet profile --deployed --topology` measures (cluster/sim/deployed.py), seeded."""
    return msgspec.structs.replace(default_config(topology), seed=seed)


def rate_for(config: ClusterConfig, profile, workload: WorkloadConfig) -> float:
    counts = {g.role.name: g.count for g in config.instances}
    prompt = workload.input_len + (workload.prefix_len if workload.kind is WorkloadKind.SHARED_PREFIX else 0)
    engine = config.engine_config(config.instances[0])
    capacity = cluster_rps(profile, engine, num_prefill=counts.get("PREFILL", 0), num_generation=counts.get("GENERATION", 0),
                           num_mixed=counts.get("MIXED", 0), mean_prompt_tokens=prompt, mean_output_tokens=workload.output_len)
    return LOAD * capacity


def figures_of(metrics: BenchMetrics) -> dict[str, float | None]:
    def pick(distribution, q):
        return None if distribution is None else getattr(distribution, q)

    return {
        "ttft_p50": pick(metrics.ttft_ms, "p50"), "ttft_p90": pick(metrics.ttft_ms, "p90"),
        "tpot_p50": pick(metrics.tpot_ms, "p50"), "tpot_p90": pick(metrics.tpot_ms, "p90"),
    }


def real_runs(
    topology: str, cases: dict[str, WorkloadConfig], rates: dict[str, float], seed: int, profile: StepProfile,
    keep_steps: Path | None = None,
) -> tuple[dict[str, list[dict]], dict[str, list[float | None]]]:
    """Each case twice, each time on a cluster of its own: the same seed means the same prompts, and
    the second run must not find the first one's in the prefix cache (nor any case another's), as
    the simulator starts every case on empty instances. Returns each run's figures and how fast the
    host ran its steps against `profile` (its instances log them: cluster/sim/deployment_logs.py step_speed).
    `keep_steps`: copy each run's step logs to keep_steps/<case>-<run>/."""
    from cluster.deploy.embedded import BackgroundCluster

    results: dict[str, list[dict]] = {}
    speeds: dict[str, list[float | None]] = {}
    for name, workload in cases.items():
        runs, run_speeds = [], []
        for repeat in range(2):
            progress(f"{topology} {name} real #{repeat + 1}: starting the embedded cluster ...")
            settings = BenchSettings(
                workload=workload, points=(PoissonArrivals(rates[name]),), slo=Slo(), sampling=SamplingSpec(),
                warmup=4, seed=seed, out_dir=Path("."), plots=False, progress=False,
            )
            with tempfile.TemporaryDirectory(prefix="duet-validation-steps-") as steps_dir:
                config = msgspec.structs.replace(cluster_config(topology, seed), step_log_dir=steps_dir)
                with BackgroundCluster(config) as cluster:
                    point = asyncio.run(run_points(cluster.target, {}, settings, None))[0]
                run_speeds.append(step_speed(Path(steps_dir), profile))
                if keep_steps is not None:
                    shutil.copytree(steps_dir, keep_steps / f"{name}-{repeat + 1}", dirs_exist_ok=True)
            if point.metrics.failed:
                progress(f"{topology} {name}: {point.metrics.failed} real requests failed")
            runs.append(figures_of(point.metrics))
            progress(f"{topology} {name} real #{repeat + 1}: {runs[-1]}, steps at {run_speeds[-1]} x the profile's")
        results[name] = runs
        speeds[name] = run_speeds
    return results, speeds


def kept_steps_report(keep_steps: Path, profiles: dict[str, StepProfile]) -> list[list]:
    """Per cluster, for its calibration's steps (with --measure) and each real run's as kept: how they
    ran against the cluster's profile, all and by kind (cluster/sim/deployment_logs.py step_speeds_by_kind;
    "-" for a kind with no steps)."""
    rows = []
    for topology, profile in profiles.items():
        kept = keep_steps / topology
        if not kept.is_dir():
            continue
        runs = [(path.name, path) for path in sorted(kept.iterdir()) if path.is_dir() and path.name != "calibration"]
        if (kept / "calibration" / "steps").is_dir():
            runs.insert(0, ("calibration", kept / "calibration" / "steps"))
        for name, path in runs:
            speeds = step_speeds_by_kind(path, profile)
            rows.append([topology, name] + [
                "-" if speeds[kind][1] is None else f"{speeds[kind][1]:.3f} ({speeds[kind][0]})"
                for kind in ("all", "context", "decode_only", "alone", "contended")
            ])
    return rows


# The step model's time coefficients (StepProfile.step_s), which a host's speed scales.
STEP_TIMES = ("step_overhead_s", "prefill_s_per_token", "prefill_s_per_token_pair", "decode_s_per_sequence",
              "decode_s_per_context_token", "context_step_s", "prefill_s_per_cached_token")


def speed_matched(profile: StepProfile, speed: float) -> StepProfile:
    """`profile` with its steps `speed` times as long (the real runs' own steps against the profile's
    model of them), the control path as measured."""
    return dataclasses.replace(profile, **{name: getattr(profile, name) * speed for name in STEP_TIMES})


def sim_run(topology: str, workload: WorkloadConfig, rate: float, settings: SimSettings, seed: int) -> dict:
    requests = build_workload(workload, seed)
    outcome = simulate(cluster_config(topology, seed), dataclasses.replace(settings, seed=seed), requests, PoissonArrivals(rate))
    return figures_of(outcome.point.metrics)


REAL_RUNS_FILE = "real_runs.json"


class RealRuns(msgspec.Struct, forbid_unknown_fields=True):
    """The real side of a validation run (--out), to simulate against again (--replay): per cluster
    topology, the profile its simulation used (a StepProfile document), each case's arrival rate
    (req/s) and its two real runs' figures (ms, METRICS; None where a run had none)."""

    seed: int
    requests_per_case: int
    profiles: dict[str, dict] = {}
    rates: dict[str, dict[str, float]] = {}
    real: dict[str, dict[str, list[dict[str, float | None]]]] = {}
    # How fast each real run's steps ran against the profile (step_speed); {} in files written before.
    step_speeds: dict[str, dict[str, list[float | None]]] = {}


def load_real_runs(path: Path) -> RealRuns:
    try:
        stored = msgspec.json.decode(path.read_bytes(), type=RealRuns)
    except (OSError, msgspec.DecodeError) as error:
        raise SystemExit(f"--replay {path}: {error}") from None
    known = workloads(1)
    for topology, runs in stored.real.items():
        if topology not in TOPOLOGIES or topology not in stored.profiles or set(runs) != set(stored.rates.get(topology, {})):
            raise SystemExit(f"--replay {path}: cluster {topology!r} lacks its profile or rates, or is not one of {list(TOPOLOGIES)}")
        for name, pair in runs.items():
            if name not in known or len(pair) != 2 or any(set(run) != set(METRICS) for run in pair):
                raise SystemExit(f"--replay {path}: case {topology}/{name} is not two runs of {list(METRICS)}")
    if not stored.real or len({tuple(runs) for runs in stored.real.values()}) != 1:
        raise SystemExit(f"--replay {path}: no clusters, or clusters with different cases")
    for topology in stored.real:
        try:
            StepProfile.from_dict(stored.profiles[topology])
        except ProfileError as error:
            raise SystemExit(f"--replay {path}: the profile of {topology}: {error}") from None
    return stored


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def real_mean(runs: list[dict[str, float | None]], metric: str) -> float | None:
    first, second = runs[0][metric], runs[1][metric]
    return None if first is None or second is None else (first + second) / 2


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def relative(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return abs(a - b) / b


def noise_floor(first: float | None, second: float | None) -> float | None:
    """The expected error, against the mean of two real runs `first` and `second`, of a prediction
    that is exactly the metric's expected value: with two independent runs of spread s, the mean
    misses the expectation by s / sqrt(2) and the runs miss each other by s x sqrt(2), so on average
    by half their difference, relative to the mean: |a - b| / (a + b)."""
    if first is None or second is None or first + second <= 0:
        return None
    return abs(first - second) / (first + second)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1P+1G only, two workloads, a few requests (smoke test)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--profile", default=None, help="one profile for every cluster (default: each cluster's own, PROFILES)")
    parser.add_argument(
        "--measure", action="store_true",
        help="measure each cluster's profile as deployed just before its real runs (duet profile --deployed: "
        "the calibration load, not these workloads), so that both see the host as busy as it is now",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the real side (profiles, rates, figures) to DIR/real_runs.json")
    parser.add_argument("--replay", type=Path, default=None,
                        help="a real_runs.json of an earlier run: simulate against its real runs, run nothing real")
    parser.add_argument(
        "--keep-steps", type=Path, default=None,
        help="keep the instances' step logs in DIR/<cluster>/: each real run's (<case>-<run>/) and, with --measure, "
        "the calibration's (calibration/steps/, with its timelines), to compare the steps the profile was fitted "
        "to with those it predicts (worker/profiler.py read_step_log)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    if args.replay is not None and (
        args.measure or args.quick or args.requests is not None or args.out is not None or args.keep_steps is not None
    ):
        parser.error("--replay takes its cases, requests, seed and profiles from the file (--profile may override the profiles) "
                     "and runs nothing real (no --keep-steps)")
    stored = load_real_runs(args.replay) if args.replay is not None else None
    if stored is not None:
        args.seed = stored.seed
    count = stored.requests_per_case if stored is not None else args.requests or (6 if args.quick else 36)
    cases = workloads(count)
    topologies = list(stored.real) if stored is not None else ["1p1g"] if args.quick else list(TOPOLOGIES)
    if stored is not None:
        cases = {name: cases[name] for name in next(iter(stored.real.values()))}
    elif args.quick:
        cases = {name: cases[name] for name in ("prefill_heavy", "decode_heavy")}

    def profile_for(topology: str) -> StepProfile:
        if stored is not None and args.profile is None:
            return StepProfile.from_dict(stored.profiles[topology])
        if args.measure:
            # Just before this cluster's real runs, not all clusters' first: this host's speed drifts
            # over minutes (two loaded calibration passes minutes apart fitted 110 and 66 us per
            # prefill token), and the other cluster's runs would put minutes between them.
            progress(f"{topology}: measuring its profile as deployed ...")
            document = measure_deployed(
                default_config(topology), name=f"measured-now-{topology}", quick=args.quick, progress=progress,
                keep_dir=None if args.keep_steps is None else args.keep_steps / topology / "calibration",
            )
            return StepProfile.from_dict(document)
        return load_profile(args.profile or PROFILES[topology])

    figures: dict[str, object] = {"load": LOAD, "requests_per_case": count, "load_average_before": _load_average()}
    profiles: dict[str, str] = {}
    if stored is not None:
        figures["replayed"] = str(args.replay)
    kept = RealRuns(seed=args.seed, requests_per_case=count)
    rows = []
    errors: list[float] = []
    floors: list[float] = []  # per metric, the error a perfect simulator would show (noise_floor)
    speed_matched_errors: list[float] = []
    speed_rows: list[list] = []
    used: dict[str, StepProfile] = {}  # each cluster's profile, for the kept steps' report
    cases_within = metrics_within = metrics_total = 0
    for topology in topologies:
        profile = profile_for(topology)
        profiles[topology] = profile.name
        used[topology] = profile
        settings = SimSettings(profile, data_plane("grpc-loopback"), sampling=SamplingSpec(timeout_s=None))
        if stored is not None:  # the rates the real runs ran at, whatever profile simulates them now
            rates, real = stored.rates[topology], stored.real[topology]
            speeds = stored.step_speeds.get(topology, {}) if args.profile is None else {}
        else:
            rates = {name: rate_for(cluster_config(topology, args.seed), profile, workload) for name, workload in cases.items()}
            keep = None if args.keep_steps is None else args.keep_steps / topology
            real, speeds = real_runs(topology, cases, rates, args.seed, profile, keep)
            kept.profiles[topology], kept.rates[topology], kept.real[topology] = profile.to_dict(), rates, real
            kept.step_speeds[topology] = speeds
            if args.out is not None:  # after each cluster: what a later failure would lose is the rest
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / REAL_RUNS_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(kept)))
        for name, workload in cases.items():
            case = f"{topology}_{name}"
            predicted = sim_run(topology, workload, rates[name], settings, args.seed)
            all_within = True
            case_errors: list[float | None] = []
            for metric in METRICS:
                first, second = real[name][0][metric], real[name][1][metric]
                mean = real_mean(real[name], metric)
                error = relative(predicted[metric], mean)
                case_errors.append(error)
                noise = relative(first, second) if first is not None and second is not None else None
                floor = noise_floor(first, second)
                if floor is not None:
                    floors.append(floor)
                bound = max(MIN_BOUND, 2 * noise) if noise is not None else MIN_BOUND
                within = error is not None and error <= bound
                all_within &= within
                metrics_within += within
                metrics_total += 1
                if error is not None:
                    errors.append(error)
                figures[f"{case}_{metric}_rel_error"] = None if error is None else round(error, 4)
                figures[f"{case}_{metric}_real_vs_real"] = None if noise is None else round(noise, 4)
                rows.append([case, metric, mean, predicted[metric], error, noise, floor, "yes" if within else "no"])
            cases_within += all_within
            figures[f"{case}_rate_per_s"] = round(rates[name], 3)
            # How much of the error is the step model's level on these runs (the host's speed since
            # the profile was measured, or shapes it misses): the same simulation with the steps as
            # long as the real runs' own on average (a diagnosis, not the validation: it takes the
            # step times from the runs it predicts).
            case_speeds = speeds.get(name, [])
            if len(case_speeds) == 2 and None not in case_speeds:
                speed = statistics.fmean(case_speeds)
                matched = sim_run(topology, workload, rates[name], dataclasses.replace(settings, profile=speed_matched(profile, speed)), args.seed)
                matched_errors = [relative(matched[m], real_mean(real[name], m)) for m in METRICS]
                speed_matched_errors.extend(e for e in matched_errors if e is not None)
                figures[f"{case}_real_step_speed"] = round(speed, 4)
                speed_rows.append([case, speed, _median(case_errors), _median(matched_errors)])
    figures["profiles"] = profiles
    figures["load_average_after"] = _load_average()  # the host's 1, 5 and 15 minute load: other jobs make real runs noisy
    figures["median_rel_error"] = round(statistics.median(errors), 4) if errors else None
    figures["median_noise_floor"] = round(statistics.median(floors), 4) if floors else None
    figures["cases_within_bound"] = cases_within
    figures["cases_total"] = len(topologies) * len(cases)
    figures["metrics_within_bound"] = metrics_within
    figures["metrics_total"] = metrics_total
    figures["speed_matched_median_rel_error"] = _median(speed_matched_errors)
    print_table(["case", "metric", "real ms", "sim ms", "error", "real vs real", "noise floor", "within"],
                [["-" if c is None else c for c in row] for row in rows])
    if speed_rows:
        print_table(["case", "real steps / profile", "median error", "median error, steps at the real speed"],
                    [["-" if c is None else c for c in row] for row in speed_rows])
    if args.keep_steps is not None:
        print_table(["cluster", "kept steps", "all (steps)", "context", "decode only", "alone", "contended"],
                    kept_steps_report(args.keep_steps, used))
    targets = {"median_rel_error": Target(figures["median_rel_error"] or 1.0, MIN_BOUND, higher_is_better=False)}
    emit_result(BENCH, figures, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
