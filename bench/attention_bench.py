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
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from worker.default_model import BENCH_SEED, bench_model_config, build_random_model  # noqa: E402
from worker.dense import DenseGenerator  # noqa: E402
from worker.device import DTYPE_BY_NAME  # noqa: E402
from worker.kv_cache import PagedKvCache  # noqa: E402
from worker.kv_layout import KvLayout  # noqa: E402
from worker.model_runner import ModelRunner, SequenceChunk  # noqa: E402

BENCH = "attention"
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
    warm_up = [p[:16] for p in prompts]  # first-call costs (allocator, kernel selection), cheaply
    paged.prefill(warm_up)
    dense.prefill(warm_up)
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
    parser.add_argument("--batches", default="8,32", help="decode batch sizes (full mode)")
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--cases", default="decode,prefill", help="which measurements to run")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        settings = Settings(16, 4, 2, 32, 2, 2, args.tokens_per_block)
        batches = [2, 4]
    else:
        settings = Settings(256, 7, 8, 512, 8, 2, args.tokens_per_block)
        batches = [int(b) for b in args.batches.split(",")]
    dtypes = [name.strip() for name in args.dtypes.split(",") if name.strip()]
    config = bench_model_config()
    figures: dict[str, float] = {"threads": args.threads, "tokens_per_block": args.tokens_per_block}
    rows = []
    targets: dict[str, Target] = {}
    for dtype_name in dtypes:
        model = build_random_model(config, BENCH_SEED, dtype=DTYPE_BY_NAME[dtype_name])
        with torch.inference_mode():
            cases = []
            wanted = {name.strip() for name in args.cases.split(",")}
            for batch in batches if "decode" in wanted else []:
                progress(f"{dtype_name}: decode batch {batch}, prompt {settings.prompt_len}")
                cases.append((f"decode_b{batch}_{dtype_name}", *bench_decode(model, batch, settings), DECODE_TARGET))
            if "prefill" in wanted:
                progress(f"{dtype_name}: prefill {settings.prefill_batch} x {settings.prefill_len}")
                key = f"prefill_{settings.prefill_batch}x{settings.prefill_len}_{dtype_name}"
                cases.append((key, *bench_prefill(model, settings), PREFILL_TARGET))
        for key, paged, dense, target in cases:
            figures[f"{key}_paged_tok_s"] = round(paged, 1)
            figures[f"{key}_dense_tok_s"] = round(dense, 1)
            figures[f"{key}_ratio"] = round(paged / dense, 3)
            rows.append((key, round(paged, 1), round(dense, 1), paged / dense))
            targets[f"{key}_ratio"] = Target(paged / dense, target, higher_is_better=True)
    print_table(("case", "paged tok/s", "dense tok/s", "paged/dense"), rows)
    emit_result(BENCH, figures, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
