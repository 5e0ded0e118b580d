"""What the KV hand-over costs a request: the delay it adds between the first and the second token,
and disaggregated against MIXED TTFT, per model, prompt length and chunk size.

For each case, three instances live in this process: a PREFILL and a GENERATION instance (the KV
pushed over real gRPC on 127.0.0.1, driven by the router) and one MIXED instance (its own router).
Every repeat sends the same fresh prompt (no prefix reuse) to both, interleaved so that the
machine's load hits them alike, and records the client-side TTFT and first-to-second-token gap. Per
case, with medians and interquartile ranges over the repeats:

  handover_added_delay_ms  median disaggregated gap - median MIXED gap: what the hand-over adds
                           (the push of what is left after the first token, the commit, the
                           receiver's first decode step, the reports)
  kv_bytes                 the request's KV (every layer, K and V, whole blocks)
  bytes_time_ms            those bytes alone: one bare gRPC send of kv_bytes in this process, with
                           the transport's streams and chunk size but no framing or checks (grpc);
                           one hot single-thread memcpy (shm); measured in the same run
  disagg_ttft_ms / mixed_ttft_ms
  <cluster>_phase_*_ms     where the gap goes, per cluster (disaggregated, mixed), from the
                           instances' report times (PHASES below): hand_over, commit_to_step,
                           decode_report, router_to_client, first_token_report

Targets (issue 15, this 2-core machine, 2048-token prompt, both models, 512-token chunks): added
delay <= 3 ms + 1.2 x bytes_time; disaggregated TTFT <= 1.05 x MIXED TTFT.

`--processes` runs each instance in its own process, as `duet serve` deploys them (a Ray actor
each, on an embedded 2-CPU Ray; the routers stay in this process and call them through Ray): in
one process the three engines, the transfer threads and the routers share one interpreter lock,
and whatever runs beside a prefill's forward pass slows it, which a deployment's separate
processes do not pay.

`--reserve` compares when the generation instance reserves (router.handover.reserve): the default
at_context_start relays the reservation to the prefill instance while it computes, which pushes
the moment its KV is final; at_context_done is the hand-over on the critical path.

    python bench/handover_latency.py                     # every case, 20 repeats each
    python bench/handover_latency.py --quick             # one small case (the suite's smoke test)
    python bench/handover_latency.py --model bench --prompt-tokens 2048 --max-num-tokens 512
    python bench/handover_latency.py --processes --model default --prompt-tokens 2048 --max-num-tokens 512
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.deploy.launch import keep_ray_on_loopback  # noqa: E402

keep_ray_on_loopback()  # before anything imports Ray: --processes starts an embedded one
from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from cluster.router.api import ClientRequest, TokenEvent  # noqa: E402
from cluster.router.config import RouterConfig  # noqa: E402
from cluster.router.driver import Router  # noqa: E402
from cluster.router.instance_client import LocalInstanceClient  # noqa: E402
from scheduler.state import LlmRequestState  # noqa: E402
from worker.engine_types import EngineConfig  # noqa: E402
from worker.instance import BUILTIN_PREFIX, Instance, InstanceSpec  # noqa: E402
from worker.kv_transfer.config import SenderConfig  # noqa: E402
from worker.protocol import InstanceRole  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402
from worker.tokenizer import ByteTokenizer  # noqa: E402

TOKEN = "handover-bench-token-0123456789abcdef"
TOKENS_PER_BLOCK = 16
MAX_SEQ_LEN = 4096
DEFAULT_MAX_NUM_TOKENS = EngineConfig().max_num_tokens
TARGET_FIXED_MS = 3.0
TARGET_BYTES_FACTOR = 1.2
TARGET_TTFT_RATIO = 1.05


@dataclass(frozen=True)
class Case:
    model: str  # "default" | "bench"
    prompt_tokens: int
    max_num_tokens: int
    data_plane: str
    reserve: str

    @property
    def name(self) -> str:
        return f"{self.model}_p{self.prompt_tokens}_c{self.max_num_tokens}_{self.data_plane}_{self.reserve}"


@dataclass
class Sample:
    ttft_s: float
    gap_s: float
    # Where the first-to-second-token path went (seconds, from the instances' reports; see Trail).
    phases: dict[str, float]


# The phases of the path from a context's first token to the client's second token, in order.
# Disaggregated: the prefill's context done -> the generation instance's commit ("hand-over": the
# push of what was left and the commit) -> its first decode step starts ("commit to step") -> the
# router holds that step's token ("decode + report": the forward, the publication, the poll's
# return) -> the client has it ("router to client"). MIXED has no hand-over and no commit: its
# decode step follows the context's. "first token report" (context done -> the client's first
# token) is the part of the first token's path that the gap does not include but that varies.
PHASES = ("hand-over", "commit to step", "decode + report", "router to client", "first token report")


class Trail:
    """What the instances reported about one request, as a router received it: each state event's
    instance time and each token output's arrival at the router (all on time.monotonic, one clock for
    every process on this host). One request at a time: the bench samples them in turn."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, LlmRequestState], float] = {}
        self.tokens_at_s: list[float] = []  # the router's receipt, per token

    def phases(self, role: str, first_client_s: float, second_client_s: float) -> dict[str, float]:
        """The path's phases (seconds), or {} when a report the bench needs is missing."""
        if role == "disaggregated":
            done = self.events.get(("p0", LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS))
            committed = self.events.get(("g0", LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE))
            started = self.events.get(("g0", LlmRequestState.GENERATION_IN_PROGRESS))
        else:
            done = committed = started = self.events.get(("m0", LlmRequestState.GENERATION_IN_PROGRESS))
        if done is None or committed is None or started is None or len(self.tokens_at_s) < 2:
            return {}
        received = self.tokens_at_s[1]
        return {
            "hand-over": committed - done,
            "commit to step": started - committed,
            "decode + report": received - started,
            "router to client": second_client_s - received,
            "first token report": first_client_s - done,
        }


class _Reporting:
    """An instance client whose polls also fill the current Trail (everything else passes through)."""

    def __init__(self, client: object, name: str, trails: list[Trail]) -> None:
        self._client = client
        self._name = name
        self._trails = trails  # the last one is the request being sampled

    def __getattr__(self, attribute: str) -> object:
        return getattr(self._client, attribute)

    async def poll(self, timeout_s: float):
        batch = await self._client.poll(timeout_s)
        now = time.monotonic()
        if self._trails:
            trail = self._trails[-1]
            for event in batch.events:
                trail.events.setdefault((self._name, event.state), event.time_s)
            for output in batch.outputs:
                trail.tokens_at_s.extend(now for _ in output.new_token_ids)
        return batch


def _engine(role: InstanceRole, case: Case) -> EngineConfig:
    blocks = 2 * (-(-MAX_SEQ_LEN // TOKENS_PER_BLOCK)) + 64
    chunk = min(512, case.max_num_tokens)
    return EngineConfig(
        role=role, num_blocks=blocks, tokens_per_block=TOKENS_PER_BLOCK, max_num_tokens=case.max_num_tokens, chunk_unit_tokens=chunk
    )


def _instance(name: str, role: InstanceRole, case: Case, args) -> Instance:
    model = None if case.model == "default" else BUILTIN_PREFIX + case.model
    plane = {"data_plane": case.data_plane}
    spec = InstanceSpec(
        name, _engine(role, case), model=model, dtype=args.dtype, device=args.device, cluster_token=TOKEN,
        torch_threads=args.threads, sender=plane, receiver=plane,
    )
    return Instance(spec)


async def _sample(name: str, router: Router, prompt: list[int], trails: list[Trail]) -> Sample:
    """TTFT and the first-to-second-token gap seen by a client of the router, and the gap's phases
    as the instances reported them."""
    trail = Trail()
    trails.append(trail)
    started = time.monotonic()  # the instances' clock (time.perf_counter is the same on Linux)
    handle = await router.submit(ClientRequest(None, tuple(prompt), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
    stamps: list[float] = []
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            stamps.extend(time.monotonic() for _ in event.token_ids)
    trails.clear()
    return Sample(stamps[0] - started, stamps[1] - stamps[0], trail.phases(name, stamps[0], stamps[1]))


async def _run_case(case: Case, args, rng: random.Random) -> tuple[dict[str, list[Sample]], int]:
    health = {"heartbeat_interval_s": 0.5, "dead_after_s": 10.0}
    configs = {
        "disaggregated": RouterConfig.from_dict({"health": health, "handover": {"reserve": case.reserve}}),
        "mixed": RouterConfig.from_dict({"health": health, "placement": {"disaggregation": "never"}}),
    }
    deployment = None
    instances: dict[str, Instance] = {}
    routers: dict[str, Router] = {}
    try:
        if args.processes:
            deployment, clients = _deploy(case, args)
        else:
            instances = {
                "p0": _instance("p0", InstanceRole.PREFILL, case, args),
                "g0": _instance("g0", InstanceRole.GENERATION, case, args),
                "m0": _instance("m0", InstanceRole.MIXED, case, args),
            }
            clients = {name: LocalInstanceClient(instance) for name, instance in instances.items()}
        trails: list[Trail] = []
        clients = {name: _Reporting(client, name, trails) for name, client in clients.items()}
        layout = (await clients["p0"].get_info()).layout
        kv_bytes = layout.run_bytes(layout.num_layers, -(-case.prompt_tokens // TOKENS_PER_BLOCK))
        for name, config in configs.items():
            routers[name] = Router(
                config, ByteTokenizer(), vocab_size=ByteTokenizer.VOCAB_SIZE, max_seq_len=MAX_SEQ_LEN, tokens_per_block=TOKENS_PER_BLOCK
            )
            await routers[name].start()
        await routers["disaggregated"].add_instance(clients["p0"])
        await routers["disaggregated"].add_instance(clients["g0"])
        await routers["mixed"].add_instance(clients["m0"])
        samples: dict[str, list[Sample]] = {name: [] for name in routers}
        for repeat in range(args.repeats + 1):  # the first round warms up
            prompt = [rng.randrange(256) for _ in range(case.prompt_tokens)]  # fresh: no prefix reuse
            order = list(routers.items()) if repeat % 2 == 0 else list(reversed(routers.items()))
            for name, router in order:
                sample = await _sample(name, router, prompt, trails)
                if repeat:
                    samples[name].append(sample)
            progress(f"handover_latency: {case.name} repeat {repeat}/{args.repeats}")
        return samples, kv_bytes
    finally:
        for router in routers.values():
            await router.stop()
        for instance in instances.values():
            instance.shutdown()
        if deployment is not None:
            deployment.stop()


def _deploy(case: Case, args) -> tuple[object, dict[str, object]]:
    """The three instances as Ray actors on an embedded Ray (cluster/deploy/launch.py Deployment,
    as `duet serve` starts them), by this bench's names."""
    from cluster.deploy.config import ClusterConfig
    from cluster.deploy.launch import Deployment

    engine = _engine(InstanceRole.MIXED, case)
    group = {"count": 1, "num_cpus": 0, "torch_threads": args.threads}
    config = ClusterConfig.from_dict({
        "model": None if case.model == "default" else BUILTIN_PREFIX + case.model,
        "dtype": args.dtype, "device": args.device, "cluster_token": TOKEN,
        "instances": [{"role": role, **group} for role in ("PREFILL", "GENERATION", "MIXED")],
        "engine": {"num_blocks": engine.num_blocks, "tokens_per_block": engine.tokens_per_block,
                   "max_num_tokens": engine.max_num_tokens, "chunk_unit_tokens": engine.chunk_unit_tokens},
        "kv_transfer": {"data_plane": case.data_plane},
        "ray": {"num_cpus": 2},
    })
    deployment = Deployment(config)
    try:
        clients = {client.instance_id: client for client in deployment.start()}
    except BaseException:
        deployment.stop()
        raise
    return deployment, {"p0": clients["prefill-0"], "g0": clients["generation-0"], "m0": clients["mixed-0"]}


def _bare_grpc_s(kv_bytes: int, repeats: int) -> float:
    """One bare gRPC send of `kv_bytes` in this process (median): the transport's streams,
    connections and chunk size, no framing, checks or checksums."""
    from bench.transfer_bench import BareGrpc
    from worker.kv_transfer.testing import _start_bare_grpc_sink

    sender = SenderConfig()
    server, port = _start_bare_grpc_sink(kv_bytes, sender.max_chunk_bytes)
    data = memoryview(random.Random(1).randbytes(kv_bytes))
    bare = BareGrpc(f"127.0.0.1:{port}", data, sender.max_chunk_bytes, sender.num_streams, sender.num_connections)
    try:
        bare.once(30.0)  # connect, warm up
        return statistics.median(bare.once(30.0) for _ in range(repeats))
    finally:
        bare.close()
        server.stop(0)


def _memcpy_s(kv_bytes: int, repeats: int) -> float:
    """One hot single-thread copy of `kv_bytes` (median)."""
    source = bytearray(b"\x5a") * kv_bytes
    destination = memoryview(bytearray(kv_bytes))
    destination[:] = source
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        destination[:] = source
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _phase_medians_ms(samples: list[Sample]) -> dict[str, float]:
    """Each phase's median over the samples that have it (ms)."""
    traced = [s.phases for s in samples if s.phases]
    if not traced:
        return {}
    return {phase: statistics.median(p[phase] for p in traced) * 1000 for phase in PHASES}


def _slug(phase: str) -> str:
    return "phase_" + re.sub(r"[^a-z0-9]+", "_", phase.lower()).strip("_")


def _iqr_ms(values: list[float]) -> float:
    if len(values) < 4:
        return 0.0
    quartiles = statistics.quantiles(values, n=4)
    return (quartiles[2] - quartiles[0]) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one case: default model, 512-token prompt, 3 repeats")
    parser.add_argument("--model", nargs="+", choices=["default", "bench"], default=["default", "bench"])
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[512, 2048, 4000])
    parser.add_argument(
        "--max-num-tokens", nargs="+", default=["512", "default"], help=f"tokens per step ('default': {DEFAULT_MAX_NUM_TOKENS})"
    )
    parser.add_argument("--data-plane", nargs="+", choices=["grpc", "shm"], default=["grpc", "shm"])
    parser.add_argument("--reserve", nargs="+", choices=["at_context_start", "at_admission", "at_context_done"], default=["at_context_start"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: where all three instances run")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--processes", action="store_true", help="each instance in its own process (Ray actors), as deployed")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.prompt_tokens, args.max_num_tokens, args.repeats = ["default"], [512], ["512"], 3
        args.data_plane = ["grpc"]
    for prompt_tokens in args.prompt_tokens:
        if not 0 < prompt_tokens <= MAX_SEQ_LEN - 8:
            parser.error(f"--prompt-tokens {prompt_tokens}: the built-in models hold {MAX_SEQ_LEN} positions")
    max_num_tokens = [DEFAULT_MAX_NUM_TOKENS if value == "default" else int(value) for value in args.max_num_tokens]
    cases = [
        Case(model, prompt, tokens, plane, reserve)
        for model in args.model
        for prompt in args.prompt_tokens
        for tokens in dict.fromkeys(max_num_tokens)
        for plane in args.data_plane
        for reserve in args.reserve
    ]
    rng = random.Random(0)
    figures: dict[str, object] = {
        "device": args.device, "dtype": args.dtype, "repeats": args.repeats, "processes": "one per instance" if args.processes else "one",
    }
    targets: dict[str, Target] = {}
    rows = []
    phase_rows = []
    for case in cases:
        samples, kv_bytes = asyncio.run(_run_case(case, args, rng))
        bytes_s = _bare_grpc_s(kv_bytes, 10) if case.data_plane == "grpc" else _memcpy_s(kv_bytes, 10)
        disagg, mixed = samples["disaggregated"], samples["mixed"]
        gap = {name: [s.gap_s for s in runs] for name, runs in samples.items()}
        added_ms = (statistics.median(gap["disaggregated"]) - statistics.median(gap["mixed"])) * 1000
        disagg_ttft_ms = statistics.median(s.ttft_s for s in disagg) * 1000
        mixed_ttft_ms = statistics.median(s.ttft_s for s in mixed) * 1000
        prefix = case.name
        figures.update(
            {
                f"{prefix}_handover_added_delay_ms": round(added_ms, 2),
                f"{prefix}_kv_bytes": kv_bytes,
                f"{prefix}_bytes_time_ms": round(bytes_s * 1000, 3),
                f"{prefix}_disagg_ttft_ms": round(disagg_ttft_ms, 2),
                f"{prefix}_mixed_ttft_ms": round(mixed_ttft_ms, 2),
                f"{prefix}_disagg_gap_iqr_ms": round(_iqr_ms(gap["disaggregated"]), 2),
                f"{prefix}_mixed_gap_iqr_ms": round(_iqr_ms(gap["mixed"]), 2),
                f"{prefix}_data_plane": case.data_plane,
            }
        )
        for name, runs in samples.items():
            medians = _phase_medians_ms(runs)
            for phase, value in medians.items():
                figures[f"{prefix}_{name}_{_slug(phase)}_ms"] = round(value, 2)
            phase_rows.append([case.name, name, len([s for s in runs if s.phases])] + [medians.get(phase, "-") for phase in PHASES])
        if case.prompt_tokens == 2048 and case.max_num_tokens == 512 and case.reserve == "at_context_start":
            targets[f"{prefix}_added_delay_ms"] = Target(added_ms, round(TARGET_FIXED_MS + TARGET_BYTES_FACTOR * bytes_s * 1000, 2), False)
            targets[f"{prefix}_ttft_ratio"] = Target(disagg_ttft_ms / mixed_ttft_ms, TARGET_TTFT_RATIO, False)
        rows.append(
            [
                case.model, case.prompt_tokens, case.max_num_tokens, case.data_plane, case.reserve, kv_bytes / 2**20,
                added_ms, bytes_s * 1000, _iqr_ms(gap["disaggregated"]), disagg_ttft_ms, mixed_ttft_ms,
            ]
        )
    where = "each instance in its own process" if args.processes else "every instance in this process"
    print(f"{args.dtype} on {args.device}, {where}, {args.repeats} repeats per case (medians; IQR of the disaggregated gap)")
    print_table(
        ["model", "prompt", "max tok", "plane", "reserve", "KV MiB", "added ms", "bytes ms", "gap IQR ms", "disagg TTFT ms", "mixed TTFT ms"],
        rows,
    )
    print("Where the first-to-second-token path goes (medians over the samples whose reports were all seen, ms;")
    print("the gap is hand-over + commit to step + decode + report + router to client - first token report, per sample):")
    print_table(["case", "cluster", "samples"] + list(PHASES), phase_rows)
    emit_result("handover_latency", figures, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
