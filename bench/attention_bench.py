"""Paged ModelRunner vs the dense bare-torch baseline on the benchmark model (8 layers, hidden 512).

Measures, side by side in one process and interleaved round by round (these machines are noisy):
  * decode tokens/s at batch 8 and 32 (one token per sequence per step, contexts growing from the
    prompt length), paged (shuffled block tables) vs dense (contiguous preallocated cache);
  * prefill tokens/s of 8 x 512-token prompts, paged (8 fresh chunks in one step) vs dense ([8, 512]).
for bf16 and fp32. Prints a table, progress on stderr, and as the last stdout line one JSON object.

    .venv/bin/python bench/attention_bench.py [--quick] [--threads N] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from worker.default_model import BENCH_SEED, bench_model_config, build_random_model
from worker.dense import DenseGenerator
from worker.device import DTYPE_BY_NAME
from worker.kv_cache import PagedKvCache
from worker.kv_layout import KvLayout
from worker.model_runner import ModelRunner, SequenceChunk

DECODE_TARGET = 0.8  # the engine must reach this fraction of the dense loop; the runner alone should exceed it
PREFILL_TARGET = 0.9


@dataclass(frozen=True)
class Settings:
    prompt_len: int
    rounds: int
    steps_per_round: int
    prefill_len: int
    prefill_batch: int
    prefill_rounds: int
    tokens_per_block: int


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class PagedSide:
    def __init__(self, model, batch: int, max_len: int, tpb: int, seed: int) -> None:
        config = model.config
        layout = KvLayout(
            config.num_layers, config.num_kv_heads, config.head_dim, tpb, str(model.dtype).removeprefix("torch."), "bench"
        )
        per_seq = -(-max_len // tpb)
        self.runner = ModelRunner(model, PagedKvCache(layout, per_seq * batch + 8))
        blocks = list(range(per_seq * batch + 8))
        random.Random(seed).shuffle(blocks)  # fragmented, non-contiguous tables as a block manager gives
        self.tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
        self.length = 0

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        logits = self.runner.forward([SequenceChunk(p, 0, t, True) for p, t in zip(prompts, self.tables, strict=True)])
        self.length = len(prompts[0])
        return logits

    def decode(self, tokens: list[int]) -> torch.Tensor:
        logits = self.runner.forward(
            [SequenceChunk([tok], self.length, table, True) for tok, table in zip(tokens, self.tables, strict=True)]
        )
        self.length += 1
        return logits


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


def bench_decode(model, batch: int, settings: Settings) -> tuple[float, float]:
    """Median tokens/s over interleaved rounds: (paged, dense)."""
    max_len = settings.prompt_len + settings.rounds * settings.steps_per_round + 1
    prompts = prompts_for(batch, settings.prompt_len, model.config.vocab_size, batch)
    paged = PagedSide(model, batch, max_len, settings.tokens_per_block, seed=batch)
    dense = DenseGenerator(model, batch, max_len)
    paged_tokens = paged.prefill(prompts).argmax(dim=-1).tolist()
    dense_tokens = dense.prefill(prompts).argmax(dim=-1)
    paged_rates, dense_rates = [], []
    for round_index in range(settings.rounds):
        start = time.perf_counter()
        for _ in range(settings.steps_per_round):
            paged_tokens = paged.decode(paged_tokens).argmax(dim=-1).tolist()
        paged_rates.append(batch * settings.steps_per_round / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(settings.steps_per_round):
            dense_tokens = dense.decode_step(dense_tokens).argmax(dim=-1)
        dense_rates.append(batch * settings.steps_per_round / (time.perf_counter() - start))
        progress(f"  decode b{batch} round {round_index}: paged {paged_rates[-1]:.0f} tok/s, dense {dense_rates[-1]:.0f} tok/s")
    return statistics.median(paged_rates), statistics.median(dense_rates)


def bench_prefill(model, settings: Settings) -> tuple[float, float]:
    batch, length = settings.prefill_batch, settings.prefill_len
    prompts = prompts_for(batch, length, model.config.vocab_size, 99)
    paged_rates, dense_rates = [], []
    paged = PagedSide(model, batch, length, settings.tokens_per_block, seed=5)
    dense = DenseGenerator(model, batch, length)
    paged.prefill(prompts)  # warm-up (allocations, kernel selection)
    dense.prefill(prompts)
    for round_index in range(settings.prefill_rounds):
        start = time.perf_counter()
        paged.prefill(prompts)
        paged_rates.append(batch * length / (time.perf_counter() - start))
        start = time.perf_counter()
        dense.prefill(prompts)
        dense_rates.append(batch * length / (time.perf_counter() - start))
        progress(f"  prefill round {round_index}: paged {paged_rates[-1]:.0f} tok/s, dense {dense_rates[-1]:.0f} tok/s")
    return statistics.median(paged_rates), statistics.median(dense_rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few seconds: tiny rounds, short prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--tokens-per-block", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        settings = Settings(32, 2, 2, 64, 2, 2, args.tokens_per_block)
    else:
        settings = Settings(256, 7, 8, 512, 8, 5, args.tokens_per_block)
    dtypes = [name.strip() for name in args.dtypes.split(",") if name.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    config = bench_model_config()
    figures: dict[str, float] = {}
    rows = []
    for dtype_name in dtypes:
        model = build_random_model(config, BENCH_SEED, dtype=DTYPE_BY_NAME[dtype_name])
        with torch.inference_mode():
            for batch in batches:
                progress(f"{dtype_name}: decode batch {batch}")
                paged, dense = bench_decode(model, batch, settings)
                key = f"decode_b{batch}_{dtype_name}"
                figures[f"{key}_paged_tok_s"] = round(paged, 1)
                figures[f"{key}_dense_tok_s"] = round(dense, 1)
                figures[f"{key}_ratio"] = round(paged / dense, 3)
                rows.append((key, paged, dense))
            progress(f"{dtype_name}: prefill {settings.prefill_batch} x {settings.prefill_len}")
            paged, dense = bench_prefill(model, settings)
            key = f"prefill_{settings.prefill_batch}x{settings.prefill_len}_{dtype_name}"
            figures[f"{key}_paged_tok_s"] = round(paged, 1)
            figures[f"{key}_dense_tok_s"] = round(dense, 1)
            figures[f"{key}_ratio"] = round(paged / dense, 3)
            rows.append((key, paged, dense))

    print(f"{'case':<32} {'paged tok/s':>12} {'dense tok/s':>12} {'ratio':>7}")
    for key, paged, dense in rows:
        print(f"{key:<32} {paged:>12.0f} {dense:>12.0f} {paged / dense:>7.3f}")
    targets = {}
    for key, _, _ in rows:
        target = DECODE_TARGET if key.startswith("decode") else PREFILL_TARGET
        value = figures[f"{key}_ratio"]
        targets[f"{key}_ratio"] = {"value": value, "target": target, "met": value >= target}
    print(json.dumps({"bench": "attention", "figures": figures, "targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
