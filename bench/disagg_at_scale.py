"""Where disaggregation pays at scale: goodput per GPU of disaggregated against colocated serving, 16
simulated H100-class instances of an 8B Llama-family model, a prefill-heavy and a decode-heavy mix.

For each mix, `duet plan` (cluster/sim/plan.py: the real router and schedulers on a virtual clock)
searches all MIXED and every P:D split of 16 instances under least_loaded placement for the highest
Poisson rate at which 90 % of requests meet TTFT <= 1 s and TPOT <= 50 ms, each probe sending
duet plan's window of arrivals (3 lives of a request, at least 30 s: 30 s prefill-heavy, 156 s
decode-heavy, whose requests live ~52 s at the TPOT bound). The colocated baseline
(16 MIXED) and the best split are searched side by side in the same run, on the same requests. The
step times are the roofline estimate of an H100 SXM running Llama 3 8B (cluster/sim/roofline.py: an
estimate, not a measurement), with the hand-over's control path replaced by the delay the real
system adds between the first and the second token (`--handover-ms`; 7.7 ms is what
`bench/handover_latency.py` measured on the 2-core development machine over gRPC, 2026-12-01), and
the KV moving over a 400 Gb/s RDMA-class link; instances report tokens every 50 ms at most. The KV pool is H100-sized (20,000 blocks of 16 tokens:
320,000 tokens, 40 GiB of an 8B model's KV), up to 8,192 tokens per step and 256 requests per instance,
and the router admits 16,384 requests in flight (the defaults, 64 and 1,024, would cap every split
before the GPUs do).

Figures per mix: `<mix>_colocated_goodput_per_gpu`, `<mix>_best_split`, `<mix>_best_goodput_per_gpu`,
`<mix>_disagg_ratio` (best disaggregated split / all MIXED, the colocated baseline); the plot
(`disagg_at_scale.png` in --out) shows goodput per GPU against the split for both mixes.

    python bench/disagg_at_scale.py [--quick] [--mix prefill_heavy decode_heavy] [--handover-ms 7.7] [--duration S] [--out DIR]
                                    [--splits P [P ...]] [--jobs N]

`--splits` limits the search to some P:D splits (all MIXED is always searched): the best is then the
best of those, and the table says which were searched.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit_result, print_table, progress  # noqa: E402

BENCH = "disagg_at_scale"
INSTANCES = 16
# (name, prompt tokens, output tokens)
MIXES = (("prefill_heavy", 2048, 128), ("decode_heavy", 256, 1024))
SLO_TTFT_MS, SLO_TPOT_MS = 1000.0, 50.0
CLUSTER_YAML = (
    # 256 requests and sequences per instance (vLLM's max_num_seqs): the engine's default of 64
    # requests in flight, not the GPU, would otherwise cap decode-heavy near 6 req/s per instance.
    "engine: {num_blocks: 20000, max_num_tokens: 8192, max_batch_size: 256, max_num_requests: 256}\n"
    # The router admits 1,024 requests in flight by default, which a 16-GPU cluster of long
    # outputs exceeds (decode-heavy holds ~1,400 at 128 req/s): the limit, not the GPUs, would
    # then cap every split alike. A deployment this size raises it the same way.
    "router: {admission: {max_queued_requests: 16384}}\n"
)
ROOFLINE = "h100-sxm:llama-3-8b"
LINK = "rdma-400g"
# Instances merge a request's tokens for up to 50 ms before reporting them (vLLM's stream_interval):
# TTFT, TPOT and every router decision stay exact (cluster/sim/instance.py), and a decode-heavy
# simulation passes a third of the messages.
STREAM_INTERVAL_MS = 50


def _profile(handover_ms: float, directory: Path) -> Path:
    """The roofline profile with the measured hand-over delay in place of its assumed control path."""
    from cluster.cli.main import main

    path = directory / "roofline.json"
    with contextlib.redirect_stdout(io.StringIO()):
        if main(["profile", "--roofline", ROOFLINE, "--out", str(path)]) != 0:
            raise SystemExit("duet profile --roofline failed")
    profile = json.loads(path.read_text())
    profile["handover_fixed_s"] = handover_ms / 1e3
    profile["name"] = f"{profile['name']}-handover-{handover_ms:g}ms"
    profile["notes"] += f"; handover_fixed_s set to the measured {handover_ms:g} ms"
    path.write_text(json.dumps(profile, indent=1) + "\n")
    return path


def _plan(mix: str, prompt_tokens: int, output_tokens: int, args: argparse.Namespace, profile: Path, config: Path, out: Path) -> dict:
    from cluster.cli.main import main

    command = [
        "plan", "--config", str(config), "--profile", str(profile), "--link", LINK, "--workload", "fixed",
        "--input-len", str(prompt_tokens), "--output-len", str(output_tokens), "--num-requests", str(args.num_requests),
        "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms", str(SLO_TPOT_MS), "--instances", str(args.instances),
        "--policies", "least_loaded", *(["--duration", str(args.duration)] if args.duration else []),
        "--stream-interval-ms", str(STREAM_INTERVAL_MS),
        *(["--splits", *map(str, args.splits)] if args.splits else []),
        *(["--jobs", str(args.jobs)] if args.jobs else []),
        "--no-plots", "--log-level", "ERROR", "--out", str(out / mix),
    ]
    done = out / mix / "plan.json"
    if args.reuse and done.exists():
        return json.loads(done.read_text())
    with contextlib.redirect_stdout(io.StringIO()):
        if main(command) != 0:
            raise SystemExit(f"duet plan failed for {mix}: {' '.join(command)}")
    return json.loads(done.read_text())


def _split(label: str) -> int:
    """Prefill instances of a candidate label ("16 MIXED least_loaded": 0, "9P:7D least_loaded": 9)."""
    head = label.split()[0]
    return 0 if "MIXED" in label else int(head.split("P:")[0])


def _plot(results: dict[str, dict], instances: int, path: Path) -> Path:
    from cluster.loadgen.plots import _pyplot, save_figure

    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 4))
    for mix, document in results.items():
        searched = sorted((_split(label), value) for label, value in document["candidates"].items() if value is not None)
        below = sorted((_split(label), rate / instances) for label, rate in document["below_best"].items())
        line = axis.plot([p for p, _ in searched if p], [v for p, v in searched if p], "o-", label=f"{mix}: P:D split")
        color = line[0].get_color()
        axis.plot([p for p, _ in below], [v for _, v in below], "v", color=color, alpha=0.5, label=f"{mix}: below this (the best so far; not searched further)")
        colocated = next((v for p, v in searched if p == 0), None)
        if colocated is not None:
            axis.axhline(colocated, color=color, linestyle="--", linewidth=1, label=f"{mix}: all MIXED")
    axis.set_xticks(range(1, instances))
    axis.set_xticklabels([f"{p}:{instances - p}" for p in range(1, instances)], fontsize=7)
    axis.set_xlabel("prefill : generation instances")
    axis.set_ylabel("goodput per GPU (req/s)")
    axis.set_ylim(bottom=0)
    axis.set_title(f"{instances} x H100 (roofline), Llama 3 8B, TTFT <= 1 s and TPOT <= 50 ms for 90 %", fontsize=9)
    axis.legend(fontsize=7)
    return save_figure(figure, path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 instances, 1 s windows, 40 requests, lengths / 8 (a smoke run: no result)")
    parser.add_argument("--handover-ms", type=float, default=7.7, help="the hand-over's added delay, measured (default 7.7)")
    parser.add_argument("--duration", type=float, default=None,
                        help="simulated seconds of arrivals per probe (default: duet plan's, 3 lives of a request and at least 30)")
    parser.add_argument("--mix", nargs="+", choices=[name for name, *_ in MIXES], default=[name for name, *_ in MIXES])
    parser.add_argument("--num-requests", type=int, default=400, help="the workload's pool (probes continue it with copies)")
    parser.add_argument("--out", default=None, help="where plans and the plot go (default: a temporary directory)")
    parser.add_argument("--reuse", action="store_true", help="take a mix's plan from --out when it is there (replot, or resume)")
    parser.add_argument("--splits", type=int, nargs="+", default=None, metavar="P",
                        help="search only these splits by prefill instances (0, all MIXED, is always searched: it is the baseline); "
                        "default: every one")
    parser.add_argument("--jobs", type=int, default=None, help="candidates searched at once (duet plan --jobs; default: the CPUs)")
    args = parser.parse_args()
    if args.splits is not None and 0 not in args.splits:
        args.splits = [0, *args.splits]
    args.instances = 2 if args.quick else INSTANCES
    if args.quick:
        args.duration = args.duration or 1.0
    if args.quick:
        args.num_requests = min(args.num_requests, 40)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="disagg-at-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    config = out / "cluster.yaml"
    config.write_text(CLUSTER_YAML)
    profile = _profile(args.handover_ms, out)
    results: dict[str, dict] = {}
    rows, figures = [], {}
    # The quick run's lengths are an eighth of the mixes' (a 1,024-token output is most of its cost).
    scale = 8 if args.quick else 1
    mixes = [(mix, prompt // scale, output // scale) for mix, prompt, output in MIXES if mix in args.mix]
    for index, (mix, prompt_tokens, output_tokens) in enumerate(mixes):
        progress(f"{BENCH}: {mix} ({prompt_tokens} / {output_tokens} tokens), {args.instances} instances: duet plan ({index + 1}/{len(mixes)})")
        document = _plan(mix, prompt_tokens, output_tokens, args, profile, config, out)
        results[mix] = document
        candidates = document["candidates"]
        colocated = next(value for label, value in candidates.items() if "MIXED" in label)
        splits = {label: value for label, value in candidates.items() if "MIXED" not in label and value is not None}
        best_label = max(splits, key=splits.get) if splits else None
        best_value = splits[best_label] if best_label else 0.0
        ratio = best_value / colocated if colocated else None
        rows.append([mix, f"{prompt_tokens} / {output_tokens}", document["window_s"], colocated, best_label or "(every split below all MIXED)", best_value,
                     round(ratio, 3) if ratio is not None else "-", document["simulations"], document["wall_s"]])
        figures.update({
            f"{mix}_colocated_goodput_per_gpu": colocated,
            f"{mix}_best_split": best_label,
            f"{mix}_best_goodput_per_gpu": best_value,
            f"{mix}_disagg_ratio": None if ratio is None else round(ratio, 4),
            f"{mix}_at_least": document["at_least"],
            f"{mix}_window_s": document["window_s"],
            f"{mix}_splits_searched": document.get("splits", "all"),
        })
    print_table(["mix", "prompt / output", "window s", "all MIXED req/s/GPU", "best split", "its req/s/GPU", "split / MIXED", "simulations", "wall s"], rows)
    if args.splits:
        print(f"splits searched (prefill instances; 0 = all MIXED): {sorted(set(args.splits))}")
    plot = _plot(results, args.instances, out / "disagg_at_scale.png")
    print(f"plot: {plot}")
    figures.update({"instances": args.instances, "handover_ms": args.handover_ms, "plot": str(plot)})
    emit_result(BENCH, figures, {})  # no target: the figures are the result the issue asks for
    return 0


if __name__ == "__main__":
    sys.exit(main())
