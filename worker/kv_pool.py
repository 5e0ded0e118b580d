"""How many KV blocks an instance's pool gets when its configuration sizes none.

On a CPU the pool takes `DEFAULT_CPU_KV_CACHE_BYTES`. On a GPU it takes what is left of the
instance's share of the device's memory (`engine.gpu_memory_utilization`, scaled down by the
deployment for instances that share a GPU) once its weights and the activations of its largest
step are in: vLLM's rule (gpu_memory_utilization, default 0.9, over a profiling forward), because
a fixed default either wastes an 80 GB device or does not fit a small one. The arithmetic is pure
(`gpu_pool_bytes`, tested without a GPU); `measure_gpu_memory` takes its inputs from torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.engine_types import DEFAULT_CPU_KV_CACHE_BYTES
from worker.protocol import EngineInputError

__all__ = ["DEFAULT_CPU_KV_CACHE_BYTES", "GpuMemory", "gpu_pool_bytes", "measure_gpu_memory"]


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
