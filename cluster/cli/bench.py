"""`duet bench`: load a cluster through the gRPC client API and measure it as vLLM's `bench serve` does.

    duet bench --quick                                   # an embedded 1 PREFILL + 1 GENERATION cluster
    duet bench --target 10.0.0.5:50051 --workload shared-prefix --rate 1 2 4 8 --slo-ttft-ms 500
    duet bench --mixed 2 --workload multi-turn --turns 4 --concurrency 4 --out results/
    duet bench --target HOST:PORT --workload sharegpt --dataset ShareGPT_V3.json --num-requests 500
    duet bench --backend openai --target http://HOST:8000 --concurrency 1 8 32   # the OpenAI HTTP API

Without --target it starts an embedded cluster (the `duet serve` flags: --config, --prefill,
--generation, --mixed, --model, ...) on a free port and stops it afterwards. Several --rate (or
--concurrency) values are a sweep: one table row per value; each point draws its workload with
seed + its position, so no point hits prefix-cache entries another one left. Requests are greedy with
ignore_eos unless told otherwise, so output lengths are the workload's. Writes results.json
(settings, metrics per point, every request's timings) and PNG plots to --out (default
./bench-results/<timestamp>); the last stdout line is the benchmark JSON envelope
(`envelope` in cluster/loadgen/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cluster.cli.common import (
    EXIT_CODES,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    ConnectionWording,
    add_connection_options,
    add_log_level,
    client_options,
    load_cluster_config,
    rpc_failure,
    setup_logging,
    with_free_ports,
)
from cluster.client import AsyncDuetClient, DuetError
from cluster.deploy.config import ClusterConfig
from cluster.loadgen.arrivals import ArrivalError, Arrivals, FixedConcurrency, PoissonArrivals
from cluster.loadgen.metrics import Slo, SloError
from cluster.loadgen.plots import PlotsUnavailable, caption, plot_all
from cluster.loadgen.report import (
    TargetValue,
    envelope,
    render_detail,
    render_sweep,
    results_document,
    summary_figures,
    write_json,
)
from cluster.loadgen.runner import LoadRunner, PointResult, SamplingSpec, measure_point
from cluster.loadgen.workloads import (
    WARMUP_SEED_OFFSET,
    SharegptPair,
    WorkloadConfig,
    WorkloadError,
    WorkloadKind,
    build_workload,
    load_sharegpt,
    warmup_config,
)

logger = logging.getLogger(__name__)

BENCH_NAME = "duet_bench"

# Defaults for a full run, and for --quick (a few seconds of load, for CI smoke tests).
DEFAULTS = {
    "workload": "fixed", "input_len": 128, "output_len": 64, "num_requests": 100, "warmup": 4,
    "num_prefixes": 4, "prefix_len": 256, "suffixes_per_prefix": 8, "turns": 4, "rates": [math.inf],
}
QUICK_DEFAULTS = {
    "workload": "fixed", "input_len": 64, "output_len": 16, "num_requests": 12, "warmup": 2,
    "num_prefixes": 2, "prefix_len": 64, "suffixes_per_prefix": 4, "turns": 2, "rates": [4.0, 16.0],
}
# The connection flags share a help group with the embedded cluster's, in shorter words.
CONNECTION_WORDING = ConnectionWording(
    target_default=None,
    target_help="a running front end (default: embedded)",
    tls_ca_help="use TLS; verify the front end with this CA",
    tls_cert_help="client certificate for mutual TLS",
    tls_key_help="client key for mutual TLS",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="load the cluster and report TTFT / TPOT / ITL / throughput / goodput (vLLM's definitions)",
        description="Load a cluster through the gRPC client API (--target) or an embedded one started here; "
        "Poisson arrivals at --rate R (a sweep with several) or --concurrency C; prints a table per rate, "
        "writes results.json and PNG plots to --out, and ends stdout with the JSON envelope.",
    )
    target = parser.add_argument_group("cluster (a running one, or an embedded one started here)")
    add_connection_options(target, CONNECTION_WORDING)
    target.add_argument(
        "--backend", choices=("grpc", "openai"), default="grpc",
        help="the front end to load: gRPC (default; --target HOST:PORT) or the OpenAI HTTP API "
        "(--target http://HOST:PORT, streamed completions)",
    )
    target.add_argument("--config", metavar="FILE", help="embedded: cluster configuration (YAML)")
    target.add_argument("--address", default=None, metavar="ADDR", help="embedded: the Ray cluster to deploy on")
    target.add_argument("--model", default=None, metavar="DIR", help="embedded: a local Hugging Face checkpoint")
    target.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None, help="embedded: model and KV dtype")
    target.add_argument("--device", default=None, metavar="DEV", help="embedded: auto, cpu or cuda")
    for role in ("prefill", "generation", "mixed"):
        target.add_argument(f"--{role}", type=int, default=None, metavar="N", help=f"embedded: {role.upper()} instances")

    add_workload_options(parser)
    add_load_options(parser)
    output = add_output_options(parser)
    add_log_level(output, "WARNING")
    parser.set_defaults(handler=run)


def add_workload_options(parser: argparse.ArgumentParser, extra_kinds: tuple[str, ...] = ()) -> None:
    """The workload flags (shared with `duet sim` and `duet plan`, which add `extra_kinds`)."""
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--workload", choices=("fixed", "lognormal", "shared-prefix", "multi-turn", "sharegpt", *extra_kinds), default=None,
        help="what the requests look like (default: fixed)",
    )
    workload.add_argument("--dataset", default=None, metavar="FILE", help="a ShareGPT-format JSON file (--workload sharegpt)")
    workload.add_argument("--input-len", type=int, default=None, metavar="N",
                          help="prompt tokens (mean for lognormal; suffix for shared-prefix; per turn for multi-turn)")
    workload.add_argument("--output-len", type=int, default=None, metavar="N", help="output tokens (mean for lognormal)")
    workload.add_argument("--lognormal-sigma", type=float, default=0.5, metavar="S", help="sigma of log-normal lengths")
    workload.add_argument("--num-prefixes", type=int, default=None, metavar="N", help="shared-prefix: prefixes")
    workload.add_argument("--prefix-len", type=int, default=None, metavar="N", help="shared-prefix: prefix tokens")
    workload.add_argument("--suffixes-per-prefix", type=int, default=None, metavar="M", help="shared-prefix: requests per prefix")
    workload.add_argument("--turns", type=int, default=None, metavar="T", help="multi-turn: turns per conversation")
    workload.add_argument("--sharegpt-bytes-per-token", type=float, default=4.0, metavar="B",
                          help="sharegpt: UTF-8 bytes per token to estimate lengths (1 for the built-in byte model)")
    workload.add_argument("--num-requests", type=int, default=None, metavar="N",
                          help="requests per point (shared-prefix sends prefixes x suffixes)")


def add_load_options(parser: argparse.ArgumentParser) -> None:
    """The arrival, sampling and SLO flags (shared with `duet sim`)."""
    load = parser.add_argument_group("load")
    shape = load.add_mutually_exclusive_group()
    shape.add_argument("--rate", type=float, nargs="+", default=None, metavar="R",
                       help="Poisson request rates per second (inf: all at once); several = a sweep")
    shape.add_argument("--concurrency", type=int, nargs="+", default=None, metavar="C",
                       help="requests kept in flight instead of a rate; several = a sweep")
    load.add_argument("--burstiness", type=float, default=None, metavar="B", help="gamma shape: 1 Poisson (default), <1 burstier")
    load.add_argument("--warmup", type=int, default=None, metavar="N", help="unmeasured requests sent first")
    load.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (default)")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="generate exactly the workload's output length (default on)")
    load.add_argument("--request-timeout", type=float, default=300.0, metavar="S", help="each request's deadline")
    load.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS", help="goodput: TTFT objective")
    load.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS", help="goodput: TPOT objective")
    load.add_argument("--slo-e2e-ms", type=float, default=None, metavar="MS", help="goodput: end-to-end objective")
    load.add_argument("--seed", type=int, default=0, metavar="S", help="seeds workloads and arrival times")


def add_output_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The output flags (shared with `duet sim`); returns the group for more."""
    output = parser.add_argument_group("output")
    output.add_argument("--out", default=None, metavar="DIR", help="results.json and plots (default ./bench-results/<time>)")
    output.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    output.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    output.add_argument("--quick", action="store_true", help="a few seconds of load (CI smoke test)")
    return output


# ---- turning flags into typed settings --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    workload: WorkloadConfig
    points: tuple[Arrivals, ...]  # one per sweep point
    slo: Slo
    sampling: SamplingSpec
    warmup: int
    seed: int
    out_dir: Path
    plots: bool
    progress: bool

    def describe(self) -> dict[str, Any]:
        workload = dataclasses.asdict(self.workload)
        workload["kind"] = self.workload.kind.value
        return {
            "workload": workload,
            "points": [dataclasses.asdict(p) | {"label": p.label} for p in self.points],
            "slo": dataclasses.asdict(self.slo),
            "sampling": dataclasses.asdict(self.sampling),
            "warmup": self.warmup,
            "seed": self.seed,
        }


def _pick(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    if value is not None:
        return value
    return (QUICK_DEFAULTS if args.quick else DEFAULTS)[name]


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Validated settings; raises CliError (exit 2) naming the bad flag."""
    kind = WorkloadKind(_pick(args, "workload"))
    if args.dataset is not None and kind is not WorkloadKind.SHAREGPT:
        raise CliError("--dataset: only the sharegpt workload reads a dataset (add --workload sharegpt)", EXIT_USAGE)
    num_prefixes, suffixes = _pick(args, "num_prefixes"), _pick(args, "suffixes_per_prefix")
    if kind is WorkloadKind.SHARED_PREFIX and args.num_requests is not None and args.num_requests != num_prefixes * suffixes:
        raise CliError(
            f"--num-requests: the shared-prefix workload sends --num-prefixes x --suffixes-per-prefix = "
            f"{num_prefixes * suffixes} requests; leave --num-requests out or change those",
            EXIT_USAGE,
        )
    if args.concurrency is not None and args.burstiness is not None:
        raise CliError("--burstiness: shapes --rate arrivals; it has no effect with --concurrency", EXIT_USAGE)
    if args.warmup is not None and args.warmup < 0:
        raise CliError("--warmup: must be >= 0", EXIT_USAGE)
    try:
        workload = WorkloadConfig(
            kind=kind,
            num_requests=_pick(args, "num_requests"),
            input_len=_pick(args, "input_len"),
            output_len=_pick(args, "output_len"),
            lognormal_sigma=args.lognormal_sigma,
            num_prefixes=num_prefixes,
            prefix_len=_pick(args, "prefix_len"),
            suffixes_per_prefix=suffixes,
            turns=_pick(args, "turns"),
            dataset_path=args.dataset,
            sharegpt_bytes_per_token=args.sharegpt_bytes_per_token,
        )
        if args.concurrency is not None:
            points: tuple[Arrivals, ...] = tuple(FixedConcurrency(c) for c in args.concurrency)
        else:
            rates = args.rate if args.rate is not None else _pick(args, "rates")
            burstiness = args.burstiness if args.burstiness is not None else 1.0
            points = tuple(PoissonArrivals(rate, burstiness) for rate in rates)
        slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    except WorkloadError as error:
        flag = "--dataset" if error.field.startswith("dataset") else f"--{error.field.replace('_', '-')}"
        raise CliError(f"{flag}: {error.message}", EXIT_USAGE) from None
    except ArrivalError as error:
        flag = {"rate_per_s": "--rate", "burstiness": "--burstiness", "concurrency": "--concurrency"}.get(error.field, error.field)
        raise CliError(f"{flag}: {error.message}", EXIT_USAGE) from None
    except SloError as error:
        raise CliError(f"--slo-{error.field.removesuffix('_ms')}-ms: {error.message}", EXIT_USAGE) from None
    if not args.request_timeout > 0:
        raise CliError("--request-timeout: must be a positive number of seconds", EXIT_USAGE)
    out_dir = Path(args.out) if args.out else Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    return BenchSettings(
        workload=workload,
        points=points,
        slo=slo,
        sampling=SamplingSpec(temperature=args.temperature, ignore_eos=args.ignore_eos, timeout_s=args.request_timeout),
        warmup=_pick(args, "warmup"),
        seed=args.seed,
        out_dir=out_dir,
        plots=not args.no_plots,
        progress=not args.no_progress,
    )


# ---- running ----------------------------------------------------------------------------------


def _client(target: str, client_options: dict[str, Any], backend: str) -> Any:
    if backend == "openai":
        from cluster.loadgen.openai_client import OpenAIClient

        if client_options.get("tls") is not None:
            raise CliError("--tls-*: the openai backend takes an https:// --target and the system's CAs", EXIT_USAGE)
        try:
            return OpenAIClient(target, token=client_options.get("token"))
        except ValueError as error:
            raise CliError(str(error), EXIT_USAGE) from None
    return AsyncDuetClient(target, **client_options)


async def run_points(
    target: str,
    client_options: dict[str, Any],
    settings: BenchSettings,
    dataset: Sequence[SharegptPair] | None,
    backend: str = "grpc",
) -> list[PointResult]:
    """Warm up, then measure every sweep point in turn; returns their PointResults."""
    results = []
    try:
        opened = _client(target, client_options, backend)
        client = await opened.__aenter__()
    except DuetError as error:
        raise rpc_failure(error, target) from None
    try:
        try:
            if not await client.health():
                logger.warning("the front end at %s reports NOT_SERVING", target)
        except DuetError as error:
            raise rpc_failure(error, target) from None
        runner = LoadRunner(client, settings.sampling)
        if settings.warmup:
            warm = build_workload(warmup_config(settings.workload, settings.warmup), settings.seed + WARMUP_SEED_OFFSET, dataset)
            _progress(settings, f"warm-up: {len(warm)} requests")
            records = await runner.warmup(warm)
            failed = [r for r in records if not r.ok]
            if failed:
                logger.warning("warm-up: %d of %d requests failed (first: %s)", len(failed), len(records), failed[0].error)
        for position, point in enumerate(settings.points):
            seed = settings.seed + position
            requests = build_workload(settings.workload, seed, dataset)
            bar = _bar(settings, len(requests), point.label)
            runner = LoadRunner(client, settings.sampling, on_done=lambda _record, bar=bar: bar.update(1))
            try:
                result = await measure_point(runner, requests, point, seed=seed, slo=settings.slo)
            finally:
                bar.close()
            results.append(result)
            m = result.metrics
            _progress(
                settings,
                f"{point.label}: {m.completed}/{m.num_requests} done in {m.duration_s:.1f}s, "
                f"{m.request_throughput_rps:.2f} req/s, {m.output_throughput_tps:.1f} tok/s",
            )
    finally:
        await opened.__aexit__(None, None, None)
    return results


def _progress(settings: BenchSettings, message: str) -> None:
    if settings.progress:
        print(message, file=sys.stderr, flush=True)


def _bar(settings: BenchSettings, total: int, label: str) -> Any:
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, disable=not settings.progress, leave=False)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _embedded_config(args: argparse.Namespace) -> ClusterConfig:
    return with_free_ports(load_cluster_config(args))


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    settings = settings_from_args(args)
    dataset = None
    if settings.workload.dataset_path:
        try:
            dataset = load_sharegpt(settings.workload.dataset_path)
        except WorkloadError as error:
            raise CliError(f"--dataset: {error.message}", EXIT_USAGE) from None
    embedded_flags = [f for f in ("config", "address", "model", "dtype", "device", "prefill", "generation", "mixed") if getattr(args, f) is not None]
    if args.target is not None and embedded_flags:
        raise CliError(f"--{embedded_flags[0]}: configures an embedded cluster; it has no effect with --target", EXIT_USAGE)
    if args.target is not None:
        results = asyncio.run(run_points(args.target, client_options(args), settings, dataset, args.backend))
        cluster_description: dict[str, Any] = {"target": args.target, "backend": args.backend}
    else:
        # The router/deploy stack is imported only for an embedded cluster, so that every `duet` start stays fast.
        from cluster.deploy.embedded import BackgroundCluster
        from cluster.deploy.launch import DeploymentError

        config = _embedded_config(args)
        if args.backend == "openai":
            config = dataclasses.replace(config, frontend=dataclasses.replace(config.frontend, http_port=_free_port()))
        _progress(settings, "starting an embedded cluster ...")
        started_s = time.monotonic()
        try:
            cluster = BackgroundCluster(config).start()
        except DeploymentError as error:
            raise CliError(f"the embedded cluster did not start: {error}", EXIT_CODES["UNAVAILABLE"]) from None
        try:
            _progress(settings, f"serving on {cluster.target} ({time.monotonic() - started_s:.1f}s to start)")
            target = cluster.cluster.http_url if args.backend == "openai" else cluster.target
            if not target:
                raise CliError("the embedded cluster's OpenAI API did not start", EXIT_CODES["UNAVAILABLE"])
            results = asyncio.run(run_points(target, {}, settings, dataset, args.backend))
        finally:
            cluster.stop()
        cluster_description = {
            "embedded": [
                {"role": g.role.value, "count": g.count, "num_cpus": g.num_cpus, "torch_threads": g.torch_threads}
                for g in config.instances
            ],
            "dtype": config.dtype,
            "device": config.device,
            "model": config.model or "built-in",
            "backend": args.backend,
        }
    write_outputs(settings, results, cluster_description)
    return EXIT_OK


def _workload_words(settings: BenchSettings) -> str:
    workload = settings.workload
    return f"{workload.kind.value} ({workload.input_len} in / {workload.output_len} out, {workload.num_requests} requests)"


def _target_words(cluster_description: dict[str, Any]) -> str:
    if "target" in cluster_description:
        return str(cluster_description["target"])
    groups = ", ".join(f"{g['count']} {g['role']}" for g in cluster_description.get("embedded", ()))
    return f"embedded ({groups}; {cluster_description.get('model')}, {cluster_description.get('dtype')})"


def write_outputs(
    settings: BenchSettings,
    results: Sequence[PointResult],
    cluster_description: dict[str, Any],
    *,
    bench_name: str = BENCH_NAME,
    extra_text: str = "",
    extra_figures: dict[str, Any] | None = None,
    extra_document: dict[str, Any] | None = None,
) -> None:
    """Plots, results.json, the table, and the envelope as the very last stdout line. `duet sim`
    adds its per-instance text and figures (`extra_*`)."""
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    plots: list[str] = []
    if settings.plots:
        try:
            text = caption(_workload_words(settings), _target_words(cluster_description))
            plots = [str(path) for path in plot_all(results, settings.out_dir, text)]
        except PlotsUnavailable as error:
            print(f"duet bench: plots skipped: {error}", file=sys.stderr)
    document = results_document(settings.describe() | {"cluster": cluster_description}, results, plots)
    document.update(extra_document or {})
    results_path = write_json(settings.out_dir / "results.json", document)
    if len(results) == 1:
        sys.stdout.write(render_detail(results[0].arrivals.label, results[0].metrics))
        sys.stdout.write("\n")
    sys.stdout.write(render_sweep(results))
    sys.stdout.write(extra_text)
    sys.stdout.write(f"\nresults: {results_path}\n")
    for path in plots:
        sys.stdout.write(f"plot: {path}\n")
    total = sum(r.metrics.num_requests for r in results)
    completed = sum(r.metrics.completed for r in results)
    figures = {
        "workload": settings.workload.kind.value,
        "points": {r.arrivals.label: summary_figures(r.metrics) for r in results},
        "results": str(results_path),
        **(extra_figures or {}),
    }
    targets = {"completed_fraction": TargetValue(completed / total if total else 0.0, 1.0, higher_is_better=True)}
    sys.stdout.write(envelope(bench_name, figures, targets) + "\n")
    sys.stdout.flush()

