"""Turns a batch of logits into one token per request, with vLLM's processing order.

Order per row: penalties (repetition over prompt+output, then frequency and presence over the
output), min_tokens (EOS and stop ids masked until `min_tokens` tokens exist), then for greedy
rows the argmax; for random rows temperature, top-k, top-p, min-p and a draw.

The draw is the Gumbel-max trick with noise from a CPU `torch.Generator` seeded by
`noise_seed(seed, output_position)`, generated on the CPU and moved to the logits' device. A token
therefore depends only on (logits row, params, seed, output position): never on the batch it
shares, the row order, the step, or the instance. To keep the noise cheap for large vocabularies
the draw is hierarchical: the vocabulary is cut into blocks of `noise_block_size` tokens, a block is
drawn by Gumbel-max over the blocks' log-sum-exp (its probability mass), then a token by Gumbel-max
inside that block. That is exactly the categorical distribution, with about V/B + B random numbers
per row instead of V (~380 instead of 32000 for a 32k vocabulary). The block size is part of the
stream's definition: every instance serving a model must use the same one (the default).

Logprobs (`LogprobsMode`): RAW (the default, as vLLM) is the log-softmax of the logits as the
model produced them, before penalties, temperature and truncation. PROCESSED is the log-softmax of
the distribution actually sampled from: after penalties, min_tokens, temperature (random rows only;
greedy rows skip it) and the top-k/top-p/min-p masks, so masked tokens have -inf.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.sampler_types import SampleLogprobs, TokenLogprob
from worker.sampling import SamplingParams

__all__ = ["SampleLogprobs", "SampleResult", "SampleRow", "Sampler", "SamplerError", "TokenLogprob"]

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
DEFAULT_NOISE_BLOCK_SIZE = 256


class SamplerError(RuntimeError):
    """Rows could not be sampled (NaN logits, or every token masked); `.row_indices` names them."""

    def __init__(self, message: str, row_indices: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.row_indices = tuple(row_indices)


class LogprobsMode(enum.Enum):
    RAW = "raw"
    PROCESSED = "processed"


def splitmix64(value: int) -> int:
    """One step of SplitMix64 (Steele et al.): a stable 64-bit mixer, identical in every process."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def noise_seed(seed: int, output_position: int) -> int:
    """The generator seed for the token at `output_position` of a request seeded with `seed`."""
    return splitmix64(splitmix64(seed & _MASK64) ^ (output_position & _MASK64))


@dataclass(frozen=True)
class SampleRow:
    """One request's row of the logits batch.

    `output_position` is the 0-based index of the token being sampled; it must equal
    len(output_token_ids), because presence/frequency penalties and min_tokens are defined over
    exactly those tokens (a recomputed request keeps its outputs here, not in the prompt).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    output_position: int

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(self.params).__name__}")
        if not isinstance(self.output_position, int) or self.output_position < 0:
            raise ValueError(f"output_position must be a non-negative int, got {self.output_position!r}")
        if self.output_position != len(self.output_token_ids):
            raise ValueError(
                f"output_position {self.output_position} != len(output_token_ids) "
                f"{len(self.output_token_ids)}"
            )
        if not self.params.greedy and self.params.seed is None:
            raise ValueError("a non-greedy row needs a seed (the engine assigns one at admission)")


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    # One entry per row: None where the row's params.logprobs is None.
    logprobs: list[SampleLogprobs | None]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's `apply_penalties`, in place on `logits` [M, V] (and returned).

    Repetition (over prompt and output tokens): positive logits are divided by the penalty,
    non-positive ones multiplied. Then frequency (times the count in the output) and presence
    (once if in the output) are subtracted.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    prompt_counts = _token_counts(prompt_token_ids, num_rows, vocab_size, device)
    output_counts = _token_counts(output_token_ids, num_rows, vocab_size, device)
    output_mask = output_counts > 0
    seen = (prompt_counts > 0) | output_mask
    rep = torch.where(seen, repetition_penalties.unsqueeze(1), torch.ones_like(logits))
    logits.copy_(torch.where(logits > 0, logits / rep, logits * rep))
    logits -= frequency_penalties.unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= presence_penalties.unsqueeze(1) * output_mask.to(logits.dtype)
    return logits


def _token_counts(
    token_lists: Sequence[Sequence[int]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab_size] counts; a padding column at index vocab_size absorbs the padding."""
    max_len = max((len(ids) for ids in token_lists), default=0)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int64, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    padded = torch.full((num_rows, max_len), vocab_size, dtype=torch.int64)
    for row, ids in enumerate(token_lists):
        if len(ids):
            if min(ids) < 0 or max(ids) >= vocab_size:
                raise SamplerError(f"token ids outside the vocabulary of {vocab_size}")
            padded[row, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64)
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf, in place on `logits` [M, V], what top-k then top-p remove.

    top_k [M] int64 (>= V for "off") keeps every token >= the k-th largest value (ties kept, as
    vLLM); top_p [M] float (inf for "off") keeps the smallest most-likely set whose mass reaches p
    (the top token always), measured after top-k. A full sort of the vocabulary is slow on a CPU,
    so top-p first looks at the TOP_P_CANDIDATES most likely tokens and sorts a whole row only when
    those do not reach p; which path a row takes depends on that row alone.
    """
    num_rows, vocab_size = logits.shape
    k = top_k.clamp(1, vocab_size)
    k_on = torch.where(k < vocab_size, k, torch.zeros_like(k))
    k_max = int(k_on.max())
    if k_max > 0:
        top_vals = logits.topk(k_max, dim=-1).values
        kth = top_vals.gather(1, (k_on.clamp(min=1) - 1).unsqueeze(1))
        kth = torch.where(k_on.unsqueeze(1) > 0, kth, torch.full_like(kth, -math.inf))
        logits.masked_fill_(logits < kth, -math.inf)
    p_rows = torch.nonzero(torch.isfinite(top_p)).squeeze(1)
    if p_rows.numel() == 0:
        return logits
    sub = logits[p_rows]
    p = top_p[p_rows].unsqueeze(1)
    probs = sub.softmax(dim=-1)
    num_candidates = min(vocab_size, TOP_P_CANDIDATES)
    cand_probs, cand_idx = probs.topk(num_candidates, dim=-1)
    cand_mass_before = cand_probs.cumsum(dim=-1) - cand_probs
    covered = (cand_mass_before[:, -1] + cand_probs[:, -1] >= p.squeeze(1)) | (num_candidates == vocab_size)
    keep = torch.zeros_like(sub, dtype=torch.bool)
    keep.scatter_(1, cand_idx, _keep_sorted(cand_mass_before, p))
    uncovered = torch.nonzero(~covered).squeeze(1)
    if uncovered.numel() > 0:
        sorted_probs, sorted_idx = probs[uncovered].sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep[uncovered] = torch.zeros_like(sorted_idx, dtype=torch.bool).scatter_(
            1, sorted_idx, _keep_sorted(mass_before, p[uncovered])
        )
    logits[p_rows] = sub.masked_fill_(~keep, -math.inf)
    return logits


def _keep_sorted(mass_before: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    keep = mass_before < p
    keep[:, 0] = True
    return keep


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the top token's (in place, [M, V])."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, -math.inf)


class Sampler:
    """Holds only its configuration and a scratch CPU generator: reuse it across steps, but one
    sampler per thread (the generator is reseeded for every row)."""

    def __init__(
        self,
        eos_token_ids: Sequence[int] = (),
        logprobs_mode: LogprobsMode = LogprobsMode.RAW,
        noise_block_size: int = DEFAULT_NOISE_BLOCK_SIZE,
    ) -> None:
        if any(not isinstance(t, int) or t < 0 for t in eos_token_ids):
            raise ValueError(f"eos_token_ids must be non-negative ints, got {eos_token_ids!r}")
        if not isinstance(logprobs_mode, LogprobsMode):
            raise TypeError(f"logprobs_mode must be a LogprobsMode, got {logprobs_mode!r}")
        if not isinstance(noise_block_size, int) or noise_block_size < 1:
            raise ValueError(f"noise_block_size must be a positive int, got {noise_block_size!r}")
        self._eos_token_ids = tuple(eos_token_ids)
        self._logprobs_mode = logprobs_mode
        self._noise_block_size = noise_block_size
        self._generator = torch.Generator(device="cpu")

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        num_rows, vocab_size = logits.shape
        if num_rows == 0:
            return SampleResult(token_ids=[], logprobs=[])
        for index, row in enumerate(rows):
            if row.params.stop_token_ids and max(row.params.stop_token_ids) >= vocab_size:
                raise SamplerError(f"row {index}: stop_token_ids outside the vocabulary", (index,))
        if self._eos_token_ids and max(self._eos_token_ids) >= vocab_size:
            raise SamplerError(f"eos_token_ids outside the vocabulary of {vocab_size}")
        device = logits.device
        # A copy in float32: the caller's logits stay untouched.
        x = logits.to(torch.float32, copy=True)
        nan_rows = torch.isnan(x).any(dim=1)

        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows and self._logprobs_mode is LogprobsMode.RAW:
            raw_logprobs = torch.log_softmax(x[logprob_rows], dim=-1)

        self._apply_penalties(x, rows)
        self._apply_min_tokens(x, rows)

        greedy_rows = [i for i, r in enumerate(rows) if r.params.greedy]
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
        best = torch.empty(num_rows, dtype=torch.float32, device=device)
        if greedy_rows:
            greedy_idx = torch.as_tensor(greedy_rows, dtype=torch.int64, device=device)
            values, chosen = x[greedy_idx].max(dim=-1)
            tokens[greedy_idx] = chosen
            best[greedy_idx] = values
        if random_rows:
            random_idx = torch.as_tensor(random_rows, dtype=torch.int64, device=device)
            processed = self._truncate([rows[i] for i in random_rows], x[random_idx])
            chosen, values = self._draw([rows[i] for i in random_rows], processed)
            tokens[random_idx] = chosen
            best[random_idx] = values
            if logprob_rows and self._logprobs_mode is LogprobsMode.PROCESSED:
                x[random_idx] = processed

        lp_tensors = None
        if logprob_rows:
            lp_idx = torch.as_tensor(logprob_rows, dtype=torch.int64, device=device)
            source = raw_logprobs if raw_logprobs is not None else torch.log_softmax(x[lp_idx], dim=-1)
            max_top = min(vocab_size, max(rows[i].params.logprobs or 0 for i in logprob_rows))
            lp_tensors = self._logprobs(source, tokens[lp_idx], max_top)

        # Device-to-host copies happen only from here on, after all the work is queued.
        bad = nan_rows | (best == -math.inf) | torch.isnan(best)
        bad_list = bad.tolist()
        if any(bad_list):
            failed = [i for i, b in enumerate(bad_list) if b]
            raise SamplerError(f"rows {failed} have NaN logits or every token masked", failed)
        token_list = tokens.tolist()
        logprob_list: list[SampleLogprobs | None] = [None] * num_rows
        if lp_tensors is not None:
            sampled_lp, ranks, top_lp, top_ids = (t.tolist() for t in lp_tensors)
            for k, i in enumerate(logprob_rows):
                n = min(vocab_size, rows[i].params.logprobs or 0)
                logprob_list[i] = SampleLogprobs(
                    sampled=TokenLogprob(token_list[i], sampled_lp[k]),
                    rank=ranks[k],
                    top=tuple(TokenLogprob(top_ids[k][j], top_lp[k][j]) for j in range(n)),
                )
        return SampleResult(token_ids=token_list, logprobs=logprob_list)

    # ---- processing steps --------------------------------------------------------------------

    def _apply_penalties(self, x: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not penalised:
            return
        device = x.device
        idx = torch.as_tensor(penalised, dtype=torch.int64, device=device)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(rows[i].params, name) for i in penalised], dtype=torch.float32).to(
                device
            )

        x[idx] = apply_penalties(
            x[idx],
            [rows[i].prompt_token_ids for i in penalised],
            [rows[i].output_token_ids for i in penalised],
            column("repetition_penalty"),
            column("presence_penalty"),
            column("frequency_penalty"),
        )

    def _apply_min_tokens(self, x: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        row_ids: list[int] = []
        token_ids: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            if row.output_position >= params.min_tokens:
                continue
            # As vLLM: EOS is a stop token unless ignore_eos, and min_tokens masks stop tokens.
            masked = set(params.stop_token_ids)
            if not params.ignore_eos:
                masked.update(self._eos_token_ids)
            for token_id in sorted(masked):
                row_ids.append(i)
                token_ids.append(token_id)
        if row_ids:
            x[torch.as_tensor(row_ids, device=x.device), torch.as_tensor(token_ids, device=x.device)] = -math.inf

    def _truncate(self, rows: Sequence[SampleRow], x: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p on the random rows `x` [R, V]; returns new logits."""
        device = x.device
        vocab_size = x.shape[1]
        temperatures = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32).to(device)
        x = x / temperatures.unsqueeze(1)
        trunc = [
            k
            for k, r in enumerate(rows)
            if (r.params.effective_top_k is not None and r.params.effective_top_k < vocab_size)
            or r.params.top_p < 1.0
        ]
        if trunc:
            idx = torch.as_tensor(trunc, dtype=torch.int64, device=device)
            top_k = torch.tensor(
                [min(rows[k].params.effective_top_k or vocab_size, vocab_size) for k in trunc], dtype=torch.int64
            ).to(device)
            # p == 1 must remove nothing, even where float32 cumsums reach 1 before the tail.
            top_p = torch.tensor(
                [rows[k].params.top_p if rows[k].params.top_p < 1.0 else math.inf for k in trunc],
                dtype=torch.float32,
            ).to(device)
            x[idx] = apply_top_k_top_p(x[idx], top_k, top_p)
        with_min_p = [k for k, r in enumerate(rows) if r.params.min_p > 0.0]
        if with_min_p:
            idx = torch.as_tensor(with_min_p, dtype=torch.int64, device=device)
            min_p = torch.tensor([rows[k].params.min_p for k in with_min_p], dtype=torch.float32).to(device)
            x[idx] = apply_min_p(x[idx], min_p)
        return x

    def _draw(self, rows: Sequence[SampleRow], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hierarchical Gumbel-max over [R, V]; returns (token ids, the chosen tokens' logits)."""
        num_rows, vocab_size = x.shape
        block = self._noise_block_size
        num_blocks = -(-vocab_size // block)
        noise = torch.empty(num_rows, num_blocks + block, dtype=torch.float32)
        for k, row in enumerate(rows):
            if row.params.seed is None:  # SampleRow refuses this already; kept for -O runs
                raise SamplerError("a non-greedy row without a seed")
            self._generator.manual_seed(noise_seed(row.params.seed, row.output_position))
            uniform = torch.rand(num_blocks + block, generator=self._generator, dtype=torch.float64)
            # Gumbel(0, 1) = -log(-log(U)); float64 keeps the tail exact; U == 0 gives -inf (never wins).
            noise[k] = uniform.log_().neg_().log_().neg_().to(torch.float32)
        noise = noise.to(x.device)
        padded = x
        if num_blocks * block != vocab_size:
            padded = torch.nn.functional.pad(x, (0, num_blocks * block - vocab_size), value=-math.inf)
        blocks = padded.view(num_rows, num_blocks, block)
        block_mass = torch.logsumexp(blocks, dim=-1)
        chosen_block = (block_mass + noise[:, :num_blocks]).argmax(dim=-1)
        inside = blocks.gather(1, chosen_block.view(num_rows, 1, 1).expand(num_rows, 1, block)).squeeze(1)
        chosen_inside = (inside + noise[:, num_blocks:]).argmax(dim=-1)
        token_ids = chosen_block * block + chosen_inside
        return token_ids, x.gather(1, token_ids.unsqueeze(1)).squeeze(1)

    def _logprobs(
        self, logprobs: torch.Tensor, sampled: torch.Tensor, max_top: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
        if max_top > 0:
            top_lp, top_ids = logprobs.topk(max_top, dim=-1)
        else:
            top_lp = logprobs[:, :0]
            top_ids = torch.empty(logprobs.shape[0], 0, dtype=torch.int64, device=logprobs.device)
        return sampled_lp, ranks, top_lp, top_ids
