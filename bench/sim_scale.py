"""The simulator at scale: 256 instances (64 PREFILL + 192 GENERATION), 100,000 requests, one core.

Log-normal lengths (prompt mean 512, output mean 128, sigma 0.5), Poisson arrivals at 70 % of the
cluster's capacity (cluster/sim/capacity.py, from the profile: roofline H100 SXM, Llama 3 8B by
default, so the sizes are a real deployment's), the real router (KV-aware prefill placement,
least-loaded generation) and every instance's real scheduler on virtual time. Requests are sent
straight to the router's API and their token times recorded (the load runner's work without its
per-request generator chain; the same RequestRecords and metrics). `cpu_s` is the process's CPU
time: on a shared machine, where wall time includes other processes' turns, the one-core figure. KV moves over an RDMA-class
link (rdma-400g: a 25 GbE link cannot carry Llama 3 8B's 128 KiB per token at this rate). Instances
merge each request's tokens for up to 50 ms before reporting them (--stream-interval-ms, vLLM's
stream_interval): first tokens, ends and every state event go out at once, so TTFT, TPOT and e2e
are exactly those of reporting every step (tests/unit/test_sim_instance.py checks it); ITL is
seen in chunks; a request's ~126 tokens reach the router in ~20 messages.

Figures: `sim_requests_per_wall_s` (requests simulated per wall second), `instances`, `requests`,
`sim_us_per_request` (wall microseconds of the whole simulation per request), `router_us_per_request`
(the router's own CPU per request: its share of the run's CPU, sampled from the stack every 10 ms,
with the whole split in `cpu_shares`: router, simulated instances, scheduler, load side, event
loop), the simulated duration, latencies and utilisation, and `records_digest` (a hash of every request's
token times: equal digests, equal results). Target: the full run within 300 s of
wall time.

    python bench/sim_scale.py [--quick] [--requests N] [--profile P] [--load 0.7]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import hashlib
import logging
import pstats
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from cluster.deploy.config import ClusterConfig  # noqa: E402
from cluster.loadgen.arrivals import PoissonArrivals  # noqa: E402
from cluster.loadgen.metrics import RequestRecord, Slo, compute_metrics  # noqa: E402
from cluster.loadgen.workloads import lognormal_length  # noqa: E402
from cluster.router.api import ClientRequest, FinalEvent, Outcome  # noqa: E402
from cluster.router.driver import Router  # noqa: E402
from cluster.sim.capacity import cluster_rps  # noqa: E402
from cluster.sim.catalog import load_profile  # noqa: E402
from cluster.sim.cluster import SIM_VOCAB_SIZE, SimSettings, build_instances  # noqa: E402
from cluster.sim.link import data_plane  # noqa: E402
from cluster.sim.vclock import run_virtual  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402
from worker.tokenizer import ByteTokenizer  # noqa: E402

BENCH = "sim_scale"
NUM_PREFILL, NUM_GENERATION = 64, 192
PROMPT_MEAN, OUTPUT_MEAN, SIGMA = 512, 128, 0.5
MAX_WALL_S = 300.0
ENGINE = {  # an H100 serving Llama 3 8B in bf16: ~30 GB of KV after the weights and activations
    "num_blocks": 16384, "tokens_per_block": 16, "max_num_requests": 256, "max_batch_size": 256,
    "max_num_tokens": 8192, "chunk_unit_tokens": 2048,
}


class StackSampler:
    """Samples the main thread's stack every `interval_s` from a thread of its own and attributes each
    sample to the innermost frame of one of ours: the router (cluster/router/, with the asyncio work
    it calls), the simulated instances (cluster/sim/), the scheduler (scheduler/), the load side
    (this file), or the event loop itself. Cheap enough for the full run (cProfile doubles it)."""

    OWNERS = (("cluster/router/", "router"), ("cluster/sim/", "sim_instances"), ("scheduler/", "scheduler"),
              ("bench/sim_scale", "load"))

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.counts: dict[str, int] = {}
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._main)
            owner = "event_loop"
            while frame is not None:
                name = frame.f_code.co_filename
                hit = next((label for part, label in self.OWNERS if part in name), None)
                if hit is not None:
                    # Reached from main() through the loop alone: the event loop's own work.
                    owner = "event_loop" if frame.f_code.co_name in ("main", "<module>") else hit
                    break
                frame = frame.f_back
            self.counts[owner] = self.counts.get(owner, 0) + 1

    def shares(self) -> dict[str, float]:
        total = sum(self.counts.values()) or 1
        return {owner: round(count / total, 3) for owner, count in sorted(self.counts.items())}


def cluster_config(num_prefill: int, num_generation: int) -> ClusterConfig:
    return ClusterConfig.from_dict({
        "instances": [{"role": "PREFILL", "count": num_prefill}, {"role": "GENERATION", "count": num_generation}],
        "engine": ENGINE,
        "router": {
            "admission": {"max_queued_requests": 1_000_000, "max_buffered_events": 100_000},
            "placement": {"prefill_policy": {"name": "kv_aware"}, "generation_policy": {"name": "least_loaded"}},
        },
    })


def workload(count: int, seed: int) -> list[tuple[tuple[int, ...], int]]:
    """(prompt, output tokens) pairs: log-normal lengths; prompts are random bytes (fast to draw)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt_len = lognormal_length(rng, PROMPT_MEAN, SIGMA, 8 * PROMPT_MEAN)
        output_len = lognormal_length(rng, OUTPUT_MEAN, SIGMA, 8 * OUTPUT_MEAN)
        requests.append((tuple(rng.randbytes(prompt_len)), output_len))
    return requests


async def _one(router: Router, index: int, prompt: tuple[int, ...], max_tokens: int, scheduled_s: float, loop, started: float, records: list) -> None:
    sent_s = loop.time() - started
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=index + 1)
    handle = await router.submit(ClientRequest(None, prompt, params, validated=True))
    times: list[float] = []
    tokens: list[int] = []
    final = None
    async for event in handle.events():
        if isinstance(event, FinalEvent):
            final = event
        else:
            times.append(loop.time() - started)
            tokens.append(len(event.token_ids))
    end_s = loop.time() - started
    ok = final is not None and final.outcome is Outcome.COMPLETE
    records[index] = RequestRecord(
        index=index, scheduled_s=scheduled_s, sent_s=sent_s, end_s=end_s, chunk_times_s=tuple(times),
        chunk_tokens=tuple(tokens), prompt_tokens=len(prompt), output_tokens=sum(tokens),
        expected_output_tokens=max_tokens, error=None if ok else f"{final.error_kind}: {final.error_message}" if final else "no final",
    )


async def simulate(requests, rate_per_s: float, config: ClusterConfig, settings: SimSettings, seed: int):
    loop = asyncio.get_running_loop()
    instances, network = build_instances(config, settings)
    router = Router(
        config.router, ByteTokenizer(), vocab_size=SIM_VOCAB_SIZE, max_seq_len=settings.max_seq_len,
        tokens_per_block=config.tokens_per_block, clock=loop.time, wall_clock=loop.time, seed=seed,
    )
    await router.start()
    for instance in instances:
        await router.add_instance(instance)
    offsets = PoissonArrivals(rate_per_s).offsets_s(len(requests), seed)
    records: list = [None] * len(requests)
    started = loop.time()
    tasks = []
    for index, ((prompt, max_tokens), offset) in enumerate(zip(requests, offsets, strict=True)):
        wait = started + offset - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.ensure_future(_one(router, index, prompt, max_tokens, offset, loop, started, records)))
    await asyncio.gather(*tasks)
    virtual_s = loop.time() - started
    await router.stop()
    return records, virtual_s, instances, router


def records_digest(records: list) -> str:
    """sha256 of every request's (index, sent, end, chunk times and sizes, error), reprs of the floats:
    two runs with the same digest made the same decisions to the last token (the check that a speed-up
    changed no result)."""
    digest = hashlib.sha256()
    for r in records:
        digest.update(repr((r.index, r.sent_s, r.end_s, r.chunk_times_s, r.chunk_tokens, r.error)).encode())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 instances, 1,000 requests (CI smoke test)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--profile", default="roofline:h100-sxm:llama-3-8b")
    parser.add_argument("--load", type=float, default=0.7, help="share of the simulated capacity")
    parser.add_argument("--link", default="rdma-400g", help="KV data plane model (cluster/sim/link.py)")
    parser.add_argument("--stream-interval-ms", type=float, default=50.0,
                        help="instances merge a request's tokens for up to this long (0: every step; TTFT, TPOT, e2e exact either way)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", action="store_true", help="also profile the run with cProfile (slower) and print the top")
    parser.add_argument("--instances", default=None, metavar="P,G", help="override the 64,192 split (e.g. 16,48)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    num_prefill, num_generation = (4, 12) if args.quick else (NUM_PREFILL, NUM_GENERATION)
    if args.instances:
        num_prefill, num_generation = (int(x) for x in args.instances.split(","))
    count = args.requests or (1000 if args.quick else 100_000)
    config = cluster_config(num_prefill, num_generation)
    settings = SimSettings(load_profile(args.profile), data_plane(args.link), stream_interval_s=args.stream_interval_ms / 1e3)
    engine = config.engine_config(config.instances[0])
    capacity = cluster_rps(settings.profile, engine, num_prefill=num_prefill, num_generation=num_generation,
                           mean_prompt_tokens=PROMPT_MEAN, mean_output_tokens=OUTPUT_MEAN)
    rate = args.load * capacity
    progress(f"{num_prefill}P + {num_generation}G, {count} requests at {rate:.0f} req/s ({args.load:.0%} of {capacity:.0f})")
    started = time.perf_counter()
    requests = workload(count, args.seed)
    build_s = time.perf_counter() - started
    gc.freeze()  # the workload lives through the run: no collection needs to walk it
    profiler = cProfile.Profile() if args.cprofile else None
    started = time.perf_counter()
    cpu_started = time.process_time()
    if profiler:
        profiler.enable()
    with StackSampler() as sampler:
        records, virtual_s, instances, router = run_virtual(simulate(requests, rate, config, settings, args.seed))
    if profiler:
        profiler.disable()
    shares = sampler.shares()
    wall_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    metrics = compute_metrics(records, virtual_s, Slo())
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    utilisation = {}
    for role in ("PREFILL", "GENERATION"):
        mine = [i.stats.busy_s / virtual_s for i in instances if i.role.name == role]
        utilisation[role] = sum(mine) / len(mine)
    figures = {
        "instances": len(instances),
        "requests": count,
        "completed": metrics.completed,
        "sim_requests_per_wall_s": round(count / wall_s, 1),
        "sim_us_per_request": round(1e6 * wall_s / count, 1),
        # The router's share of the run's CPU (sampled) times CPU per request.
        "router_us_per_request": round(shares.get("router", 0.0) * 1e6 * cpu_s / count, 1),
        "cpu_shares": shares,
        "wall_s": round(wall_s, 2),
        "cpu_s": round(cpu_s, 2),  # this process's CPU time: the one-core figure on a shared machine
        "workload_build_s": round(build_s, 2),
        "simulated_s": round(virtual_s, 2),
        "rate_per_s": round(rate, 1),
        "capacity_per_s": round(capacity, 1),
        "profile": settings.profile.name,
        "link": settings.link.plane,
        "stream_interval_ms": args.stream_interval_ms,
        "ttft_p50_ms": round(metrics.ttft_ms.p50, 2) if metrics.ttft_ms else None,
        "ttft_p99_ms": round(metrics.ttft_ms.p99, 2) if metrics.ttft_ms else None,
        "tpot_p50_ms": round(metrics.tpot_ms.p50, 3) if metrics.tpot_ms else None,
        "utilisation": {k: round(v, 3) for k, v in utilisation.items()},
        "illegal_transitions": router.illegal_transitions,
        "records_digest": records_digest(records),
    }
    print_table(["figure", "value"], [[k, v] for k, v in figures.items() if not isinstance(v, dict)])
    targets = {"wall_s": Target(wall_s, MAX_WALL_S, higher_is_better=False)}
    if not args.quick:
        targets["completed_fraction"] = Target(metrics.completed / count, 1.0, higher_is_better=True)
    emit_result(BENCH, figures, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
