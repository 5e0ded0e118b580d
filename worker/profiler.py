"""`duet profile`: measure this machine's engine and fit a step-time profile (cluster/sim/profile.py).

The engine runs as it serves (worker/engine.py, the scheduler, the sampler), with its runner wrapped
through the engine's `runner_factory` seam so that each step's batch is known: context tokens,
attended (query, key) pairs of the context chunks, generation requests, and their summed context
length. Each `Engine.step` is timed whole, so the fitted overhead holds the scheduler, the sampler
and the output bookkeeping as well as the forward pass's fixed cost. Experiments:

- prefill: one request of N prompt tokens (N over `prefill_lengths`), one output token;
- prefill on a cached prefix: a prompt of C tokens, then one of the same C and N more, whose context
  chunk is the N (C, N over `cached_prefills`): what a chunk pays per token of the cache it attends;
- decode: B requests of context L (B over `decode_batches`, L over `decode_contexts`), a few
  output tokens each, so most steps are pure decode;
- hand-over control path: a one-block KV push to a receiver process on 127.0.0.1 (worker/kv_transfer/),
  median of several over a warm connection: Prepare, one chunk, Commit.

The fit is relative least squares of step_s = overhead + a x context tokens + b x pairs + c x decode requests
+ d x decode context tokens + e if the step runs any context + f x cached tokens the context chunks
attend, with coefficients held at >= 0, trimmed of the worst-fitting steps (`fit`). The result is a plain dict in the profile format (the cluster side reads it; worker
never imports cluster).
"""

from __future__ import annotations

import json
import logging
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine import Engine
from worker.engine_types import EngineConfig
from worker.json_lines import JsonLinesFile
from worker.model_runner import ModelRunner, SequenceChunk
from worker.protocol import RequestType, SubmitRequest
from worker.sampling import SamplingParams

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "duet.step_profile.v1"  # cluster/sim/profile.py PROFILE_FORMAT
COLUMNS = (
    "step_overhead_s", "prefill_s_per_token", "prefill_s_per_token_pair", "decode_s_per_sequence", "decode_s_per_context_token",
    "context_step_s", "prefill_s_per_cached_token",
)


@dataclass(frozen=True)
class StepSample:
    context_tokens: int
    context_pairs: int
    decode_sequences: int
    decode_context_tokens: int
    step_s: float
    # Tokens already in the cache that the step's context chunks attend (a chunk after the first of
    # its prompt, or one after a reused prefix): each such chunk reads their K/V out of the paged
    # cache, layer by layer (worker/attention.py). 0 in step logs written before it was recorded.
    context_cached_tokens: int = 0

    def row(self) -> list[float]:
        return [
            1.0, self.context_tokens, self.context_pairs, self.decode_sequences, self.decode_context_tokens,
            float(self.context_tokens > 0), self.context_cached_tokens,
        ]


@dataclass(frozen=True)
class ProfilePlan:
    prefill_lengths: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    cached_prefills: tuple[tuple[int, int], ...] = ((512, 32), (512, 256), (1024, 64), (256, 128))  # (cached, new) tokens
    decode_batches: tuple[int, ...] = (1, 4, 8, 16, 32)
    decode_contexts: tuple[int, ...] = (64, 256, 768)
    decode_tokens: int = 6
    repeats: int = 2
    handover_pushes: int = 20

    @classmethod
    def quick(cls) -> ProfilePlan:
        return cls((32, 128), ((128, 32),), (1, 4), (64,), 4, 1, 3)


class _BatchRecorder:
    """The engine's runner, wrapped: records each forward's batch shape (the seam's one use here)."""

    def __init__(self, model, kv_cache) -> None:
        self.inner = ModelRunner(model, kv_cache)
        self.last: tuple[int, int, int, int, int] | None = None  # StepSample's batch fields, in its order but step_s

    def forward(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        ctx = pairs = seqs = ctx_tokens = cached = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if n == 1 and chunk.num_cached_tokens > 0 and chunk.want_logits:
                seqs += 1
                ctx_tokens += chunk.num_cached_tokens + 1
            else:
                ctx += n
                pairs += n * chunk.num_cached_tokens + n * (n + 1) // 2
                cached += chunk.num_cached_tokens
        self.last = (ctx, pairs, seqs, ctx_tokens, cached)
        return self.inner.forward(chunks)


class StepLog:
    """A served instance's steps, one JSON line each (worker/instance.py, InstanceSpec.step_log):
    `{"t": wall-clock end, "ctx": context tokens, "pairs": attended pairs, "seqs": generation
    requests, "dctx": their context tokens, "cached": cached tokens the context chunks attend, "s":
    seconds of Engine.step, "loop_s": seconds from the
    step's start until its outputs, load and pushes were handed on (the step as the loop runs it)}`. The instance passes
    `runner_factory` to its engine and calls `record` after each step; a step without a forward
    pass writes nothing."""

    def __init__(self, path: str | Path) -> None:
        self._lines = JsonLinesFile(path)
        self.path = self._lines.path
        self.recorder: _BatchRecorder | None = None

    def runner_factory(self, model, kv_cache) -> _BatchRecorder:
        self.recorder = _BatchRecorder(model, kv_cache)
        return self.recorder

    def record(self, step_s: float, loop_s: float) -> None:
        recorder = self.recorder
        if recorder is None or recorder.last is None:
            return
        ctx, pairs, seqs, ctx_tokens, cached = recorder.last
        recorder.last = None
        self._lines.write({
            "t": round(time.time(), 6), "ctx": ctx, "pairs": pairs, "seqs": seqs, "dctx": ctx_tokens, "cached": cached,
            "s": round(step_s, 7), "loop_s": round(loop_s, 7),
        })

    def close(self) -> None:
        self._lines.close()


def read_step_log(path: str | Path, seconds: str = "loop_s") -> list[tuple[float, StepSample]]:
    """Each step of one StepLog file, in file order, with the wall-clock time it ended, timed by its
    `seconds` field ("loop_s": the step as the loop runs it; "s": Engine.step alone). A line that
    does not parse (cut by a kill) is skipped."""
    steps = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            steps.append((float(record["t"]), StepSample(
                record["ctx"], record["pairs"], record["seqs"], record["dctx"], float(record[seconds]), record.get("cached", 0),
            )))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def read_step_logs(paths: Iterable[str | Path], seconds: str = "loop_s", since_s: float = 0.0) -> list[StepSample]:
    """The steps of StepLog files that ended at or after wall-clock `since_s` (`read_step_log`)."""
    return [sample for path in paths for ended_s, sample in read_step_log(path, seconds) if ended_s >= since_s]


def _engine(model, tokenizer, recorder_box: list) -> Engine:
    def factory(m, cache):
        recorder = _BatchRecorder(m, cache)
        recorder_box.append(recorder)
        return recorder

    config = EngineConfig(num_blocks=4096, max_num_tokens=2048, chunk_unit_tokens=1024, max_batch_size=64, max_num_requests=64)
    return Engine(model, tokenizer, config, runner_factory=factory)


def _run(engine: Engine, recorder: _BatchRecorder, prompts: list[list[int]], max_tokens: int, tag: str, samples: list[StepSample]) -> None:
    for index, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=index)
        engine.add_request(SubmitRequest(f"{tag}-{index}", tuple(prompt), params, RequestType.CONTEXT_AND_GENERATION))
    while engine.num_requests:
        recorder.last = None
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        if recorder.last is not None:
            ctx, pairs, seqs, ctx_tokens, cached = recorder.last
            samples.append(StepSample(ctx, pairs, seqs, ctx_tokens, elapsed, cached))


def measure_steps(model, tokenizer, plan: ProfilePlan, progress: Callable[[str], None] = lambda _m: None) -> list[StepSample]:
    box: list[_BatchRecorder] = []
    engine = _engine(model, tokenizer, box)
    recorder = box[0]
    vocab = min(int(tokenizer.vocab_size), 256)
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        # Drawn, so that no prompt meets another's blocks in the prefix cache (it is on: the cached
        # prefills need it) unless it is meant to.
        return [rng.randrange(1, vocab) for _ in range(length)]

    samples: list[StepSample] = []
    warm: list[StepSample] = []
    _run(engine, recorder, [prompt(64), prompt(64)], 4, "warm", warm)
    for repeat in range(plan.repeats):
        for length in plan.prefill_lengths:
            progress(f"prefill {length} tokens (repeat {repeat + 1})")
            _run(engine, recorder, [prompt(length)], 1, f"p{repeat}-{length}", samples)
        for cached, new in plan.cached_prefills:
            progress(f"prefill {new} tokens on {cached} cached (repeat {repeat + 1})")
            prefix = prompt(cached)
            # Into the cache, a block past it: a prompt's last block is not kept for reuse.
            _run(engine, recorder, [prefix + prompt(engine.config.tokens_per_block)], 1, f"c{repeat}-{cached}-{new}-prefix", warm)
            _run(engine, recorder, [prefix + prompt(new)], 1, f"c{repeat}-{cached}-{new}", samples)
        for context in plan.decode_contexts:
            for batch in plan.decode_batches:
                progress(f"decode batch {batch} at context {context} (repeat {repeat + 1})")
                _run(engine, recorder, [prompt(context) for _ in range(batch)], plan.decode_tokens, f"d{repeat}-{context}-{batch}", samples)
    return samples


def _nnls(rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Least squares with coefficients >= 0: a negative one is dropped and the rest refitted."""
    # A column that is zero in every row (no step of that kind was measured) stays at 0: left in, it
    # makes the system rank-deficient, which LAPACK's solver does not always survive.
    active = [c for c in range(rows.shape[1]) if bool(rows[:, c].abs().max() > 0)]
    # Columns scaled to unit size so that the tiny per-pair coefficient is not lost to conditioning.
    scale = rows.abs().amax(dim=0).clamp(min=1e-12)
    coefficients = torch.zeros(rows.shape[1], dtype=torch.float64)
    while active:
        solution = torch.linalg.lstsq(rows[:, active] / scale[active], target.unsqueeze(1)).solution.squeeze(1) / scale[active]
        negative = [active[i] for i, value in enumerate(solution.tolist()) if value < 0]
        if not negative:
            coefficients[active] = solution
            break
        active = [c for c in active if c not in negative]
    return coefficients


def fit(
    samples: Sequence[StepSample], trim_fraction: float = 0.15, *, mean: bool = False, without: Iterable[str] = (),
) -> tuple[dict[str, float], dict[str, float]]:
    """Relative least squares (each step weighted by 1 / its time, so a 1 ms decode step counts as
    much as a 100 ms prefill), non-negative; then the `trim_fraction` worst-fitting steps (another
    process took the core: shared machines) are dropped and the fit is redone.

    `mean`: weight each step by 1 / the fit's prediction instead (refitted a few times), so that the
    model meets the mean time of steps of one shape rather than their typical one. Weighting by the
    observed time favours the fast steps: right for an engine alone on its cores, but in a deployment
    whose instances share the cores the slow steps are part of what a queue waits for (fit steps
    logged as deployed with `mean=True, trim_fraction=0`).

    `without`: COLUMNS held at 0 (the steps cannot tell them from the others)."""
    rows = torch.tensor([s.row() for s in samples], dtype=torch.float64)
    for name in without:
        rows[:, COLUMNS.index(name)] = 0.0  # a column of zeros stays at 0 (_nnls)
    target = torch.tensor([s.step_s for s in samples], dtype=torch.float64)
    weights = 1.0 / target
    coefficients = _nnls(rows * weights.unsqueeze(1), target * weights)
    relative = ((rows @ coefficients - target).abs() / target)
    keep = relative.argsort()[: max(len(COLUMNS) + 1, int(len(samples) * (1 - trim_fraction)))]
    coefficients = _nnls(rows[keep] * weights[keep].unsqueeze(1), target[keep] * weights[keep])
    if mean:
        for _ in range(4):
            weights = 1.0 / (rows @ coefficients).clamp(min=1e-6)
            coefficients = _nnls(rows[keep] * weights[keep].unsqueeze(1), target[keep] * weights[keep])
    relative = ((rows @ coefficients - target).abs() / target).tolist()
    kept = sorted(relative[i] for i in keep.tolist())
    quality = {
        "samples": len(samples),
        "samples_kept": len(kept),
        "median_relative_error": statistics.median(relative),
        "median_relative_error_kept": statistics.median(kept),
        "p90_relative_error_kept": kept[int(0.9 * (len(kept) - 1))],
    }
    return dict(zip(COLUMNS, coefficients.tolist(), strict=True)), quality


def measure_handover_fixed_s(pushes: int) -> float:
    """Median seconds of a one-block push (Prepare, one chunk, Commit) to a receiver process on 127.0.0.1."""
    from worker.kv_layout import KvLayout
    from worker.kv_transfer.buffers import LinearKvBuffer
    from worker.kv_transfer.config import SenderConfig
    from worker.kv_transfer.ids import new_transfer_id
    from worker.kv_transfer.sender import KvSender
    from worker.kv_transfer.testing import ReceiverProcess

    layout = KvLayout(1, 1, 8, 16, "float32", "profile")
    times = []
    with ReceiverProcess() as receiver, KvSender(SenderConfig(num_streams=1, num_connections=1)) as sender:
        for index in range(pushes + 2):
            source = LinearKvBuffer(layout, 1, bytearray(layout.run_bytes(1, 1)))
            transfer_id = new_transfer_id()
            receiver.expect(transfer_id, f"profile-{index}", layout, 1)
            started = time.perf_counter()
            outcome = sender.push(receiver.address, transfer_id, f"profile-{index}", source, deadline_s=30.0)
            elapsed = time.perf_counter() - started
            if not outcome.ok:
                raise RuntimeError(f"the hand-over probe failed: {outcome.failure}")
            if index >= 2:  # the first pushes open the connection
                times.append(elapsed)
    return statistics.median(times)


def profile_document(
    model, tokenizer, *, name: str, model_name: str, plan: ProfilePlan, progress: Callable[[str], None] = lambda _m: None
) -> dict:
    samples = measure_steps(model, tokenizer, plan, progress)
    coefficients, quality = fit(samples)
    progress("hand-over control path")
    handover_s = measure_handover_fixed_s(plan.handover_pushes)
    config = model.config
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.empty((), dtype=model.dtype).element_size()
    device = str(model.device)
    if model.device.type == "cpu":
        device = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"
    return {
        "format": PROFILE_FORMAT,
        "name": name,
        "source": "measured",
        "device": device,
        "model": model_name,
        **coefficients,
        "handover_fixed_s": handover_s,
        "kv_bytes_per_token": int(kv_bytes),
        "combine": "sum",
        "notes": "measured by duet profile (worker/profiler.py)",
        "fit": {
            **quality,
            "dtype": str(model.dtype).removeprefix("torch."),
            "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in plan.__dict__.items()},
            # context tokens, context pairs, decode sequences, their context tokens, seconds, cached tokens
            "samples_table": [
                [s.context_tokens, s.context_pairs, s.decode_sequences, s.decode_context_tokens, round(s.step_s, 7), s.context_cached_tokens]
                for s in samples
            ],
        },
    }
