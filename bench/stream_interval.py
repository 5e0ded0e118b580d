"""What reporting tokens in groups (engine.stream_interval_ms) saves the router, and what it costs a
client: two MIXED instances (`--disaggregated`: two PREFILL + GENERATION pairs) deployed as `duet
serve` deploys them (a Ray actor each, on an embedded 2-CPU Ray), one side reporting every step and
one with the interval, each behind its own router in this process. Requests go to them in turn, one at a time, so the CPU this process spends during a
request is its router's and its client's (the idle router's long poll is a call per heartbeat).

Figures, per side (`every_step_*`, `interval_*`) and as ratios (interval / every step):
  driver_cpu_us_per_token  this process's CPU per streamed token (router, Ray calls, client)
  events_per_request       token events the client sees
  ttft_ms, tpot_ms, e2e_ms medians over the requests (TTFT and e2e should not move; TPOT may, as
                           the instances no longer share the CPUs with as many Ray calls)

    python bench/stream_interval.py [--interval-ms 20] [--requests 12] [--max-tokens 200]
    python bench/stream_interval.py --disaggregated --prompt-tokens 200 --max-tokens 300
    python bench/stream_interval.py --quick      # a short run (the suite's smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.deploy.launch import keep_ray_on_loopback  # noqa: E402

keep_ray_on_loopback()  # before anything imports Ray: this bench starts an embedded one
from bench._common import emit_result, print_table, progress  # noqa: E402
from cluster.router.api import ClientRequest, FinalEvent, Outcome, TokenEvent  # noqa: E402
from cluster.router.config import RouterConfig  # noqa: E402
from cluster.router.driver import Router  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402
from worker.tokenizer import ByteTokenizer  # noqa: E402

BENCH = "stream_interval"
TOKENS_PER_BLOCK = 16
SIDES = ("every_step", "interval")


async def _one(router: Router, prompt: tuple[int, ...], max_tokens: int) -> dict[str, float]:
    cpu_started, started = time.process_time(), time.perf_counter()
    handle = await router.submit(ClientRequest(None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    stamps: list[float] = []
    events = 0
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            events += 1
            stamps.extend(time.perf_counter() for _ in event.token_ids)
        elif isinstance(event, FinalEvent) and event.outcome is not Outcome.COMPLETE:
            raise RuntimeError(f"a request failed: {event.error_message}")
    ended = time.perf_counter()
    return {
        "cpu_us_per_token": 1e6 * (time.process_time() - cpu_started) / len(stamps),
        "events": events,
        "ttft_ms": 1e3 * (stamps[0] - started),
        "tpot_ms": 1e3 * (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1),
        "e2e_ms": 1e3 * (ended - started),
    }


async def _run(args) -> dict[str, list[dict[str, float]]]:
    from cluster.deploy.config import ClusterConfig
    from cluster.deploy.launch import Deployment

    engine = {"num_blocks": 512, "tokens_per_block": TOKENS_PER_BLOCK}
    roles = ("PREFILL", "GENERATION") if args.disaggregated else ("MIXED",)
    group = {"count": 1, "num_cpus": 0, "torch_threads": 1}
    config = ClusterConfig.from_dict({
        "dtype": "float32", "device": "cpu", "ray": {"num_cpus": 2},
        # Each side's own instances (a group per role and side; ids in this order: role-0 every step, role-1 grouped).
        "instances": [
            {"role": role, **group, "engine": {"stream_interval_ms": interval}}
            for interval in (0, args.interval_ms) for role in roles
        ],
        "engine": engine,
    })
    deployment = Deployment(config)
    routers: dict[str, Router] = {}
    try:
        clients = {client.instance_id: client for client in deployment.start()}
        health = {"heartbeat_interval_s": 0.5, "dead_after_s": 10.0}
        placement = {"disaggregation": "always" if args.disaggregated else "never"}
        for index, side in enumerate(SIDES):
            router = Router(
                RouterConfig.from_dict({"health": health, "placement": placement}), ByteTokenizer(),
                vocab_size=ByteTokenizer.VOCAB_SIZE, max_seq_len=4096, tokens_per_block=TOKENS_PER_BLOCK,
            )
            await router.start()
            routers[side] = router
            for role in roles:
                await router.add_instance(clients[f"{role.lower()}-{index}"])
        results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
        for repeat in range(args.requests + 1):  # the first round warms up
            prompt = tuple((repeat * 31 + i * 7) % 250 + 1 for i in range(args.prompt_tokens))
            order = SIDES if repeat % 2 == 0 else tuple(reversed(SIDES))
            for side in order:
                result = await _one(routers[side], prompt, args.max_tokens)
                if repeat:
                    results[side].append(result)
            progress(f"stream_interval: request {repeat}/{args.requests}")
        return results
    finally:
        for router in routers.values():
            await router.stop()
        deployment.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval-ms", type=float, default=20.0, help="the grouped side's engine.stream_interval_ms")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--disaggregated", action="store_true", help="a PREFILL + GENERATION pair per side instead of a MIXED instance")
    parser.add_argument("--quick", action="store_true", help="3 requests of 40 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens = 3, 40
    results = asyncio.run(_run(args))
    figures: dict[str, float | str] = {
        "interval_ms": args.interval_ms, "requests": args.requests, "max_tokens": args.max_tokens,
        "instances": "PREFILL + GENERATION" if args.disaggregated else "MIXED",
    }
    rows = []
    for key, name in (("cpu_us_per_token", "driver_cpu_us_per_token"), ("events", "events_per_request"),
                      ("ttft_ms", "ttft_ms"), ("tpot_ms", "tpot_ms"), ("e2e_ms", "e2e_ms")):
        values = {side: statistics.median(r[key] for r in results[side]) for side in SIDES}
        for side in SIDES:
            figures[f"{side}_{name}"] = round(values[side], 2)
        figures[f"{name}_ratio"] = round(values["interval"] / values["every_step"], 3)
        rows.append([name, values["every_step"], values["interval"], values["interval"] / values["every_step"]])
    print_table(["figure (median)", "every step", f"interval {args.interval_ms:g} ms", "ratio"], rows)
    emit_result(BENCH, figures, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
