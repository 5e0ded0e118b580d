"""Prefill placement policies side by side: round robin, least-loaded, KV-aware.

Three clusters of 2 PREFILL + 1 GENERATION (0.2 CPU and 1 torch thread per instance, so all nine
instances fit on a 2-core box; the built-in tiny model, fp32, prefix reuse on) that differ only in
router.placement.prefill_policy. They run at once; the same seeded workloads go to each through
the gRPC client API, interleaved in rounds that rotate which policy goes first
(cluster/loadgen/sidebyside.py). Workloads:

- shared-prefix: N prefixes x M suffixes, shuffled, Poisson arrivals;
- multi-turn: conversations whose every turn resends the history (previous prompt + output).

Reported per workload and policy: prefix-cache hit rate (cached prompt tokens / prompt tokens),
TTFT p50/p99, request throughput, and ratios against round robin. Targets: KV-aware's hit rate
above round robin's (by at least 0.01) on both workloads.

    python bench/placement_policies.py [--quick] [--rounds N] [--seed S]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from cluster.deploy.config import ClusterConfig  # noqa: E402
from cluster.loadgen.arrivals import PoissonArrivals  # noqa: E402
from cluster.loadgen.report import summary_figures  # noqa: E402
from cluster.loadgen.runner import PointResult  # noqa: E402
from cluster.loadgen.sidebyside import (  # noqa: E402
    Scenario,
    Variant,
    compare,
    ray_session,
    start_clusters,
    stop_clusters,
    warm_up,
)
from cluster.loadgen.workloads import WorkloadConfig, WorkloadKind  # noqa: E402

BENCH = "placement_policies"
POLICIES = ("round_robin", "least_loaded", "kv_aware")
RAY_NUM_CPUS = 2
NUM_CPUS_PER_INSTANCE = 0.2
MIN_HIT_RATE_GAIN = 0.01
ENGINE = {
    "num_blocks": 512,
    "tokens_per_block": 16,
    "chunk_unit_tokens": 64,
    "max_num_tokens": 256,
    "max_num_requests": 32,
    "max_batch_size": 32,
    "enable_prefix_reuse": True,
}


def cluster_config(policy: str, seed: int) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "dtype": "float32",
            "device": "cpu",
            "instances": [
                {"role": "PREFILL", "count": 2, "num_cpus": NUM_CPUS_PER_INSTANCE, "torch_threads": 1},
                {"role": "GENERATION", "count": 1, "num_cpus": NUM_CPUS_PER_INSTANCE, "torch_threads": 1},
            ],
            "engine": dict(ENGINE),
            "router": {"placement": {"prefill_policy": {"name": policy}}},
            "frontend": {"port": 0, "metrics_port": None, "http_port": 0},
            # Logical CPUs for an embedded Ray: every instance of every variant fits whatever the box.
            "ray": {"num_cpus": RAY_NUM_CPUS},
            "seed": seed,
        }
    )


def scenarios(quick: bool) -> list[Scenario]:
    # Many prefixes with few suffixes each: with few prefixes and a roomy cache, every policy soon
    # has every prefix cached on every instance and only the first touches differ.
    if quick:
        shared = WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, num_prefixes=4, suffixes_per_prefix=3, prefix_len=192, input_len=16, output_len=4)
        turns = WorkloadConfig(kind=WorkloadKind.MULTI_TURN, num_requests=12, turns=3, input_len=48, output_len=8)
    else:
        shared = WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, num_prefixes=12, suffixes_per_prefix=4, prefix_len=256, input_len=32, output_len=8)
        turns = WorkloadConfig(kind=WorkloadKind.MULTI_TURN, num_requests=48, turns=4, input_len=64, output_len=16)
    return [
        Scenario("shared-prefix", shared, PoissonArrivals(8.0)),
        Scenario("multi-turn", turns, PoissonArrivals(8.0)),
    ]


def ratio(subject: float | None, baseline: float | None) -> float | None:
    if subject is None or baseline is None or baseline == 0:
        return None
    return subject / baseline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of a few requests (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per policy (default 2, quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    rounds = args.rounds or (1 if args.quick else 2)
    variants = [Variant(policy, cluster_config(policy, args.seed)) for policy in POLICIES]
    results: dict[str, dict[str, PointResult]] = {}
    with ray_session(variants[0].config):
        clusters = start_clusters(variants, progress=progress)
        try:
            warm_up(clusters, WorkloadConfig(input_len=128, output_len=8), count=4, seed=args.seed, progress=progress)
            for scenario in scenarios(args.quick):
                results[scenario.name] = compare(clusters, scenario, rounds=rounds, seed=args.seed, progress=progress)
        finally:
            stop_clusters(clusters)

    rows = []
    figures: dict[str, object] = {"rounds": rounds, "engine": ENGINE, "num_cpus_per_instance": NUM_CPUS_PER_INSTANCE}
    hit_rates: dict[str, dict[str, float]] = {}
    for scenario in scenarios(args.quick):
        per_policy = results[scenario.name]
        base = per_policy["round_robin"].metrics
        entry: dict[str, object] = {"requests_per_round": scenario.workload.total_requests, "rate_per_s": scenario.arrivals.rate_per_s}
        hit_rates[scenario.name] = {}
        for policy in POLICIES:
            m = per_policy[policy].metrics
            hit = m.prefix_cache_hit_rate or 0.0
            hit_rates[scenario.name][policy] = hit
            ttft_p50 = m.ttft_ms.p50 if m.ttft_ms else None
            ttft_p99 = m.ttft_ms.p99 if m.ttft_ms else None
            ratios = {
                "hit_rate": ratio(hit, base.prefix_cache_hit_rate),
                "ttft_p50": ratio(ttft_p50, base.ttft_ms.p50 if base.ttft_ms else None),
                "ttft_p99": ratio(ttft_p99, base.ttft_ms.p99 if base.ttft_ms else None),
                "throughput": ratio(m.request_throughput_rps, base.request_throughput_rps),
            }
            rows.append([
                scenario.name, policy, f"{m.completed}/{m.num_requests}", hit, ttft_p50, ttft_p99, m.request_throughput_rps,
                ratios["ttft_p99"], ratios["throughput"],
            ])
            entry[policy] = summary_figures(m) | {
                "ratios_over_round_robin": {k: (round(v, 4) if v is not None else None) for k, v in ratios.items()}
            }
        figures[scenario.name] = entry
    print_table(
        ["workload", "policy", "done", "cache hit", "TTFT p50 ms", "TTFT p99 ms", "req/s", "TTFT p99 / rr", "req/s / rr"],
        [["-" if cell is None else cell for cell in row] for row in rows],
    )
    print("cache hit = cached prompt tokens / prompt tokens; '/ rr' = ratio against round robin")
    # KV-aware above round robin: by at least a point of hit rate, so that a tie (both 0) is a miss.
    targets = {
        f"{name.replace('-', '_')}_kv_aware_minus_round_robin_hit_rate": Target(
            rates["kv_aware"] - rates["round_robin"], MIN_HIT_RATE_GAIN, higher_is_better=True
        )
        for name, rates in hit_rates.items()
    }
    emit_result(BENCH, figures, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
