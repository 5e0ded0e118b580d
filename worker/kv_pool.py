"""How many KV blocks an instance's pool gets when its configuration sizes none.

On a CPU the pool takes `DEFAULT_CPU_KV_CACHE_BYTES`. On a GPU it takes what is left of the
instance's share of the device's memory (`engine.gpu_memory_utilization`, scaled down by the
deployment for instances that share a GPU) once its weights and the activations of its largest
step are in: vLLM's rule (gpu_memory_utilization, default 0.9, over a profiling forward), because
a fixed default either wastes an 80 GB device or does not fit a small one. The arithmetic is pure
(`gpu_pool_bytes`, tested without a GPU); `measure_gpu_memory` takes its inputs from torch around
`run_largest_step`; `unsized_pool_bytes` is what worker/engine.py asks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.attention import SequenceChunk
from worker.engine_types import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from worker.kv_cache import PagedKvCache
from worker.kv_layout import KvLayout
from worker.model import DecoderLM
from worker.model_runner import ModelRunner
from worker.protocol import EngineInputError

__all__ = ["DEFAULT_CPU_KV_CACHE_BYTES", "GpuMemory", "gpu_pool_bytes", "measure_gpu_memory", "run_largest_step", "unsized_pool_bytes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuMemory:
    """One device's memory as an instance finds it after loading its weights and running one step of
    `max_num_tokens` (bytes)."""

    total_bytes: int
    """The device's memory (torch.cuda.mem_get_info's total)."""
    free_bytes: int
    """Free on the device now, the allocator's cache emptied: other processes' use is not free."""
    weights_bytes: int
    """What this instance holds between steps (its weights and buffers: allocated after the step)."""
    peak_bytes: int
    """What this instance reserved at the step's peak (weights plus activations)."""


def gpu_pool_bytes(memory: GpuMemory, utilization: float) -> int:
    """The KV pool for an instance allowed `utilization` of the device: that share less its peak use
    (weights and a full step's activations), and never more than is free beside the activations it
    still needs. Raises EngineInputError (naming the settings to change) when nothing is left."""
    activations = max(0, memory.peak_bytes - memory.weights_bytes)
    share = math.floor(memory.total_bytes * utilization) - memory.peak_bytes
    pool = min(share, memory.free_bytes - activations)
    if pool <= 0:
        gib = 1 << 30
        raise EngineInputError(
            "gpu_memory_utilization",
            f"no room for a KV pool: {utilization:g} of the GPU's {memory.total_bytes / gib:.1f} GiB less this instance's "
            f"weights and activations ({memory.peak_bytes / gib:.1f} GiB) leaves {share / gib:.2f} GiB, and "
            f"{memory.free_bytes / gib:.1f} GiB is free; raise engine.gpu_memory_utilization, give the instance a "
            "whole GPU (num_gpus), lower max_num_tokens, or set engine.kv_cache_bytes",
        )
    return pool


def measure_gpu_memory(run_largest_step: Callable[[], object], device: torch.device) -> GpuMemory:
    """`GpuMemory` of `device` around one call of `run_largest_step` (a forward of the largest step
    the instance will run, on a scratch KV cache), the allocator's cache emptied after it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_largest_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(total_bytes=total, free_bytes=free, weights_bytes=weights, peak_bytes=max(peak, weights))


def unsized_pool_bytes(model: DecoderLM, layout: KvLayout, config: EngineConfig, max_seq_len: int, instance_id: str) -> int:
    """The KV pool of an engine whose config sizes none: the CPU default, or on a GPU what its share of
    the device leaves once the weights and a forward of the largest step are in (logged)."""
    if model.device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    try:
        memory = measure_gpu_memory(lambda: run_largest_step(model, layout, config, max_seq_len), model.device)
    except torch.cuda.OutOfMemoryError:
        raise EngineInputError(
            "max_num_tokens", f"a step of {config.max_num_tokens} tokens does not fit the GPU beside the weights"
        ) from None
    pool = gpu_pool_bytes(memory, config.gpu_memory_utilization)
    gib = 1 << 30
    logger.info(
        "%s: KV pool %.2f GiB, sized from the GPU: %g of its %.1f GiB less the weights (%.2f GiB) and a %d-token step's "
        "activations (%.2f GiB); %.1f GiB was free", instance_id, pool / gib, config.gpu_memory_utilization,
        memory.total_bytes / gib, memory.weights_bytes / gib, config.max_num_tokens,
        (memory.peak_bytes - memory.weights_bytes) / gib, memory.free_bytes / gib,
    )
    return pool


def run_largest_step(model: DecoderLM, layout: KvLayout, config: EngineConfig, max_seq_len: int) -> None:
    """A forward of the most tokens and sequences one step may hold (each wanting logits), on a
    scratch KV cache freed afterwards: its activation peak is what the pool must leave room for."""
    tpb = config.tokens_per_block
    tokens = min(config.max_num_tokens, max_seq_len * config.max_batch_size)
    sequences = min(config.max_batch_size, tokens)
    lengths = [tokens // sequences + (1 if index < tokens % sequences else 0) for index in range(sequences)]
    chunks, first_block = [], 0
    for length in lengths:
        blocks = -(-length // tpb)
        chunks.append(SequenceChunk(token_ids=[0] * length, num_cached_tokens=0,
                                    block_ids=list(range(first_block, first_block + blocks)), want_logits=True))
        first_block += blocks
    scratch = PagedKvCache(layout, first_block, model.device)
    ModelRunner(model, scratch, decode_mirror_max_bytes=0).forward(chunks)
