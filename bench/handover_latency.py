"""The delay the KV hand-over adds between the first and the second token, against a MIXED instance.

A 2,048-token prompt on the default model: disaggregated (a PREFILL and a GENERATION instance in
this process, the KV pushed over real gRPC on 127.0.0.1, driven by the router) against colocated (one
MIXED instance, the same router). For each run it records the client-side gap between the first and
the second token; the difference of the medians is what the hand-over costs (reservation, push,
commit, first decode step on the receiver). Both sides run in the same process, interleaved.

    python bench/handover_latency.py [--quick] [--prompt-tokens 2048] [--repeats 5] [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit_result, print_table, progress  # noqa: E402
from cluster.router.api import ClientRequest, TokenEvent  # noqa: E402
from cluster.router.config import RouterConfig  # noqa: E402
from cluster.router.driver import Router  # noqa: E402
from cluster.router.instance_client import LocalInstanceClient  # noqa: E402
from worker.engine_types import EngineConfig  # noqa: E402
from worker.instance import Instance, InstanceSpec  # noqa: E402
from worker.protocol import InstanceRole  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402
from worker.tokenizer import ByteTokenizer  # noqa: E402

TOKEN = "handover-bench-token-0123456789abcdef"


def _instance(name: str, role: InstanceRole, args) -> Instance:
    engine = EngineConfig(role=role, num_blocks=1024, tokens_per_block=16, max_num_tokens=4096, chunk_unit_tokens=512)
    spec = InstanceSpec(name, engine, dtype=args.dtype, device=args.device, cluster_token=TOKEN, torch_threads=args.threads)
    return Instance(spec)


async def _gap_s(router: Router, prompt: list[int]) -> tuple[float, float]:
    """(first-token latency, first-to-second-token gap) seen by a client of the router."""
    started = time.perf_counter()
    handle = await router.submit(ClientRequest(None, tuple(prompt), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
    stamps: list[float] = []
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            stamps.extend(time.perf_counter() for _ in event.token_ids)
    return stamps[0] - started, stamps[1] - stamps[0]


async def _run(args) -> dict[str, list[tuple[float, float]]]:
    rng = random.Random(0)
    config_disagg = RouterConfig.from_dict({"health": {"heartbeat_interval_s": 0.5, "dead_after_s": 10.0}})
    config_mixed = RouterConfig.from_dict(
        {"health": {"heartbeat_interval_s": 0.5, "dead_after_s": 10.0}, "placement": {"disaggregation": "never"}}
    )
    instances = {
        "p0": _instance("p0", InstanceRole.PREFILL, args),
        "g0": _instance("g0", InstanceRole.GENERATION, args),
        "m0": _instance("m0", InstanceRole.MIXED, args),
    }
    routers = {}
    try:
        routers["disaggregated"] = Router(config_disagg, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16)
        routers["mixed"] = Router(config_mixed, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16)
        for router in routers.values():
            await router.start()
        await routers["disaggregated"].add_instance(LocalInstanceClient(instances["p0"]))
        await routers["disaggregated"].add_instance(LocalInstanceClient(instances["g0"]))
        await routers["mixed"].add_instance(LocalInstanceClient(instances["m0"]))
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in routers}
        for repeat in range(args.repeats + 1):  # the first round is a warm-up
            prompt = [rng.randrange(256) for _ in range(args.prompt_tokens)]  # fresh: no prefix reuse
            for name, router in routers.items():
                progress(f"handover_latency: {name} run {repeat}")
                gap = await _gap_s(router, prompt)
                if repeat:
                    results[name].append(gap)
        return results
    finally:
        for router in routers.values():
            await router.stop()
        for instance in instances.values():
            instance.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 512-token prompt, 2 repeats")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: where all three instances run")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens, args.repeats = 512, 2
    results = asyncio.run(_run(args))
    rows = []
    figures: dict[str, float | str] = {"prompt_tokens": args.prompt_tokens, "device": args.device, "dtype": args.dtype}
    for name, runs in results.items():
        ttft = statistics.median(r[0] for r in runs)
        gap = statistics.median(r[1] for r in runs)
        figures[f"{name}_ttft_ms"] = round(ttft * 1000, 2)
        figures[f"{name}_first_to_second_token_ms"] = round(gap * 1000, 2)
        rows.append([name, ttft * 1000, gap * 1000])
    added = figures["disaggregated_first_to_second_token_ms"] - figures["mixed_first_to_second_token_ms"]
    figures["handover_added_delay_ms"] = round(added, 2)
    print(f"prompt of {args.prompt_tokens} tokens, default model, {args.dtype}, {args.device}, {args.repeats} runs (medians)")
    print_table(["mode", "TTFT ms", "first->second token ms"], rows)
    print(f"the hand-over adds {added:.1f} ms between the first and the second token")
    emit_result("handover_latency", figures, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
