"""`duet profile`: measure this machine's engine into a step-time profile, or estimate one for a GPU.

    duet profile --out cpu.json                           # the built-in model, on this device
    duet profile --bench-model --threads 1 --out cpu-bench8.json
    duet profile --model /models/llama --device cuda --dtype bfloat16 --out h100-llama.json
    duet profile --roofline h100-sxm:llama-3-8b --out h100-8b.json   # an estimate, not a measurement
    duet profile --deployed --out cpu-builtin-deployed.json   # as a served 1P+1G cluster runs (cluster/sim/deployed.py)
    duet profile --deployed --topology 2mixed --out cpu-builtin-deployed-2mixed.json
    duet profile --deployed --config cluster.yaml --out mine.json

The measuring side is worker/profiler.py (imported only when measuring: it needs torch); the
profile format and the roofline are cluster/sim/profile.py and cluster/sim/roofline.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cluster.cli.common import EXIT_OK, EXIT_USAGE, CliError, add_log_level, setup_logging
from cluster.sim.profile import ProfileError, StepProfile
from cluster.sim.roofline import DEVICES, MODELS, roofline_profile_from_spec


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure this machine's engine (or estimate a GPU's) into a step-time profile for duet sim",
        description="Measure prefill and decode step times, the per-step overhead, the hand-over control path and "
        "KV bytes per token of the local engine, fit the step-time model, and write a profile JSON "
        "(cluster/sim/profile.py). --roofline writes an analytical estimate instead.",
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the profile JSON")
    parser.add_argument("--name", default=None, help="the profile's name (default: the file's stem)")
    parser.add_argument("--model", default=None, metavar="DIR", help="a local Hugging Face checkpoint (default: built-in)")
    parser.add_argument("--bench-model", action="store_true", help="the 8-layer, hidden-512 bench model (bench/engine_bench.py)")
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"), help="model and KV dtype")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (an instance's torch_threads)")
    parser.add_argument("--quick", action="store_true", help="a few shapes only (a smoke test)")
    parser.add_argument(
        "--roofline", default=None, metavar="DEVICE:MODEL",
        help=f"estimate instead of measuring; devices: {', '.join(DEVICES)}; models: {', '.join(MODELS)}",
    )
    parser.add_argument(
        "--deployed", action="store_true",
        help="measure as deployed: serve a calibration load on a real cluster (--config, default 1P+1G as "
        "bench/sim_validation.py runs it) and fit the instances' own logged steps, Ray call, front end and hand-over costs",
    )
    parser.add_argument("--config", default=None, metavar="YAML", help="the cluster --deployed deploys (duet serve's YAML)")
    parser.add_argument(
        "--topology", default="1p1g", choices=("1p1g", "2mixed"),
        help="without --config: which of bench/sim_validation.py's clusters --deployed deploys",
    )
    add_log_level(parser, "WARNING")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    out = Path(args.out)
    name = args.name or out.stem
    if args.roofline is not None:
        try:
            profile = roofline_profile_from_spec(f"roofline:{args.roofline}")
        except ProfileError as error:
            raise CliError(f"--roofline: {error}", EXIT_USAGE) from None
        profile.write(out)
        print(f"wrote {out} (an analytical estimate: cluster/sim/roofline.py)")
        return EXIT_OK
    if args.deployed:
        return _run_deployed(args, out, name)
    import torch

    from worker.default_model import BENCH_SEED, bench_model_config, build_default_model, build_random_model
    from worker.profiler import ProfilePlan, profile_document

    torch.set_num_threads(args.threads)
    if args.model is not None:
        from worker.loader import load_model

        model, tokenizer, _ = load_model(args.model, args.dtype, args.device)
        model_name = Path(args.model).name
    else:
        model, tokenizer, _ = build_default_model(args.dtype, args.device)
        model_name = "builtin"
        if args.bench_model:
            model = build_random_model(bench_model_config(), BENCH_SEED, dtype=model.dtype, device=model.device)
            model_name = "bench-8L-512"
    plan = ProfilePlan.quick() if args.quick else ProfilePlan()
    document = profile_document(
        model, tokenizer, name=name, model_name=model_name, plan=plan,
        progress=lambda message: print(message, file=sys.stderr, flush=True),
    )
    return _write_profile(document, out)  # the cluster side's own check of what was measured


def _run_deployed(args: argparse.Namespace, out: Path, name: str) -> int:
    from cluster.deploy.config import ClusterConfig
    from cluster.router.config import ConfigError
    from cluster.sim.deployed import default_config, measure_deployed

    config = default_config(args.topology)
    if args.config is not None:
        try:
            config = ClusterConfig.from_yaml(args.config)
        except (ConfigError, OSError) as error:
            raise CliError(f"--config: {error}", EXIT_USAGE) from None
    document = measure_deployed(config, name=name, quick=args.quick, progress=lambda message: print(message, file=sys.stderr, flush=True))
    return _write_profile(document, out)


def _write_profile(document: dict, out: Path) -> int:
    """Check a measured profile (`StepProfile.from_dict`), write it, print it without its fit's
    samples."""
    profile = StepProfile.from_dict(document)
    profile.write(out)
    fit = document["fit"]
    print(json.dumps({k: v for k, v in document.items() if k != "fit"} | {
        "median_relative_error": round(fit["median_relative_error"], 4), "samples": fit["samples"]}, indent=2))
    print(f"wrote {out}")
    return EXIT_OK
