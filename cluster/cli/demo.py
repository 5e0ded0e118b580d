"""`duet demo`: the README's main job. Starts the embedded cluster (1 PREFILL + 1 GENERATION, the
built-in tiny model), sends a mixed batch of requests through the gRPC client API, streams them, and
prints, per request, TTFT, TPOT, the instances used and the state timeline; then shuts down.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.cli.common import add_cluster_options, load_cluster_config, setup_logging, with_free_ports
from cluster.client import DuetClient
from cluster.deploy.config import ClusterConfig

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="start the embedded cluster, stream a mixed batch of requests, print per-request timings",
        description="The quick-start job: an embedded cluster (1 PREFILL + 1 GENERATION, the built-in "
        "model), a mixed batch of requests through the client API, a table per request (TTFT, TPOT, "
        "instances used, state timeline), then shutdown.",
    )
    add_cluster_options(parser)
    parser.set_defaults(handler=run, log_level="WARNING")


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    return run_demo(with_free_ports(load_cluster_config(args)))


@dataclass(frozen=True)
class DemoRequest:
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


DEMO_REQUESTS = (
    DemoRequest("Hello, duet!", 24),
    DemoRequest("Disaggregated serving splits prefill from decode. " * 6, 32),
    DemoRequest("A short one", 8, temperature=0.8, seed=7),
    DemoRequest("Tell me about KV caches: " + "blocks, pages, prefixes. " * 12, 48, temperature=0.7, seed=11),
    DemoRequest("Stop at the letter z please", 64, stop=("z",)),
    DemoRequest("Bonjour, ça va ? 日本語も少し。", 24, temperature=0.9, seed=3),
)


def _run_requests(target: str, requests: tuple[DemoRequest, ...]) -> list:
    with DuetClient(target, timeout_s=120.0) as client:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(requests)) as pool:
            futures = [
                pool.submit(
                    client.complete,
                    r.prompt,
                    max_tokens=r.max_tokens,
                    temperature=r.temperature,
                    seed=r.seed,
                    stop=list(r.stop) or None,
                )
                for r in requests
            ]
            return [f.result() for f in futures]


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def render(requests: tuple[DemoRequest, ...], completions: list, out: Callable[[str], None] = print) -> None:
    for index, (request, done) in enumerate(zip(requests, completions, strict=True), start=1):
        tokens = len(done.token_ids)
        tpot = None if done.ttft_s is None or tokens < 2 else (done.total_s - done.ttft_s) / (tokens - 1)
        hops = ", ".join(f"{w.phase}@{w.instance_id}" for w in done.instances)
        prompt = request.prompt if len(request.prompt) <= 48 else request.prompt[:45] + "..."
        out(f"[{index}] {done.request_id}  prompt={prompt!r}")
        out(
            f"    tokens={tokens} finish={done.finish_reason} TTFT={_fmt_ms(done.ttft_s)} ms "
            f"TPOT={_fmt_ms(tpot)} ms total={_fmt_ms(done.total_s)} ms cached={done.usage.cached_tokens}"
        )
        out(f"    instances: {hops}")
        if done.timeline:
            start = done.timeline[0].time_s
            steps = " -> ".join(f"{e.state}(+{(e.time_s - start) * 1000:.0f}ms)" for e in done.timeline)
            out(f"    timeline: {steps}")
        out(f"    text: {done.text[:120]!r}")


async def _demo(config: ClusterConfig, requests: tuple[DemoRequest, ...], out: Callable[[str], None]) -> int:
    # The router/deploy stack is imported when the demo runs, so that every `duet` start stays fast.
    from cluster.deploy.serve import ServingCluster

    started = time.monotonic()
    async with ServingCluster(config) as cluster:
        out(f"serving on {cluster.target} ({time.monotonic() - started:.1f}s to start)")
        completions = await asyncio.to_thread(_run_requests, cluster.target, requests)
        render(requests, completions, out)
        status = cluster.router.cluster_status()
        out(
            "cluster: "
            + ", ".join(f"{i.instance_id} {i.role.name} {i.health.value} free {i.free_blocks}/{i.total_blocks}" for i in status.instances)
        )
        out(f"outcomes: {dict(status.requests_by_outcome)}")
    return 0


def run_demo(config: ClusterConfig | None = None, *, out: Callable[[str], None] = print) -> int:
    config = config or ClusterConfig()
    try:
        return asyncio.run(_demo(config, DEMO_REQUESTS, out))
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # noqa: BLE001 - the CLI reports, never a traceback for a failed demo
        logger.exception("demo failed")
        print(f"duet demo failed: {error}", file=sys.stderr)
        return 1
