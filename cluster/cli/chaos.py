"""`duet chaos`: the chaos soak as a command (cluster/loadgen/chaos.py does the work).

    duet chaos                                   # 1,000 requests, 5 % faulty transfers, kills
    duet chaos --requests 300 --seed 7 --fault-rate 0.1 --kill-every 50 --json-out soak.json
    duet chaos --address ray://head:10001 --model /models/llama

Prints a progress bar on stderr, then the report table and, as the very last stdout line, the
benchmark JSON object (`SoakReport.json_line`). Exit status: 0 when lost, leaked blocks, token mismatches and illegal
transitions are all 0; 10 when one of them is not; 2 for a bad command line; 3 when the clusters
cannot be deployed. `main` is the same command on its own (bench/chaos_soak.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from cluster.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    add_log_level,
    add_old_spelling,
    run_handler,
    setup_logging,
)
from cluster.loadgen.chaos_plan import SoakConfig, SoakConfigError, SoakError
from cluster.router.config import ConfigError

EXIT_DEPLOY = 3
EXIT_INVARIANT_BROKEN = 10


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `chaos` subcommand (and its handler) to a `duet` subparsers object."""
    parser = subparsers.add_parser(
        "chaos",
        help="soak a P/D cluster with KV transfer faults and instance kills; check nothing is lost",
        description="Deploy a faulty cluster (PREFILL + GENERATION, a seeded fault plan on the KV "
        "transfers, instance kills) and a clean one on the same Ray cluster; send seeded requests; "
        "report lost requests, leaked blocks, token mismatches against a fault-free replay and "
        "illegal transitions (all must be 0: exit status 0), failures by status and the extra latency "
        "of recovered requests.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SoakConfig()
    parser.add_argument(
        "--num-requests", dest="requests", type=int, default=defaults.requests, metavar="N",
        help=f"requests to send ({defaults.requests})",
    )
    add_old_spelling(parser, "--requests", "--num-requests", "requests", type=int)
    parser.add_argument("--seed", type=int, default=defaults.seed, metavar="S", help="seed of the workload, the fault plan and the kills")
    parser.add_argument(
        "--fault-rate", type=float, default=defaults.fault_rate, metavar="F",
        help=f"fraction of KV transfers that draw a fault ({defaults.fault_rate:g})",
    )
    parser.add_argument(
        "--kill-every", type=int, default=defaults.kill_every, metavar="K",
        help=f"kill an instance after every K submitted requests; 0 never ({defaults.kill_every})",
    )
    parser.add_argument("--prefill", type=int, default=defaults.prefill, metavar="N", help=f"PREFILL instances ({defaults.prefill})")
    parser.add_argument(
        "--generation", type=int, default=defaults.generation, metavar="N", help=f"GENERATION instances ({defaults.generation})"
    )
    parser.add_argument(
        "--concurrency", type=int, default=defaults.concurrency, metavar="N", help=f"requests in flight at most ({defaults.concurrency})"
    )
    parser.add_argument(
        "--kill-only-role", dest="kill_role", choices=("prefill", "generation"), default=None,
        help="kill only instances of this role (with --prefill 1 or --generation 1: the only one, which requests wait for)",
    )
    parser.add_argument(
        "--address", default=None, metavar="ADDR",
        help="the Ray cluster to join (default: an embedded local one; $RAY_ADDRESS is honoured)",
    )
    parser.add_argument(
        "--data-plane", default=defaults.data_plane, choices=("auto", "grpc", "shm"),
        help=f"what carries the KV bytes between instances (kv_transfer.data_plane; {defaults.data_plane}): "
        "shared memory on one host, or gRPC streams",
    )
    parser.add_argument(
        "--stream-interval-ms", type=float, default=defaults.stream_interval_ms, metavar="MS",
        help="the faulty cluster's instances report a request's tokens in groups of up to MS (engine.stream_interval_ms; "
        f"{defaults.stream_interval_ms:g}: every step)",
    )
    parser.add_argument("--model", default=None, metavar="DIR", help="a local Hugging Face checkpoint (default: the built-in tiny model)")
    parser.add_argument("--dtype", default=defaults.dtype, choices=("auto", "float32", "bfloat16", "float16"), help="model and KV dtype")
    parser.add_argument("--device", default=defaults.device, metavar="DEV", help="auto, cpu or cuda")
    parser.add_argument(
        "--lost-after", type=float, default=defaults.lost_after_s, metavar="S",
        help=f"an accepted request without a final event after S seconds is lost ({defaults.lost_after_s:g})",
    )
    parser.add_argument("--out", default=None, metavar="DIR", help="also write the JSON object to DIR/results.json (default: stdout only)")
    add_old_spelling(parser, "--json-out", "--out", "json_out", metavar="FILE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_log_level(parser, "ERROR")


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    """The SoakConfig of parsed arguments; raises CliError (exit 2) for bad values."""
    try:
        return SoakConfig(
            requests=args.requests,
            seed=args.seed,
            fault_rate=args.fault_rate,
            kill_every=args.kill_every,
            prefill=args.prefill,
            generation=args.generation,
            concurrency=args.concurrency,
            kill_role=args.kill_role,
            address=args.address,
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            lost_after_s=args.lost_after,
            data_plane=args.data_plane,
            stream_interval_ms=args.stream_interval_ms,
        )
    except SoakConfigError as error:
        raise CliError(f"--{error.field.replace('_', '-').removesuffix('-s')}: {error.message}", EXIT_USAGE) from None


def run(args: argparse.Namespace) -> int:
    # The soak runner deploys clusters (the router/deploy stack, Ray): imported when the soak runs,
    # so that every `duet` start stays fast.
    from cluster.loadgen.chaos import run_soak

    setup_logging(args.log_level)
    config = config_from_args(args)
    try:
        report = run_soak(config, show_progress=not args.no_progress)
    except ConfigError as error:
        raise CliError(f"bad configuration: {error}", EXIT_USAGE) from None
    except SoakError as error:
        raise CliError(str(error), EXIT_DEPLOY) from None
    line = report.json_line()
    out_file, flag = _out_file(args)
    if out_file is not None:
        try:
            if flag == "--out":
                os.makedirs(args.out, exist_ok=True)
            with open(out_file, "w", encoding="utf-8") as handle:
                handle.write(line + "\n")
        except OSError as error:
            raise CliError(f"{flag}: cannot write {out_file}: {error.strerror}", EXIT_USAGE) from None
    sys.stdout.write(report.table())
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return EXIT_OK if report.ok else EXIT_INVARIANT_BROKEN


def _out_file(args: argparse.Namespace) -> tuple[str | None, str]:
    """Where the JSON object goes: DIR/results.json (--out DIR, as `duet bench`), or the FILE of the
    old spelling --json-out."""
    if getattr(args, "json_out", None):
        return args.json_out, "--json-out"
    if args.out:
        return os.path.join(args.out, "results.json"), "--out"
    return None, "--out"


def main(argv: Sequence[str] | None = None, *, prog: str = "duet chaos") -> int:
    """`duet chaos` on its own (bench/chaos_soak.py uses it): the same arguments and exit statuses."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_handler(run, parser.parse_args(argv), prog)
