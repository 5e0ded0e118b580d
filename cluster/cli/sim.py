"""`duet sim`: `duet bench` against a simulated cluster (cluster/sim/), on virtual time.

    duet sim --profile cpu-builtin --workload shared-prefix --rate 4 8
    duet sim --config cluster.yaml --profile roofline:h100-sxm:llama-3-8b --instances 64P,192G \\
        --workload lognormal --input-len 512 --output-len 128 --num-requests 10000 --rate 400
    duet sim --profile cpu-bench8 --workload trace --trace tests/data/azure_trace_sample.csv
    duet sim --profile cpu-builtin --kill generation-0@5 --rate 8        # an instance dies 5 s in

The cluster is the configuration `duet serve` reads (--config; --instances or --prefill/--generation/
--mixed override the counts, so a 256-instance cluster needs no YAML), each instance a simulated
engine whose steps take the profile's time (`duet profile`; shipped: cluster/sim/profiles/; or
`roofline:DEVICE:MODEL`, an estimate). The real router places, hands over and recovers; its poll
loops, watchdog and timeouts run on the simulated clock. Prints what `duet bench` prints (TTFT /
TPOT / ITL / e2e percentiles, goodput under the SLOs, prefix hit rate) plus per-instance
utilisation and transfer volume, writes results.json and the same plots, and ends stdout with the
JSON envelope.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from typing import Any

from cluster.cli.bench import (
    BenchSettings,
    add_load_options,
    add_output_options,
    add_workload_options,
    settings_from_args,
    write_outputs,
)
from cluster.cli.common import EXIT_OK, EXIT_USAGE, CliError, add_log_level, setup_logging
from cluster.deploy.config import ClusterConfig, ConfigError
from cluster.loadgen.report import render_table
from cluster.loadgen.runner import PointResult
from cluster.loadgen.trace import read_trace, trace_workload
from cluster.loadgen.workloads import WorkloadError, build_workload, load_sharegpt
from cluster.sim.catalog import load_profile, shipped_profiles
from cluster.sim.cluster import (
    InstanceDeath,
    SimOutcome,
    SimSettings,
    check_deaths,
    pool_shortfalls,
    pool_summary,
    refused_at_admission,
    request_limit_warning,
    simulate,
    with_profile_pool,
)
from cluster.sim.link import DATA_PLANES, DEFAULT_PLANE, LinkError, data_plane
from cluster.sim.profile import ProfileError, StepProfile
from worker.protocol import InstanceRole

BENCH_NAME = "duet_sim"
DEFAULT_PROFILE = "cpu-builtin"
_ROLE_LETTERS = {"P": InstanceRole.PREFILL, "G": InstanceRole.GENERATION, "M": InstanceRole.MIXED}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="duet bench against a simulated cluster: the real router and schedulers on virtual time",
        description="Simulate a cluster (the real router, each instance's real scheduler, model time from a "
        "step-time profile, KV transfers from a link model) under a duet bench workload, or a trace; prints "
        "duet bench's table plus per-instance utilisation and transfer volume, writes results.json and plots.",
    )
    add_cluster_options(parser)
    add_workload_options(parser, extra_kinds=("trace",))
    parser.add_argument_group("trace").add_argument(
        "--trace", default=None, metavar="FILE",
        help="--workload trace: a CSV/JSONL of (arrival time, prompt tokens, output tokens), the Azure LLM trace format",
    )
    parser.add_argument("--trace-time-scale", type=float, default=1.0, metavar="X", help="trace: multiply send times by X")
    add_load_options(parser)
    output = add_output_options(parser)
    output.add_argument("--kill", action="append", default=[], metavar="ID@S[+R]",
                        help="kill instance ID at simulated second S (restart R seconds later); repeatable")
    add_log_level(output, "ERROR")
    parser.set_defaults(handler=run)


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("simulated cluster")
    group.add_argument("--config", metavar="FILE", help="cluster configuration (YAML, as duet serve reads)")
    group.add_argument("--instances", default=None, metavar="SPEC",
                       help="instance counts: 64P,192G or 8M (P prefill, G generation, M mixed); overrides --config")
    for role in ("prefill", "generation", "mixed"):
        group.add_argument(f"--{role}", type=int, default=None, metavar="N", help=f"{role.upper()} instances")
    group.add_argument("--profile", default=DEFAULT_PROFILE, metavar="P",
                       help=f"step-time profile: a shipped name ({', '.join(shipped_profiles()) or 'none'}), a JSON "
                       "file from duet profile, or roofline:DEVICE:MODEL")
    group.add_argument("--link", default=DEFAULT_PLANE, choices=tuple(DATA_PLANES), help="KV transfer data plane model")
    group.add_argument("--rpc-latency-ms", type=float, default=None, metavar="MS",
                       help="router/instance call latency (default: the profile's measured one, else 0.5)")
    group.add_argument("--frontend-latency-ms", type=float, default=None, metavar="MS",
                       help="front end latency per message, each way (default: the profile's measured one, else 0)")
    group.add_argument("--stream-interval-ms", type=float, default=None, metavar="MS",
                       help="instances merge a request's tokens for up to MS before reporting them (default: the "
                       "configuration's engine.stream_interval_ms, 0 unless set; 0: every step; TTFT, TPOT and e2e "
                       "stay exact, ITL is seen in chunks; faster for large simulations)")


def parse_instances(spec: str) -> dict[InstanceRole, int]:
    """`64P,192G`, `2P+6G`, `8M`, or `prefill=2,generation=6`."""
    counts: dict[InstanceRole, int] = {}
    for part in re.split(r"[,+\s]+", spec.strip()):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)([PGMpgm])", part) or re.fullmatch(r"(prefill|generation|mixed)=(\d+)", part, re.IGNORECASE)
        if match is None:
            raise CliError(f"--instances: {part!r} is not N followed by P, G or M (e.g. 64P,192G)", EXIT_USAGE)
        if match.group(1).isdigit():
            role, count = _ROLE_LETTERS[match.group(2).upper()], int(match.group(1))
        else:
            role, count = InstanceRole[match.group(1).upper()], int(match.group(2))
        counts[role] = counts.get(role, 0) + count
    if not sum(counts.values()):
        raise CliError("--instances: no instances", EXIT_USAGE)
    return {role: counts.get(role, 0) for role in InstanceRole}


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    try:
        config = ClusterConfig.from_yaml(args.config) if args.config else ClusterConfig()
    except ConfigError as error:
        raise CliError(f"--config: {error}", EXIT_USAGE) from None
    counts: dict[InstanceRole, int] = {}
    if getattr(args, "instances", None):
        counts = parse_instances(args.instances)
    for role in InstanceRole:
        value = getattr(args, role.name.lower(), None)
        if value is not None:
            counts[role] = value
    if not counts:
        return config
    try:
        return config.with_instances(counts)
    except ConfigError as error:  # e.g. PREFILL instances and nothing to hand over to
        detail = error.detail if error.path == "instances" else str(error)
        raise CliError(f"--instances: {detail}", EXIT_USAGE) from None


def profile_pool(config: ClusterConfig, profile: StepProfile, command: str) -> ClusterConfig:
    """The configuration with the profile's KV pool where it sizes none (with_profile_pool), saying so."""
    sized = with_profile_pool(config, profile)
    if sized is not config:
        print(
            f"{command}: KV pool per instance: {pool_summary(sized, profile)}, the {profile.name} profile's estimate of one "
            f"{profile.device}'s memory less the weights (engine.num_blocks or engine.kv_cache_bytes in --config sets it)",
            file=sys.stderr, flush=True,
        )
    return sized


def sim_settings(args: argparse.Namespace, sampling: Any, seed: int) -> SimSettings:
    try:
        profile = load_profile(args.profile)
        link = data_plane(args.link)
    except (ProfileError, LinkError) as error:
        raise CliError(f"--profile/--link: {error}", EXIT_USAGE) from None
    deaths = tuple(_death(text) for text in getattr(args, "kill", ()))
    return SimSettings(
        profile, link, rpc_latency_s=None if args.rpc_latency_ms is None else args.rpc_latency_ms / 1e3,
        frontend_latency_s=None if args.frontend_latency_ms is None else args.frontend_latency_ms / 1e3,
        stream_interval_s=None if args.stream_interval_ms is None else args.stream_interval_ms / 1e3,
        deaths=deaths, sampling=sampling, seed=seed,
    )


def _death(text: str) -> InstanceDeath:
    match = re.fullmatch(r"([\w.-]+)@([0-9.]+)(?:\+([0-9.]+))?", text)
    if match is None:
        raise CliError(f"--kill: {text!r} is not ID@SECONDS[+RESTART_SECONDS]", EXIT_USAGE)
    return InstanceDeath(match.group(1), float(match.group(2)), float(match.group(3)) if match.group(3) else None)


def _trace_args(args: argparse.Namespace) -> Any:
    """The trace's requests and schedule, or None for a generated workload."""
    if args.workload != "trace":
        if args.trace is not None:
            raise CliError("--trace: only with --workload trace", EXIT_USAGE)
        return None
    if args.trace is None:
        raise CliError("--workload trace: needs --trace FILE", EXIT_USAGE)
    if args.rate is not None or args.concurrency is not None:
        raise CliError("--rate/--concurrency: a trace brings its own send times (--trace-time-scale speeds it up)", EXIT_USAGE)
    try:
        rows = read_trace(args.trace)
        return trace_workload(rows, seed=args.seed, time_scale=args.trace_time_scale, max_requests=args.num_requests)
    except WorkloadError as error:
        raise CliError(f"--trace: {error.message}", EXIT_USAGE) from None


def instance_text(outcome: SimOutcome) -> str:
    """Per role: utilisation (mean, min, max) and transfer volume; the busiest instances."""
    roles: dict[str, list] = {}
    for report in outcome.instances:
        roles.setdefault(report.role, []).append(report)
    rows = []
    for role, reports in sorted(roles.items()):
        utilisation = [r.utilisation for r in reports]
        rows.append([
            role, len(reports), sum(utilisation) / len(utilisation), min(utilisation), max(utilisation),
            sum(r.bytes_sent for r in reports) / 2**20, sum(r.bytes_received for r in reports) / 2**20,
            sum(r.transfers_sent for r in reports), sum(r.pauses for r in reports),
        ])
    headers = ["role", "instances", "util mean", "util min", "util max", "KV sent MiB", "KV recv MiB", "transfers", "pauses"]
    return (
        "\nSimulated instances (utilisation = stepping time / run time):\n" + render_table(headers, rows)
        + f"\nsimulated {outcome.virtual_s:.2f}s in {outcome.wall_s:.2f}s of wall time\n"
    )


def simulation_figures(outcomes: Sequence[SimOutcome], profile_name: str, link: str, *, per_instance: bool) -> dict[str, Any]:
    """Per point: utilisation by role, transfer volume, router counters (and every instance's
    figures for results.json)."""
    points = []
    for outcome in outcomes:
        point = outcome.summary()
        if per_instance:
            point["instances"] = [r.to_dict() for r in outcome.instances]
        points.append(point)
    return {"profile": profile_name, "link": link, "points": points}


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    traced = _trace_args(args)
    if traced is not None:
        args = argparse.Namespace(**{**vars(args), "workload": "fixed", "num_requests": len(traced[0])})
    settings: BenchSettings = settings_from_args(args)
    if traced is not None:
        settings = dataclasses.replace(settings, points=(traced[1],))
    dataset = None
    if settings.workload.dataset_path:
        try:
            dataset = load_sharegpt(settings.workload.dataset_path)
        except WorkloadError as error:
            raise CliError(f"--dataset: {error.message}", EXIT_USAGE) from None
    sim = sim_settings(args, dataclasses.replace(settings.sampling, timeout_s=None), settings.seed)
    config = profile_pool(cluster_config(args), sim.profile, "duet sim")
    try:
        check_deaths(config, sim.deaths)  # before any point runs, not when the first one starts
    except ValueError as error:
        raise CliError(f"--kill: {error}", EXIT_USAGE) from None
    results: list[PointResult] = []
    outcomes: list[SimOutcome] = []
    for position, point in enumerate(settings.points):
        seed = settings.seed + position
        requests = traced[0] if traced is not None else build_workload(settings.workload, seed, dataset)
        for message, count in pool_shortfalls(config, sim.profile, requests):
            if count == len(requests):
                raise CliError(f"the KV pool holds none of the workload's requests: {message}", EXIT_USAGE)
            print(f"duet sim: warning: {message}", file=sys.stderr, flush=True)
        if settings.progress:
            print(f"simulating {point.label}: {len(requests)} requests ...", file=sys.stderr, flush=True)
        try:
            outcome = simulate(config, dataclasses.replace(sim, seed=seed), requests, point, settings.slo)
        except ValueError as error:
            raise CliError(str(error), EXIT_USAGE) from None
        results.append(outcome.point)
        outcomes.append(outcome)
        if outcome.leaked_blocks or outcome.held_requests:  # every end path frees: this is a bug in duet
            print(
                f"duet sim: warning: {point.label}: once the instances settled they still held {outcome.held_requests} requests "
                f"and {outcome.leaked_blocks} KV blocks (a leak in duet; results.json has the figures)",
                file=sys.stderr, flush=True,
            )
        limited = request_limit_warning(config, outcome.request_limited_by_role)
        if limited:
            print(f"duet sim: warning: {point.label}: {limited}", file=sys.stderr, flush=True)
        refused = sum(refused_at_admission(record) for record in outcome.point.outcome.records)
        if refused:
            print(
                f"duet sim: warning: {point.label}: the router refused {refused} of {len(requests)} requests at its admission "
                f"limit (router.admission.max_queued_requests: {config.router.admission.max_queued_requests}): that limit, "
                "not the instances, capped this run; raise it in --config for a cluster this size",
                file=sys.stderr, flush=True,
            )
    description = {
        "simulated": [{"role": g.role.value, "count": g.count} for g in config.instances],
        "profile": sim.profile.name,
        "profile_source": sim.profile.source,
        "device": sim.profile.device,
        "model": sim.profile.model,
        "link": sim.link.plane,
    }
    text = "".join(instance_text(outcome) for outcome in outcomes)
    write_outputs(
        settings, results, description, bench_name=BENCH_NAME, extra_text=text,
        extra_figures={"simulation": simulation_figures(outcomes, sim.profile.name, sim.link.plane, per_instance=False)},
        extra_document={"simulation": simulation_figures(outcomes, sim.profile.name, sim.link.plane, per_instance=True)},
    )
    return EXIT_OK
