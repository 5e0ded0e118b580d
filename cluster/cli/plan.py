"""`duet plan`: the best split of N instances and placement policy for a workload, searched in the simulator.

    duet plan --profile cpu-builtin --workload lognormal --slo-ttft-ms 200 --slo-tpot-ms 50 --instances 4
    duet plan --config cluster.yaml --profile roofline:h100-sxm:llama-3-8b --instances 8 \\
        --workload lognormal --input-len 1024 --output-len 256 --slo-ttft-ms 400 --slo-tpot-ms 40 --out plan/

For all MIXED and every P:D ratio of --instances N, under each placement policy, it finds the highest
request rate whose requests meet the SLOs (--attainment of them, 90 % by default) and prints goodput
per instance for each, the best marked; plots the curve (plan.png) and writes the best as a cluster
YAML (best-cluster.yaml) that `duet serve --config` accepts (the --config settings, with the split
and policy replaced). cluster/sim/plan.py is the search.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from cluster.cli.bench import add_workload_options
from cluster.cli.common import EXIT_OK, EXIT_USAGE, CliError, add_log_level, setup_logging
from cluster.cli.sim import add_cluster_options, cluster_config, profile_pool, sim_settings
from cluster.deploy.config import ClusterConfig, InstanceGroup
from cluster.loadgen.metrics import Slo, SloError
from cluster.loadgen.report import envelope, render_table
from cluster.loadgen.runner import SamplingSpec
from cluster.loadgen.workloads import (
    WorkloadConfig,
    WorkloadError,
    WorkloadKind,
    build_workload,
    load_sharegpt,
)
from cluster.sim.cluster import REQUEST_LIMITED_WARN_SHARE, pool_shortfalls, request_limits
from cluster.sim.plan import (
    DEFAULT_BISECTIONS,
    MAX_BISECTIONS,
    MIN_WINDOW_LIVES,
    POLICIES,
    CandidateResult,
    best,
    candidates,
    plan,
    probe_window_s,
    request_life_s,
)
from worker.protocol import InstanceRole

BENCH_NAME = "duet_plan"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="search instance splits (all MIXED, every P:D) and placement policies in the simulator for goodput per instance",
        description="For N instances: all MIXED and every P:D split, under each placement policy, the highest rate "
        "within the SLOs by simulation; prints goodput per instance for each (best marked), plots the curve and "
        "writes the best as a cluster YAML for duet serve.",
    )
    add_cluster_options(parser)
    add_workload_options(parser)
    search = parser.add_argument_group("search")
    search.add_argument("--slo-ttft-ms", type=float, required=True, metavar="MS", help="TTFT objective")
    search.add_argument("--slo-tpot-ms", type=float, required=True, metavar="MS", help="TPOT objective")
    search.add_argument("--attainment", type=float, default=0.9, metavar="F", help="share of requests that must meet both")
    search.add_argument("--policies", nargs="+", choices=tuple(POLICIES), default=list(POLICIES), help="placement policies to try")
    search.add_argument("--duration", type=float, default=None, metavar="S",
                        help="simulated seconds of arrivals per probe (default: 30, or 3 lives of a request under the SLOs when "
                        "longer; quick 5); --num-requests sizes the pool that probes repeat")
    search.add_argument("--seed", type=int, default=0, metavar="S", help="seeds the workload and arrival times")
    search.add_argument("--bisections", type=int, default=DEFAULT_BISECTIONS, metavar="N",
                        help="bisection steps after the rate doubling phase; each halves the uncertainty of a "
                        f"candidate's highest rate for one more simulation per candidate (default {DEFAULT_BISECTIONS}: "
                        "within 1/16 of the doubled bracket, about 6 %%)")
    search.add_argument("--splits", type=int, nargs="+", default=None, metavar="P",
                        help="search only these splits, by prefill instances (0: all MIXED; P: P prefill and N - P generation); "
                        "default: all MIXED and every P:D")
    search.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="candidates searched at once, each in a process of its own (default: the CPUs this process may "
                        "use; each holds one simulation in memory); the best split and its rate do not depend on it")
    output = parser.add_argument_group("output")
    output.add_argument("--out", default=None, metavar="DIR", help="plan.json, plan.png, best-cluster.yaml (default ./plan-results/<time>)")
    output.add_argument("--no-plots", action="store_true", help="write no plan.png")
    output.add_argument("--quick", action="store_true", help="few requests, coarse search (a smoke test)")
    search.add_argument("--every-maximum", action="store_true",
                        help="search every candidate to its own highest rate (slower; by default a candidate that cannot "
                        "sustain the best rate found so far is reported as below it after one probe)")
    add_log_level(output, "ERROR")
    parser.set_defaults(handler=run)
    # --instances is the total to split here (add_cluster_options words it as counts for duet sim).
    for action in parser._actions:
        if action.dest == "instances":
            action.help = "N: the total to split (all MIXED, and every P:D with P + D = N)"


def _workload(args: argparse.Namespace) -> WorkloadConfig:
    quick = args.quick
    try:
        return WorkloadConfig(
            kind=WorkloadKind(args.workload or "lognormal"),
            num_requests=args.num_requests or (300 if quick else 4000),
            input_len=args.input_len or (128 if quick else 512),
            output_len=args.output_len or (16 if quick else 128),
            lognormal_sigma=args.lognormal_sigma,
            num_prefixes=args.num_prefixes or 4,
            prefix_len=args.prefix_len or 256,
            suffixes_per_prefix=args.suffixes_per_prefix or 8,
            turns=args.turns or 4,
            dataset_path=args.dataset,
            sharegpt_bytes_per_token=args.sharegpt_bytes_per_token,
        )
    except WorkloadError as error:
        raise CliError(f"--{error.field.replace('_', '-')}: {error.message}", EXIT_USAGE) from None


def plot_plan(results: list[CandidateResult], chosen: CandidateResult, path: Path) -> Path:
    from cluster.loadgen.plots import _pyplot, save_figure

    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.8))
    for policy in dict.fromkeys(r.candidate.policy for r in results):
        # Candidates left below the best rate found before them have no maximum of their own to plot.
        mine = [r for r in results if r.candidate.policy == policy and r.below_rate_per_s is None]
        split = [r for r in mine if r.candidate.num_prefill]
        line = axis.plot([r.candidate.num_prefill for r in split], [r.goodput_per_instance for r in split], "o-", label=f"P:D, {policy}")
        mixed = [r for r in mine if not r.candidate.num_prefill]
        axis.plot([0] * len(mixed), [r.goodput_per_instance for r in mixed], "s", color=line[0].get_color(), label=f"all MIXED, {policy}")
    axis.plot([chosen.candidate.num_prefill], [chosen.goodput_per_instance], "*", markersize=18, color="gold", markeredgecolor="black", label="best")
    n = chosen.candidate.num_instances
    axis.set_xticks(range(n))
    axis.set_xticklabels(["MIXED"] + [f"{p}P:{n - p}D" for p in range(1, n)])
    axis.set_ylabel("goodput per instance (req/s)")
    axis.set_title(f"duet plan: {n} instances", fontsize=10)
    axis.legend(fontsize=7)
    return save_figure(figure, path, dpi=110)


def _capped_by_request_limits(results: list) -> list[str]:
    """The candidates whose probe at the highest rate they passed ran at least
    REQUEST_LIMITED_WARN_SHARE of some role's steps at the engine's request limit
    (cluster/sim/plan.py Probe.request_limited)."""
    labels = []
    for result in results:
        passed = [probe for probe in result.probes if probe.passed]
        if passed:
            top = max(passed, key=lambda probe: probe.rate_per_s)
            if max(top.request_limited.values(), default=0.0) >= REQUEST_LIMITED_WARN_SHARE:
                labels.append(result.candidate.label)
    return labels


def _bounds(result: CandidateResult, num_instances: int) -> tuple[object, object]:
    """The table's max rate and goodput per instance: "< x" for a candidate left below the best
    rate (not searched further), ">= x" for one that passed every rate tried."""
    if result.below_rate_per_s is not None:
        return f"< {result.below_rate_per_s:g}", f"< {result.below_rate_per_s / num_instances:.4g}"
    if result.unbounded:
        return f">= {result.max_rate_per_s:g}", f">= {result.goodput_per_instance:.4g}"
    return result.max_rate_per_s, result.goodput_per_instance


def cluster_yaml(config: ClusterConfig) -> str:
    import yaml

    data = msgspec.to_builtins(config)
    return yaml.safe_dump(data, sort_keys=False)


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one: a container's or a Ray job's share)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.instances is None or not args.instances.isdigit() or int(args.instances) < 2:
        raise CliError("--instances: the number of instances to split, an integer >= 2", EXIT_USAGE)
    if not 0 < args.attainment <= 1:
        raise CliError("--attainment: a share in (0, 1]", EXIT_USAGE)
    num_instances = int(args.instances)
    if not 0 <= args.bisections <= MAX_BISECTIONS:
        raise CliError(f"--bisections: an integer from 0 to {MAX_BISECTIONS}", EXIT_USAGE)
    if args.jobs is not None and args.jobs < 1:
        raise CliError("--jobs: the number of candidates to search at once, an integer >= 1", EXIT_USAGE)
    jobs = args.jobs if args.jobs is not None else _usable_cpus()
    try:
        todo = candidates(num_instances, args.policies, args.splits)  # refuses a split outside 0 .. N - 1, before any work
    except ValueError as error:
        raise CliError(f"--splits: {error}", EXIT_USAGE) from None
    try:
        slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    except SloError as error:
        raise CliError(f"--slo-{error.field.removesuffix('_ms')}-ms: {error.message}", EXIT_USAGE) from None
    workload = _workload(args)
    dataset = load_sharegpt(workload.dataset_path) if workload.dataset_path else None
    requests = build_workload(workload, args.seed, dataset)
    settings = sim_settings(args, SamplingSpec(timeout_s=None), args.seed)
    base = profile_pool(cluster_config(argparse.Namespace(**{**vars(args), "instances": None})), settings.profile, "duet plan")
    if args.stream_interval_ms is not None:  # what was simulated is what best-cluster.yaml serves
        base = msgspec.structs.replace(base, engine={**base.engine, "stream_interval_ms": args.stream_interval_ms})
    # Every role a candidate may use: a request refused at submission would count against every
    # split alike and hide what the search compares.
    roles = (InstanceRole.PREFILL, InstanceRole.GENERATION, InstanceRole.MIXED)
    groups = [next((g for g in base.instances if g.role is role), InstanceGroup(role)) for role in roles]
    shortfalls = pool_shortfalls(base, settings.profile, requests, groups)
    if shortfalls:
        raise CliError("; ".join(message for message, _count in shortfalls), EXIT_USAGE)
    out_dir = Path(args.out) if args.out else Path("plan-results") / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    life_s = request_life_s(slo, requests)
    window_s = probe_window_s(life_s)
    duration_s = args.duration if args.duration is not None else 5.0 if args.quick else window_s
    if duration_s < MIN_WINDOW_LIVES * life_s:
        print(
            f"duet plan: warning: each probe sends {duration_s:g} s of arrivals, shorter than {MIN_WINDOW_LIVES} lives of a "
            f"request under these SLOs ({life_s:.3g} s each): a probe then measures how large a burst the cluster absorbs, "
            f"not the rate it sustains, and overstates it (leave --duration unset for {window_s:.3g} s)",
            file=sys.stderr,
        )
    print(
        f"duet plan: {len(todo)} candidates ({len(todo) // len(args.policies)} splits x {len(args.policies)} policies), "
        f"{min(jobs, len(todo))} at a time, probes of {duration_s:g} s of arrivals; a line per simulation as it ends, "
        "and one per candidate",
        file=sys.stderr, flush=True,
    )
    started = time.perf_counter()
    results = plan(
        base, settings, requests, slo, num_instances, policies=args.policies, attainment=args.attainment,
        duration_s=duration_s, prune=not args.every_maximum, jobs=jobs, prefill_counts=args.splits, bisections=args.bisections,
        progress=lambda message: print(message, file=sys.stderr, flush=True), probe_progress=True,
    )
    elapsed_s = time.perf_counter() - started
    chosen = best(results)
    capped = [r.candidate.label for r in results if any(p.refused for p in r.probes)]
    if capped:
        print(
            f"duet plan: warning: the router refused requests at its admission limit (router.admission.max_queued_requests: "
            f"{base.router.admission.max_queued_requests}) in probes of {len(capped)} of {len(results)} candidates "
            f"({', '.join(capped[:3])}{', ...' if len(capped) > 3 else ''}): that limit, not the instances, capped their "
            "rates; raise it in --config for a cluster this size",
            file=sys.stderr,
        )
    limited = _capped_by_request_limits(results)
    if limited:
        print(
            f"duet plan: warning: at the highest rate each passed, {len(limited)} of {len(results)} candidates "
            f"({', '.join(limited[:3])}{', ...' if len(limited) > 3 else ''}) ran at least "
            f"{REQUEST_LIMITED_WARN_SHARE:.0%} of some role's steps at the engine's request limits ({request_limits(base)}) "
            "with requests waiting: those limits, not the simulated device, shaped their rates; raise them in --config for the "
            "device you plan for",
            file=sys.stderr,
        )
    rows = [
        [("* " if r is chosen else "  ") + r.candidate.label, *_bounds(r, num_instances), len(r.probes)] for r in results
    ]
    sys.stdout.write(render_table(["split / policy", "max req/s in SLO", "goodput / instance", "simulations"], rows))
    if chosen.unbounded:
        print(
            f"duet plan: {chosen.candidate.label} passed every rate tried, up to {chosen.max_rate_per_s:g} req/s: its maximum "
            "(and perhaps the best split) lies beyond the search; use tighter SLOs or a larger workload",
            file=sys.stderr,
        )
    best_config = chosen.candidate.config(base)
    yaml_path = out_dir / "best-cluster.yaml"
    yaml_path.write_text(
        f"# duet plan: {chosen.candidate.label}, {chosen.goodput_per_instance:.4g} req/s per instance within "
        f"TTFT {args.slo_ttft_ms} ms / TPOT {args.slo_tpot_ms} ms ({args.attainment:.0%}), profile {settings.profile.name}\n"
        + cluster_yaml(best_config)
    )
    ClusterConfig.from_yaml(yaml_path)  # what duet serve will read: it must load
    plots: list[str] = []
    if not args.no_plots:
        try:
            plots.append(str(plot_plan(results, chosen, out_dir / "plan.png")))
        except Exception as error:  # noqa: BLE001 - a missing matplotlib must not lose the plan
            print(f"duet plan: plot skipped: {error}", file=sys.stderr)
    figures: dict[str, Any] = {
        "instances": num_instances,
        "profile": settings.profile.name,
        "best": chosen.candidate.label,
        "best_goodput_per_instance": round(chosen.goodput_per_instance, 5),
        # Goodput per instance; null for a candidate left below the best rate found before it (its
        # own maximum was not searched: `below_best` gives the rate it failed).
        "candidates": {r.candidate.label: None if r.below_rate_per_s is not None else round(r.goodput_per_instance, 5) for r in results},
        "below_best": {r.candidate.label: r.below_rate_per_s for r in results if r.below_rate_per_s is not None},
        # Candidates that passed every rate the search doubled to: their figure is a lower bound.
        "at_least": [r.candidate.label for r in results if r.unbounded],
        "window_s": duration_s,
        "request_life_s": round(life_s, 3),
        "simulations": sum(len(r.probes) for r in results),
        "jobs": jobs,
        "bisections": args.bisections,
        "splits": "all" if args.splits is None else sorted(set(args.splits)),
        "wall_s": round(elapsed_s, 2),
        "cluster_yaml": str(yaml_path),
    }
    document = figures | {
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": args.attainment},
        "probes": {r.candidate.label: [p.__dict__ for p in r.probes] for r in results},
        "plots": plots,
    }
    (out_dir / "plan.json").write_text(json.dumps(document, indent=2) + "\n")
    sys.stdout.write(f"\nbest: {chosen.candidate.label} ({chosen.goodput_per_instance:.4g} req/s per instance)\n")
    sys.stdout.write(f"cluster config: {yaml_path}\n")
    for path in plots:
        sys.stdout.write(f"plot: {path}\n")
    sys.stdout.write(f"{figures['simulations']} simulations in {elapsed_s:.1f}s\n")
    sys.stdout.write(envelope(BENCH_NAME, figures, {}) + "\n")
    return EXIT_OK
