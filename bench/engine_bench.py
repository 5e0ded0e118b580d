"""Engine throughput against a bare torch loop over the same model, side by side in one run.

Subject: the engine (scheduler, paged KV cache, sampler, detokenizer, stop checks included).
Baseline: a bare loop over the same model weights with a dense, preallocated KV cache and argmax
(worker.dense.DenseGenerator): no scheduler, no paging. Both greedy, both on the same device (the
CPU unless --device says otherwise), same thread count, same batch and lengths:

- decode at batch 8 and 32 (prompts of 256 tokens, 32 decode steps timed after the prefill);
- prefill of 8 x 512-token prompts (one forward step each side).

Models: the embedded default (tiny) and an 8-layer, hidden-512 one, in bf16 (and fp32 with --fp32).
The timed runs repeat the warm-up's shapes. On CUDA both sides run with cuDNN's SDPA kernel off (as
engines set it: worker.attention.disable_cudnn_attention), and it also runs decode on fresh shapes
(prompt lengths no earlier run had, as in serving) with cuDNN's kernel on (torch's default choice)
against off (duet's), interleaved.
Targets, on the 8-layer model: engine/bare >= 0.8 for decode at batch 32 and >= 0.9 for prefill.
It also reports the share of a decode step the scheduler takes.

    python bench/engine_bench.py [--quick] [--threads N] [--device cuda]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from worker.attention import disable_cudnn_attention  # noqa: E402
from worker.default_model import BENCH_SEED, bench_model_config, build_default_model, build_random_model  # noqa: E402
from worker.dense import DenseGenerator  # noqa: E402
from worker.device import resolve_device  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.engine_types import EngineConfig  # noqa: E402
from worker.protocol import SubmitRequest  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402
from worker.tokenizer import ByteTokenizer  # noqa: E402


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(batch)]


def _sync() -> None:
    """Wait for queued device work, so that a timer starts on an idle GPU (a no-op on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bare_decode(model, prompts, steps: int) -> float:
    """Seconds for `steps` decode steps of the whole batch (after an untimed prefill)."""
    generator = DenseGenerator(model, len(prompts), len(prompts[0]) + steps + 1)
    logits = generator.prefill(prompts)
    token = logits.argmax(dim=-1)
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        token = generator.decode_step(token).argmax(dim=-1)
        token.tolist()  # the engine hands tokens to Python every step; so does the baseline
    return time.perf_counter() - start


def _engine(model, tokenizer, batch: int, length: int) -> Engine:
    config = EngineConfig(
        num_blocks=batch * ((length + 64) // 16 + 2),
        tokens_per_block=16,
        max_num_requests=batch,
        max_batch_size=batch,
        max_num_tokens=max(batch * length, 512),
        chunk_unit_tokens=512,
        enable_prefix_reuse=False,
        record_prefix_events=False,
    )
    return Engine(model, tokenizer, config)


class _TimedScheduler:
    """Wraps the engine's scheduler to measure its share of each step."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.config = inner.config
        self.seconds = 0.0

    def schedule(self, active, inflight_ids=()):
        start = time.perf_counter()
        try:
            return self.inner.schedule(active, inflight_ids)
        finally:
            self.seconds += time.perf_counter() - start


def _prefilled_engine(model, tokenizer, prompts, steps: int) -> Engine:
    """An engine holding `prompts`, prefilled (untimed) and ready for `steps` decode steps."""
    engine = _engine(model, tokenizer, len(prompts), len(prompts[0]) + steps + 2)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(SubmitRequest(f"d{index}", tuple(prompt), params))
    while engine.num_forward_tokens < len(prompts) * len(prompts[0]):
        engine.step()
    return engine


def engine_decode(model, tokenizer, prompts, steps: int) -> tuple[float, float]:
    """(seconds for `steps` engine steps of pure decode, scheduler seconds within them)."""
    engine = _prefilled_engine(model, tokenizer, prompts, steps)
    engine.step()  # first decode step (untimed warm-up)
    timed = _TimedScheduler(engine.scheduler)
    engine.scheduler = timed
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    return elapsed, timed.seconds


def bare_prefill(model, prompts) -> float:
    generator = DenseGenerator(model, len(prompts), len(prompts[0]) + 1)
    _sync()
    start = time.perf_counter()
    generator.prefill(prompts).argmax(dim=-1).tolist()
    return time.perf_counter() - start


def engine_prefill(model, tokenizer, prompts) -> float:
    engine = _engine(model, tokenizer, len(prompts), len(prompts[0]) + 2)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(SubmitRequest(f"p{index}", tuple(prompt), params))
    _sync()
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def fresh_shape_decode_s(model, tokenizer, batch: int, prompt_len: int, steps: int, cudnn_on: bool) -> float:
    """Seconds per engine decode step on lengths no earlier run used (per-shape setup included), with
    cuDNN's SDPA kernel on or off for those steps."""
    engine = _prefilled_engine(model, tokenizer, _prompts(batch, prompt_len, seed=prompt_len), steps)
    torch.backends.cuda.enable_cudnn_sdp(cudnn_on)  # after the engine turned it off; only decode is timed
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    return (time.perf_counter() - start) / steps


def compare_sdpa_choice(model, tokenizer, batch: int, steps: int, rounds: int) -> tuple[float, float]:
    """(cuDNN's SDPA kernel on, off) median seconds per fresh-shape decode step, interleaved round by round."""
    seconds: dict[bool, list[float]] = {True: [], False: []}
    prompt_len = 200
    try:
        for _ in range(rounds):
            for cudnn_on in (True, False):
                prompt_len += steps + 7  # past every length an earlier run decoded through
                seconds[cudnn_on].append(fresh_shape_decode_s(model, tokenizer, batch, prompt_len, steps, cudnn_on))
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)
    return statistics.median(seconds[True]), statistics.median(seconds[False])


def _median(fn, repeats: int) -> float:
    fn()  # warm-up: first calls pay for kernel selection and allocations
    return statistics.median(fn() for _ in range(repeats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, short runs (CI smoke)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="run in float32 instead of bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (both sides run there)")
    args = parser.parse_args()
    device = resolve_device(args.device)
    if device.type == "cuda":
        disable_cudnn_attention()  # what the engine sets; the bare loop runs under the same kernels
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    repeats = 1 if args.quick else 3
    decode_steps = 8 if args.quick else 32
    decode_prompt = 64 if args.quick else 256
    prefill_len = 128 if args.quick else 512

    tokenizer = ByteTokenizer()
    models = {"tiny": build_default_model(dtype=dtype, device=str(device))[0]}
    if not args.quick:
        models["8L-512"] = build_random_model(bench_model_config(), BENCH_SEED, dtype=dtype, device=device)

    rows = []
    figures: dict[str, float | str] = {}
    targets: dict[str, Target] = {}
    with torch.inference_mode():
        for name, model in models.items():
            for batch in (8, 32):
                progress(f"engine_bench: {name} decode batch {batch} ...")
                prompts = _prompts(batch, decode_prompt, seed=batch)
                bare_s = _median(lambda prompts=prompts, model=model: bare_decode(model, prompts, decode_steps), repeats)
                engine_decode(model, tokenizer, prompts, decode_steps)  # warm-up
                results = [engine_decode(model, tokenizer, prompts, decode_steps) for _ in range(repeats)]
                engine_s = statistics.median(r[0] for r in results)
                sched_share = statistics.median(r[1] / r[0] for r in results)
                tokens = batch * decode_steps
                ratio = bare_s / engine_s
                key = f"{name}_decode_b{batch}"
                figures[f"{key}_engine_tok_s"] = round(tokens / engine_s, 1)
                figures[f"{key}_bare_tok_s"] = round(tokens / bare_s, 1)
                figures[f"{key}_ratio"] = round(ratio, 3)
                figures[f"{key}_scheduler_share"] = round(sched_share, 4)
                rows.append([name, f"decode b={batch}", tokens / bare_s, tokens / engine_s, ratio, f"{100 * sched_share:.1f}%"])
                if name == "8L-512" and batch == 32:
                    targets["8L-512_decode_b32_engine_over_bare"] = Target(ratio, 0.8, True)
            progress(f"engine_bench: {name} prefill 8 x {prefill_len} ...")
            prompts = _prompts(8, prefill_len, seed=1)
            bare_s = _median(lambda prompts=prompts, model=model: bare_prefill(model, prompts), repeats)
            engine_s = _median(lambda prompts=prompts, model=model: engine_prefill(model, tokenizer, prompts), repeats)
            tokens = 8 * prefill_len
            ratio = bare_s / engine_s
            figures[f"{name}_prefill_engine_tok_s"] = round(tokens / engine_s, 1)
            figures[f"{name}_prefill_bare_tok_s"] = round(tokens / bare_s, 1)
            figures[f"{name}_prefill_ratio"] = round(ratio, 3)
            rows.append([name, f"prefill 8x{prefill_len}", tokens / bare_s, tokens / engine_s, ratio, "-"])
            if name == "8L-512":
                targets["8L-512_prefill_engine_over_bare"] = Target(ratio, 0.9, True)

        if device.type == "cuda":
            sdpa_rows = []
            for name, model in models.items():
                progress(f"engine_bench: {name} decode batch 32 on fresh shapes, torch's SDPA choice vs duet's ...")
                torch_s, duet_s = compare_sdpa_choice(model, tokenizer, 32, decode_steps, rounds=2)
                figures[f"{name}_fresh_shapes_decode_b32_torch_sdpa_ms"] = round(torch_s * 1000, 3)
                figures[f"{name}_fresh_shapes_decode_b32_duet_sdpa_ms"] = round(duet_s * 1000, 3)
                figures[f"{name}_fresh_shapes_decode_b32_speedup"] = round(torch_s / duet_s, 3)
                sdpa_rows.append([name, torch_s * 1000, duet_s * 1000, torch_s / duet_s])

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"dtype {str(dtype).replace('torch.', '')}, {args.threads} torch threads, {where}")
    figures["device"] = where
    print_table(["model", "workload", "bare tok/s", "engine tok/s", "engine/bare", "scheduler share"], rows)
    if device.type == "cuda":
        print("\ndecode b=32 on fresh shapes (ms per step): torch's SDPA kernel choice vs duet's (no cuDNN)")
        print_table(["model", "torch choice", "duet", "speed-up"], sdpa_rows)
    emit_result("engine_bench", figures, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
