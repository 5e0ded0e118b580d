"""Does `duet plan` pick the split real runs would? Its choice at 4 instances against real goodput of every split.

For a prefill-heavy and a decode-heavy mix, `duet plan`'s search (cluster/sim/plan.py: every P:D
split of 4 instances and all MIXED, least_loaded placement) runs in the simulator with the profile
of this machine measured as deployed (`cpu-builtin-deployed`, which carries how much its instances
slow each other; it was measured on 2 instances sharing the 2 cores). `--measure` measures one first
on the deployment the real runs use, 2 PREFILL + 2 GENERATION of 0.5 CPU and 1 torch thread each
(`duet profile --deployed` on that cluster: its steps, how 4 instances slow each other, its
hand-over), and plans with it; `--profile` names another. Then every split runs for real as `duet
serve` would deploy it here (4 Ray actors with num_cpus 0.5 and 1 torch thread on a 2-CPU embedded
Ray, the built-in model, fp32), a fresh cluster per split, loaded by `duet bench`'s runner at a grid
of Poisson rates around the simulated maxima. A split's real goodput is the highest grid rate below
its first failure (the planner's own monotone reading) where at least ATTAINMENT of the requests met
both SLOs; the highest grid rate that passed at all is reported beside it (a point of 60 requests is
noisy: 6 misses decide it). The grid's step is the resolution: the plan's pick is "within noise" of
the real best when its real goodput is at most one grid step below it.

Figures: `<mix>_<split>_sim_rate_per_s`, `<mix>_<split>_real_goodput_per_s`,
`<mix>_<split>_real_highest_pass_per_s`, `<mix>_<split>_real_attainment` (per grid rate), `<mix>_picked`,
`<mix>_real_best`, `<mix>_picked_within_one_step` (1 or 0), `<mix>_plan_wall_s`, `<mix>_real_wall_s`.
Why a split missed, per grid rate (`<mix>_<split>_real_misses`): the share of requests over the TTFT
SLO and over the TPOT SLO (a request can be both), TTFT p90 and TPOT p90, and the p50 / p90 of the
second-token gap, from a request's first token to its second, which holds a handed-over request's
hand-over (the prefill-heavy mix has 4 output tokens: its TPOT is the mean of 3 gaps, the first of
them that one). A split that fails at every rate shows here whether its prompts queued (TTFT) or its
hand-overs were slow (the gap, and TPOT).

    python bench/planner_check.py [--quick] [--requests N] [--profile P | --measure [--save-profile FILE]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.deploy.launch import keep_ray_on_loopback  # noqa: E402

keep_ray_on_loopback()  # before anything imports Ray: the real runs start an embedded one
from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from cluster.cli.bench import BenchSettings, run_points  # noqa: E402
from cluster.loadgen.arrivals import PoissonArrivals  # noqa: E402
from cluster.loadgen.metrics import Distribution, Slo  # noqa: E402
from cluster.loadgen.runner import SamplingSpec  # noqa: E402
from cluster.loadgen.workloads import WorkloadConfig, WorkloadKind, build_workload  # noqa: E402
from cluster.sim.catalog import load_profile  # noqa: E402
from cluster.sim.cluster import SimSettings  # noqa: E402
from cluster.sim.deployed import default_config, measure_deployed  # noqa: E402
from cluster.sim.link import data_plane  # noqa: E402
from cluster.sim.plan import Candidate, best, plan  # noqa: E402
from cluster.sim.profile import StepProfile  # noqa: E402

BENCH = "planner_check"
PROFILE = "cpu-builtin-deployed"
INSTANCES = 4
ATTAINMENT = 0.9
SLO = Slo(ttft_ms=500.0, tpot_ms=25.0)
GRID = (0.3, 0.45, 0.6, 0.8, 1.0, 1.25, 1.6, 2.0)  # x the highest simulated maximum of the splits
MISS_COLUMNS = ("failed", "over_ttft", "over_tpot", "ttft_p90_ms", "tpot_p90_ms", "second_token_gap_p50_ms", "second_token_gap_p90_ms")
MIXES = {  # bench/sim_validation.py's shapes
    "prefill_heavy": (768, 4),
    "decode_heavy": (48, 96),
}


def second_token_gaps_s(records) -> list[float]:
    """Per completed request of two or more output tokens: seconds from its first token's arrival to
    its second's (0 when one message carried both)."""
    gaps = []
    for record in records:
        if not record.ok or record.output_tokens < 2 or not record.chunk_times_s:
            continue
        if record.chunk_tokens[0] >= 2:
            gaps.append(0.0)
        elif len(record.chunk_times_s) >= 2:
            gaps.append(record.chunk_times_s[1] - record.chunk_times_s[0])
    return gaps


def misses(records, metrics) -> dict[str, float | None]:
    """Why the requests of one point missed the SLOs (the module docstring)."""
    done = [record for record in records if record.ok]
    over_ttft = sum(1 for r in done if r.ttft_s is None or r.ttft_s * 1000.0 > SLO.ttft_ms)
    over_tpot = sum(1 for r in done if r.tpot_s is not None and r.tpot_s * 1000.0 > SLO.tpot_ms)
    gaps = Distribution.of_seconds(second_token_gaps_s(done))
    count = max(1, len(records))
    return {
        "failed": round((len(records) - len(done)) / count, 3),
        "over_ttft": round(over_ttft / count, 3),
        "over_tpot": round(over_tpot / count, 3),
        "ttft_p90_ms": None if metrics.ttft_ms is None else round(metrics.ttft_ms.p90, 1),
        "tpot_p90_ms": None if metrics.tpot_ms is None else round(metrics.tpot_ms.p90, 1),
        "second_token_gap_p50_ms": None if gaps is None else round(gaps.p50, 1),
        "second_token_gap_p90_ms": None if gaps is None else round(gaps.p90, 1),
    }


def real_goodput(config, workload: WorkloadConfig, rates: list[float], seed: int) -> tuple[float, list[float], list[dict]]:
    """The split's highest grid rate below its first failure, the attainment at each rate, and why
    each rate's requests missed (`misses`)."""
    from cluster.deploy.embedded import BackgroundCluster

    settings = BenchSettings(
        workload=workload, points=tuple(PoissonArrivals(rate) for rate in rates), slo=SLO, sampling=SamplingSpec(),
        warmup=4, seed=seed, out_dir=Path("."), plots=False, progress=False,
    )
    with BackgroundCluster(config) as cluster:
        points = asyncio.run(run_points(cluster.target, {}, settings, None))
    attainments = [(point.metrics.good_requests or 0) / max(1, point.metrics.num_requests) for point in points]
    goodput = 0.0
    for rate, attained in zip(rates, attainments, strict=True):
        if attained < ATTAINMENT:
            break
        goodput = rate
    return goodput, attainments, [misses(point.outcome.records, point.metrics) for point in points]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the prefill-heavy mix only, 24 requests a point (a smoke run)")
    parser.add_argument("--requests", type=int, default=None, help="requests per real point (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=PROFILE, help=f"the profile to plan with (default {PROFILE})")
    parser.add_argument("--measure", action="store_true",
                        help=f"measure the profile first, as deployed on {INSTANCES} instances as the real runs deploy them")
    parser.add_argument("--save-profile", type=Path, default=None, help="with --measure: write the measured profile here")
    args = parser.parse_args(argv)
    if args.save_profile is not None and not args.measure:
        parser.error("--save-profile writes what --measure measured")
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    count = args.requests or (24 if args.quick else 60)
    mixes = {"prefill_heavy": MIXES["prefill_heavy"]} if args.quick else MIXES
    base = default_config("1p1g")
    if args.measure:
        split = Candidate(INSTANCES // 2, INSTANCES - INSTANCES // 2, "least_loaded")
        progress(f"measuring the profile as deployed on {split.label} ...")
        name = f"measured-now-{split.num_prefill}p{split.num_generation}g"
        document = measure_deployed(split.config(base), name=name, quick=args.quick, progress=progress)
        if args.save_profile is not None:
            args.save_profile.write_text(json.dumps(document, indent=2) + "\n")
        profile = StepProfile.from_dict(document)
        profile_name = f"measured now on {split.label} ({document['device']})"
    else:
        profile, profile_name = load_profile(args.profile), args.profile
    settings = SimSettings(profile, data_plane("grpc-loopback"), sampling=SamplingSpec(timeout_s=None), seed=args.seed)
    figures: dict[str, object] = {"profile": profile_name, "instances": INSTANCES, "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms},
                                  "attainment": ATTAINMENT, "requests_per_point": count}
    rows = []
    miss_rows: list[list] = []
    within = 0
    for mix, (prompt, output) in mixes.items():
        workload = WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=count, input_len=prompt, output_len=output)
        progress(f"{mix}: duet plan's search in the simulator ...")
        started = time.perf_counter()
        results = plan(base, settings, build_workload(workload, args.seed), SLO, INSTANCES, policies=("least_loaded",),
                       attainment=ATTAINMENT, prune=False)
        figures[f"{mix}_plan_wall_s"] = round(time.perf_counter() - started, 1)
        picked = best(results)
        top = max(result.max_rate_per_s for result in results)
        rates = [round(top * factor, 2) for factor in GRID]
        figures[f"{mix}_grid_per_s"] = rates
        real = {}
        started = time.perf_counter()
        for result in results:
            candidate = result.candidate
            split = f"{candidate.num_prefill}P:{candidate.num_generation}D" if candidate.num_prefill else f"{INSTANCES}MIXED"
            progress(f"{mix} {split}: real runs at {rates} req/s ...")
            goodput, attainments, why = real_goodput(candidate.config(base), workload, rates, args.seed)
            real[candidate] = goodput
            figures[f"{mix}_{split}_real_misses"] = why
            for rate, attained, missed in zip(rates, attainments, why, strict=True):
                miss_rows.append([mix, split, rate, attained, *(missed[key] for key in MISS_COLUMNS)])
            figures[f"{mix}_{split}_sim_rate_per_s"] = round(result.max_rate_per_s, 3)
            figures[f"{mix}_{split}_real_goodput_per_s"] = goodput
            figures[f"{mix}_{split}_real_attainment"] = [round(a, 3) for a in attainments]
            figures[f"{mix}_{split}_real_highest_pass_per_s"] = max(
                (rate for rate, attained in zip(rates, attainments, strict=True) if attained >= ATTAINMENT), default=0.0
            )
            rows.append([mix, split, result.max_rate_per_s, goodput, " ".join(f"{a:.2f}" for a in attainments),
                         "picked" if result is picked else ""])
        figures[f"{mix}_real_wall_s"] = round(time.perf_counter() - started, 1)
        real_best = max(real, key=lambda candidate: real[candidate])
        picked_real = real[picked.candidate]
        step_below = max((rate for rate in rates if rate < real[real_best]), default=0.0)
        ok = picked_real >= step_below
        within += ok
        figures[f"{mix}_picked"] = picked.candidate.label
        figures[f"{mix}_real_best"] = real_best.label
        figures[f"{mix}_picked_within_one_step"] = int(ok)
    print(f"{INSTANCES} instances, profile {profile_name}, SLO TTFT {SLO.ttft_ms:g} ms / TPOT {SLO.tpot_ms:g} ms for {ATTAINMENT:.0%}")
    print_table(["mix", "split", "rate req/s", "attained", *MISS_COLUMNS], [["-" if c is None else c for c in row] for row in miss_rows])
    print_table(["mix", "split", "sim max req/s", "real goodput req/s", "real attainment per grid rate", ""], rows)
    emit_result(BENCH, figures, {"mixes_picked_within_one_step": Target(within, len(mixes), True)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
