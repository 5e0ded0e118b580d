"""Attention over the paged KV cache, and the per-step plan that drives it.

A step is a list of `SequenceChunk`s (prefill chunks, possibly behind a cached prefix, and decode
tokens). `plan_step` turns it once per step into index tensors shared by every layer:

* the internal token order puts all single-token chunks (decode) first, then fresh prefill chunks
  grouped by length, then prefill chunks behind a cached prefix; `logits_rows` maps back to the
  caller's chunk order;
* `slot_mapping` says where each new token's K/V goes: slot block_ids[p // tpb] * tpb + p % tpb;
* decode sequences share one padded block table and one SDPA call per layer; the query heads that
  share a KV head are folded into the query-length axis (grouped-query attention without repeating
  K/V). Their K/V come from the `DecodeMirror` (a gathered copy kept across steps, refreshed per
  block by write version: in steady decoding one block per sequence per step), or, when the mirror
  is off or too large, from one `index_select` of whole blocks into a reused workspace per layer;
* fresh prefill chunks attend to their own new K/V (no gather) with a causal SDPA, equal lengths
  batched; chunks behind a cached prefix gather their context blocks and use an offset causal mask.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from worker.kv_cache import PagedKvCache

logger = logging.getLogger(__name__)


def disable_cudnn_attention() -> None:
    """Turn cuDNN's SDPA kernel off for this process (engines on CUDA call it; idempotent).

    cuDNN's attention builds an execution plan for each new shape, about 12 ms per call on an H200,
    and a serving step's shapes change every step (context lengths grow, batches change): decode on
    fresh shapes measured 46-67 ms per step with it against 4.7-6.3 ms without (bench/engine_bench.py
    --device cuda). Flash and memory-efficient attention need no per-shape setup. torch keeps one
    process-wide switch; setting it once, rather than around each call, is what stays correct when
    several engines step in one process on different threads.
    """
    if torch.cuda.is_available() and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        logger.info("cuDNN scaled-dot-product attention turned off for this process (it plans per shape)")


class StepPlanError(ValueError):
    """A chunk of the step does not fit the cache or the model (bad ids, short block table, ...)."""


@dataclass(frozen=True)
class SequenceChunk:
    """The new tokens of one sequence in one step.

    token_ids: the new tokens (a prefill chunk, or one decode token).
    num_cached_tokens: tokens of this sequence already in the KV cache = position of token_ids[0].
    block_ids: the sequence's block table, covering >= num_cached_tokens + len(token_ids) positions.
    want_logits: return logits for the last new token.
    """

    token_ids: Sequence[int]
    num_cached_tokens: int
    block_ids: Sequence[int]
    want_logits: bool


@dataclass(frozen=True)
class DecodeGroup:
    """All single-token chunks of a step: internal rows [0, num_seqs)."""

    num_seqs: int
    blocks_per_seq: int  # padded block-table width
    context_len: int  # the longest context; attention runs over [0, context_len)
    gather_block_ids: torch.Tensor  # int64 [num_seqs * blocks_per_seq] on the device, padding repeats a real block
    mask: torch.Tensor | None  # bool [num_seqs, 1, 1, context_len]; None when all lengths are equal
    table: torch.Tensor  # int64 [num_seqs, blocks_per_seq] on the host (gather_block_ids, unflattened)
    used: torch.Tensor  # bool [num_seqs, blocks_per_seq] on the host: False on padding entries


@dataclass(frozen=True)
class PrefillGroup:
    """Internal rows [row_start, row_start + num_seqs * chunk_len): equal-length chunks, or one cached one."""

    row_start: int
    num_seqs: int
    chunk_len: int
    num_cached_tokens: int  # 0 for fresh chunks (then num_seqs may exceed 1)
    context_block_ids: torch.Tensor | None  # int64, blocks covering [0, num_cached + chunk_len) when cached
    mask: torch.Tensor | None  # bool [chunk_len, num_cached + chunk_len] when cached


@dataclass(frozen=True)
class StepPlan:
    num_tokens: int
    token_ids: torch.Tensor  # int64 [T], internal order
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    logits_rows: torch.Tensor  # int64 [count(want_logits)], internal rows in the caller's chunk order
    written_blocks: torch.Tensor  # int64, host: the distinct blocks this step writes K/V into
    decode: DecodeGroup | None
    prefills: tuple[PrefillGroup, ...]


def _as_index(name: str, value: object) -> int:
    try:
        index = operator.index(value)
    except TypeError:
        raise StepPlanError(f"{name} must be an integer, got {value!r}") from None
    return int(index)


def plan_step(
    chunks: Sequence[SequenceChunk],
    *,
    tokens_per_block: int,
    num_blocks: int,
    vocab_size: int,
    max_positions: int,
    device: torch.device,
) -> StepPlan:
    """Validate the step's chunks and build every index tensor the layers need (once per step)."""
    tpb = tokens_per_block
    decode: list[int] = []
    fresh_by_len: dict[int, list[int]] = {}
    cached: list[int] = []
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, SequenceChunk):
            raise StepPlanError(f"chunk {index}: expected SequenceChunk, got {type(chunk).__name__}")
        length = len(chunk.token_ids)
        if length == 0:
            raise StepPlanError(f"chunk {index}: token_ids must not be empty")
        start = _as_index(f"chunk {index}: num_cached_tokens", chunk.num_cached_tokens)
        if start < 0:
            raise StepPlanError(f"chunk {index}: num_cached_tokens must be >= 0, got {start}")
        end = start + length
        if end > max_positions:
            raise StepPlanError(f"chunk {index}: positions up to {end} exceed max_position_embeddings {max_positions}")
        needed_blocks = -(-end // tpb)
        if len(chunk.block_ids) < needed_blocks:
            raise StepPlanError(
                f"chunk {index}: block table has {len(chunk.block_ids)} blocks, {needed_blocks} needed for {end} tokens"
            )
        if length == 1:
            decode.append(index)
        elif start == 0:
            fresh_by_len.setdefault(length, []).append(index)
        else:
            cached.append(index)

    order = decode + [i for length in sorted(fresh_by_len) for i in fresh_by_len[length]] + cached
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    used_blocks: list[int] = []  # every block id the step reads or writes, validated at once below
    row_of_last_token: dict[int, int] = {}
    for index in order:
        chunk = chunks[index]
        start = int(chunk.num_cached_tokens)
        length = len(chunk.token_ids)
        blocks = list(chunk.block_ids[: -(-(start + length) // tpb)])
        used_blocks.extend(blocks)
        token_ids.extend(chunk.token_ids)
        if length == 1:
            positions.append(start)
            slots.append(blocks[start // tpb] * tpb + start % tpb)
        else:
            positions.extend(range(start, start + length))
            slots.extend(blocks[p // tpb] * tpb + p % tpb for p in range(start, start + length))
        row_of_last_token[index] = len(token_ids) - 1

    block_tensor = _index_tensor("block ids", used_blocks)
    if int(block_tensor.min()) < 0 or int(block_tensor.max()) >= num_blocks:
        raise StepPlanError(f"block ids must lie in [0, {num_blocks}), got {sorted(set(used_blocks))}")
    tokens = _index_tensor("token ids", token_ids)
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise StepPlanError(f"token ids must lie in [0, {vocab_size})")
    logits_rows = [row_of_last_token[i] for i, chunk in enumerate(chunks) if chunk.want_logits]

    decode_group = _plan_decode([chunks[i] for i in decode], tpb, device) if decode else None
    prefills: list[PrefillGroup] = []
    row = len(decode)
    for length in sorted(fresh_by_len):
        members = fresh_by_len[length]
        prefills.append(PrefillGroup(row, len(members), length, 0, None, None))
        row += len(members) * length
    for index in cached:
        prefills.append(_plan_cached_prefill(chunks[index], row, tpb, device))
        row += len(chunks[index].token_ids)

    return StepPlan(
        num_tokens=len(token_ids),
        token_ids=tokens.to(device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        logits_rows=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        written_blocks=torch.tensor(sorted({slot // tpb for slot in slots}), dtype=torch.int64),
        decode=decode_group,
        prefills=tuple(prefills),
    )


def _index_tensor(what: str, values: list[int]) -> torch.Tensor:
    """int64 tensor of `values`, refusing anything but integers (floats, strings, bools)."""
    try:
        tensor = torch.tensor(values)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise StepPlanError(f"{what} must be integers: {error}") from None
    if tensor.dtype != torch.int64 or tensor.dim() != 1:
        raise StepPlanError(f"{what} must be a flat list of integers, got dtype {tensor.dtype}")
    return tensor


def _plan_decode(chunks: list[SequenceChunk], tpb: int, device: torch.device) -> DecodeGroup:
    lengths = [chunk.num_cached_tokens + 1 for chunk in chunks]
    context_len = max(lengths)
    width = -(-context_len // tpb)
    table: list[int] = []
    used_counts: list[int] = []
    for chunk, length in zip(chunks, lengths, strict=True):
        used = -(-length // tpb)
        used_counts.append(used)
        row = list(chunk.block_ids[:used])
        table.extend(row)
        if used < width:
            table.extend([row[0]] * (width - used))  # any real block: its slots are masked out
    mask = None
    if min(lengths) != context_len:
        length_tensor = torch.tensor(lengths, dtype=torch.int64)
        mask = (torch.arange(context_len)[None, :] < length_tensor[:, None]).view(len(chunks), 1, 1, context_len)
        mask = mask.to(device)
    host_table = torch.tensor(table, dtype=torch.int64)
    return DecodeGroup(
        num_seqs=len(chunks),
        blocks_per_seq=width,
        context_len=context_len,
        gather_block_ids=host_table.to(device),
        mask=mask,
        table=host_table.view(len(chunks), width),
        used=torch.arange(width)[None, :] < torch.tensor(used_counts)[:, None],
    )


def _plan_cached_prefill(chunk: SequenceChunk, row: int, tpb: int, device: torch.device) -> PrefillGroup:
    start = int(chunk.num_cached_tokens)
    length = len(chunk.token_ids)
    context_len = start + length
    blocks = list(chunk.block_ids[: -(-context_len // tpb)])
    # Query i sits at position start + i and sees keys 0 ..= start + i.
    mask = torch.arange(context_len)[None, :] <= (torch.arange(length)[:, None] + start)
    return PrefillGroup(
        row_start=row,
        num_seqs=1,
        chunk_len=length,
        num_cached_tokens=start,
        context_block_ids=torch.tensor(blocks, dtype=torch.int64, device=device),
        mask=mask.to(device),
    )


class GatherWorkspace:
    """Grow-only scratch buffers for gathered K/V, reused across layers and steps.

    Fresh multi-MB allocations per layer page-fault on every call (the allocator hands large blocks
    back to the OS), which costs more than the gather itself on CPU.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, row_elems: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        needed = rows * row_elems
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < needed or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(needed, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:needed].view(rows, row_elems)


def gather_blocks(
    blocks: torch.Tensor, block_ids: torch.Tensor, workspace: GatherWorkspace, name: str
) -> torch.Tensor:
    """Copy whole blocks [..., N, tpb, H, D] (leading dims: e.g. K and V) at `block_ids` into the
    workspace, in one call: [..., len(block_ids) * tpb, H, D]."""
    *lead, num_blocks, tpb, heads, head_dim = blocks.shape
    row_elems = tpb * heads * head_dim
    flat = blocks.reshape(*lead, num_blocks, row_elems)  # a view: the cache is contiguous per layer
    count = block_ids.numel()
    out = workspace.get(name, math.prod(lead) * count, row_elems, blocks.dtype, blocks.device)
    out = out.view(*lead, count, row_elems)
    torch.index_select(flat, len(lead), block_ids, out=out)
    return out.view(*lead, count * tpb, heads, head_dim)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """One query token per sequence. q [B, Hq, D]; k/v [B, Hkv, S, D] (any strides); mask [B, 1, 1, S] or None.

    The Hq / Hkv query heads sharing a KV head become that head's query rows, so grouped-query
    attention needs no repeated K/V and one SDPA call covers the batch.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    folded = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask)
    return out.reshape(batch, num_heads, head_dim)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Batched prefill. q [B, L, Hq, D]; k/v [B, S, Hkv, D]; mask [L, S] (None: plain causal, L == S) -> [B, L, Hq, D]."""
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)


@dataclass(frozen=True)
class MirrorStep:
    """One step's use of the decode mirror.

    Mirror row r holds decode chunk `chunk_of_row[r]` (None: row r holds chunk r). Entries
    (rows[i], cols[i]) must be refreshed from cache block src[i] (after the layer's own writes).
    """

    src: torch.Tensor  # int64 block ids, device
    rows: torch.Tensor  # int64 mirror rows, device
    cols: torch.Tensor  # int64 block-table columns, device
    count: int
    chunk_of_row: torch.Tensor | None  # int64 [batch], device


class DecodeMirror:
    """The decode batch's K/V kept gathered across steps: [L, 2, rows, H, width * tpb, D] (head-major,
    the layout of a dense cache, which the CPU SDPA kernel reads fastest).

    Re-gathering every decode sequence's whole context every step and layer roughly doubles the
    memory traffic of CPU decode attention. The mirror keeps, for each decode row and table column,
    which cache block (and which write version of it) it holds, and per step copies only the
    entries that are missing or stale: in steady decoding, the one block each sequence writes.
    Correctness rests on block versions alone (PagedKvCache bumps them on every write), so any
    reordering, finished or new sequences, reused or imported blocks simply show up as stale
    entries. It costs a second copy of the decode batch's KV, so it is bounded by `max_bytes`
    (beyond it, steps use the plain per-layer gather).
    """

    def __init__(self, cache: PagedKvCache, max_bytes: int) -> None:
        self._cache = cache
        self._max_bytes = max_bytes
        self._kv: torch.Tensor | None = None
        self._ids = torch.empty(0, 0, dtype=torch.int64)
        self._versions = torch.empty(0, 0, dtype=torch.int64)

    @property
    def allocated_bytes(self) -> int:
        return 0 if self._kv is None else self._kv.numel() * self._kv.element_size()

    def invalidate(self) -> None:
        self._ids.fill_(-1)

    def prepare(self, group: DecodeGroup) -> MirrorStep | None:
        """Bring the mirror's bookkeeping up to date for this step; None when it does not fit max_bytes."""
        batch, width = group.table.shape
        if not self._ensure_capacity(batch, width):
            return None
        chunk_of_row = self._assign_rows(group.table[:, 0].tolist())
        table, used = group.table, group.used
        if chunk_of_row is not None:
            table, used = table[chunk_of_row], used[chunk_of_row]
        ids = self._ids[:batch, :width]
        versions = self._versions[:batch, :width]
        now = self._cache.block_versions[table]
        stale = used & ((ids != table) | (versions != now))
        rows, cols = stale.nonzero(as_tuple=True)
        src = table[rows, cols]
        ids[rows, cols] = src
        versions[rows, cols] = now[rows, cols]
        device = self._cache.device
        return MirrorStep(
            src=src.to(device),
            rows=rows.to(device),
            cols=cols.to(device),
            count=int(src.numel()),
            chunk_of_row=None if chunk_of_row is None else chunk_of_row.to(device),
        )

    def _assign_rows(self, first_blocks: list[int]) -> torch.Tensor | None:
        """Keep each sequence in the mirror row it had (found by its first block), so that a finished
        or reordered sequence does not shift everyone else's rows; move rows >= batch down into holes.
        Returns chunk_of_row, or None when row i simply holds chunk i."""
        batch = len(first_blocks)
        row_first = self._ids[:, 0].tolist()
        row_of_block: dict[int, int] = {}
        for row, block in enumerate(row_first):
            if block >= 0:
                row_of_block.setdefault(block, row)
        row_of_chunk: list[int | None] = []
        taken: set[int] = set()
        for block in first_blocks:
            row = row_of_block.get(block)
            if row is None or row in taken:  # new sequence, or a second one sharing a first block
                row_of_chunk.append(None)
            else:
                row_of_chunk.append(row)
                taken.add(row)
        free = iter([row for row in range(batch) if row not in taken])
        moves: list[tuple[int, int]] = []
        for chunk, row in enumerate(row_of_chunk):
            if row is None:
                row_of_chunk[chunk] = next(free)
            elif row >= batch:  # the batch shrank: bring the row down into a hole
                target = next(free)
                moves.append((row, target))
                row_of_chunk[chunk] = target
        if moves:
            self._move_rows(moves)
        rows = [int(row) for row in row_of_chunk if row is not None]
        if rows == list(range(batch)):
            return None
        chunk_of_row = [0] * batch
        for chunk, row in enumerate(rows):
            chunk_of_row[row] = chunk
        return torch.tensor(chunk_of_row, dtype=torch.int64)

    def _move_rows(self, moves: list[tuple[int, int]]) -> None:
        assert self._kv is not None
        sources = torch.tensor([source for source, _ in moves], dtype=torch.int64)
        targets = torch.tensor([target for _, target in moves], dtype=torch.int64)
        device_sources, device_targets = sources.to(self._kv.device), targets.to(self._kv.device)
        self._kv.index_copy_(2, device_targets, self._kv.index_select(2, device_sources))
        for meta in (self._ids, self._versions):
            meta[targets] = meta[sources]
        self._ids[sources] = -1

    def layer_kv(self, layer: int, kv_blocks: torch.Tensor, step: MirrorStep, batch: int) -> torch.Tensor:
        """Update layer `layer` (after this step's writes) and return its K/V [2, batch, H, width_cap * tpb, D]."""
        if self._kv is None:
            raise RuntimeError("decode mirror used without a successful prepare()")
        mirror = self._kv[layer]  # [2, rows_cap, H, width_cap, tpb, D]
        if step.count:
            blocks = kv_blocks.index_select(1, step.src)  # [2, n, tpb, H, D]
            # Advanced indices on dims 1 and 3 (a slice between them) put the entry axis first.
            mirror[:, step.rows, :, step.cols] = blocks.permute(1, 0, 3, 2, 4)
        _, _, heads, width_cap, tpb, head_dim = mirror.shape
        return mirror[:, :batch].reshape(2, batch, heads, width_cap * tpb, head_dim)

    def _ensure_capacity(self, batch: int, width: int) -> bool:
        rows_cap, width_cap = self._ids.shape
        if self._kv is not None and batch <= rows_cap and width <= width_cap:
            return True
        rows_cap = max(rows_cap, _round_up_pow2(batch))
        width_cap = max(width_cap, _round_up_pow2(width))
        layout = self._cache.layout
        shape = (
            layout.num_layers,
            2,
            rows_cap,
            layout.num_kv_heads,
            width_cap,
            layout.tokens_per_block,
            layout.head_dim,
        )
        needed = math.prod(shape) * layout.itemsize_bytes
        self._kv = None  # release before allocating the larger one
        if needed > self._max_bytes:
            logger.debug("decode mirror would need %d bytes (> %d): using per-step gathers", needed, self._max_bytes)
            self._ids = torch.empty(0, 0, dtype=torch.int64)
            self._versions = torch.empty(0, 0, dtype=torch.int64)
            return False
        self._kv = torch.zeros(shape, dtype=self._cache.dtype, device=self._cache.device)
        self._ids = torch.full((rows_cap, width_cap), -1, dtype=torch.int64)
        self._versions = torch.zeros((rows_cap, width_cap), dtype=torch.int64)
        return True


def _round_up_pow2(value: int) -> int:
    return 1 << max(2, (value - 1).bit_length())


class PagedAttentionBackend:
    """The `AttentionBackend` of one step: writes the step's K/V into the cache, then attends over it."""

    def __init__(
        self,
        cache: PagedKvCache,
        plan: StepPlan,
        workspace: GatherWorkspace,
        mirror: DecodeMirror | None = None,
        mirror_step: MirrorStep | None = None,
    ) -> None:
        self._cache = cache
        self._plan = plan
        self._workspace = workspace
        self._mirror = mirror if mirror_step is not None else None
        self._mirror_step = mirror_step

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        kv_blocks = self._cache.tensor[layer_index]  # [2, N, tpb, H, D]
        kv_blocks[0].view(-1, *k.shape[1:]).index_copy_(0, plan.slot_mapping, k)
        kv_blocks[1].view(-1, *v.shape[1:]).index_copy_(0, plan.slot_mapping, v)
        outputs: list[torch.Tensor] = []
        if plan.decode is not None:
            outputs.append(self._decode(layer_index, plan.decode, q, kv_blocks))
        for group in plan.prefills:
            outputs.append(self._prefill(group, q, k, v, kv_blocks))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def _decode(self, layer_index: int, group: DecodeGroup, q: torch.Tensor, kv_blocks: torch.Tensor) -> torch.Tensor:
        batch, context_len = group.num_seqs, group.context_len
        num_kv_heads, head_dim = kv_blocks.shape[-2:]
        step = self._mirror_step
        if self._mirror is None or step is None:
            kv = gather_blocks(kv_blocks, group.gather_block_ids, self._workspace, "decode_kv")
            kv = kv.view(2, batch, -1, num_kv_heads, head_dim)[:, :, :context_len].transpose(2, 3)
            return decode_attention(q[:batch], kv[0], kv[1], group.mask)
        kv = self._mirror.layer_kv(layer_index, kv_blocks, step, batch)[:, :, :, :context_len]
        if step.chunk_of_row is None:
            return decode_attention(q[:batch], kv[0], kv[1], group.mask)
        # Rows hold the chunks in another order: attend in row order, hand back in chunk order.
        mask = None if group.mask is None else group.mask[step.chunk_of_row]
        by_row = decode_attention(q[:batch][step.chunk_of_row], kv[0], kv[1], mask)
        return torch.empty_like(by_row).index_copy_(0, step.chunk_of_row, by_row)

    def _prefill(
        self,
        group: PrefillGroup,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_blocks: torch.Tensor,
    ) -> torch.Tensor:
        rows = slice(group.row_start, group.row_start + group.num_seqs * group.chunk_len)
        shape = (group.num_seqs, group.chunk_len)
        q_group = q[rows].view(*shape, *q.shape[1:])
        if group.context_block_ids is None:
            k_ctx = k[rows].view(*shape, *k.shape[1:])
            v_ctx = v[rows].view(*shape, *v.shape[1:])
            out = causal_attention(q_group, k_ctx, v_ctx)
        else:
            context_len = group.num_cached_tokens + group.chunk_len
            kv = gather_blocks(kv_blocks, group.context_block_ids, self._workspace, "prefill_kv")[:, :context_len]
            out = causal_attention(q_group, kv[0][None], kv[1][None], group.mask)
        return out.reshape(-1, *q.shape[1:])
