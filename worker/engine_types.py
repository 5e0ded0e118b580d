"""Engine-side typed values (no torch here: the cluster's deployment config imports them).

- `EngineConfig`: one instance's scheduler, KV pool and hand-over settings, validated without I/O.
- `Reservation`: the KV blocks a generation instance reserved for an incoming transfer.

What crosses the router/instance boundary (requests, outputs, events, loads) is in worker/protocol.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

from scheduler.block_manager import BlockManager, BlockManagerConfig
from scheduler.config import CapacitySchedulerPolicy, ChunkingConfig, ContextChunkingPolicy, SchedulerConfig
from scheduler.request import LlmRequest
from worker.config import (
    ConfigProblem,
    ConfigStruct,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ProblemKind,
    dataclass_compatible,
    join_path,
    load_config,
)
from worker.kv_layout import KvLayout
from worker.protocol import EngineInputError, InstanceRole, RequestType, SubmitRequest

# An instance's KV pool when nothing sizes it and it runs on a CPU (worker/kv_pool.py sizes a GPU's).
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024


@dataclass_compatible
class EngineConfig(ConfigStruct, frozen=True):
    """One instance's scheduler, KV pool and hand-over settings (`engine:` in the cluster config,
    overridable per instance group); errors are EngineInputErrors naming the field."""

    role: InstanceRole = InstanceRole.MIXED
    """What the instance serves."""
    tokens_per_block: PositiveInt = 16
    """Tokens per KV cache block (the same on every instance of a cluster)."""
    num_blocks: PositiveInt | None = None
    """KV pool size in blocks; None: as many blocks as fit in kv_cache_bytes."""
    kv_cache_bytes: PositiveInt | None = None
    """KV pool size in bytes, used when num_blocks is None; None: 256 MiB on a CPU, and on a GPU what
    gpu_memory_utilization of its memory leaves beside the weights and a full step's activations."""
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    """The share of its GPU's memory an instance fills (weights, activations, KV pool) when neither
    num_blocks nor kv_cache_bytes sizes its pool. Instances sharing a GPU (num_gpus below 1) each
    take this share of their fraction of it."""
    max_num_requests: PositiveInt = 64
    """Requests holding KV at once (capacity scheduler)."""
    max_batch_size: PositiveInt = 64
    """Requests per forward step (micro-batch scheduler)."""
    max_num_tokens: PositiveInt = 2048
    """Tokens per forward step."""
    capacity_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    """Capacity scheduler policy, by name."""
    chunking_policy: ContextChunkingPolicy | None = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    """Context chunking policy, by name; None: contexts are never chunked."""
    chunk_unit_tokens: PositiveInt = 256
    """Tokens per context chunk; a multiple of tokens_per_block, at most max_num_tokens."""
    stream_kv_chunks: bool = True
    """PREFILL: once a request's KV target is reserved, push the full blocks of each finished context
    chunk while later chunks compute (not under MAX_UTILIZATION, which may pause a context)."""
    enable_prefix_reuse: bool = True
    """Reuse cached KV blocks of shared prompt prefixes."""
    max_seq_len: PositiveInt | None = None
    """Longest prompt + output in tokens; None: the model's max_position_embeddings."""
    max_waiting_requests: PositiveInt = 4096
    """Requests queued in the engine beyond which submit refuses."""
    reservation_timeout_s: PositiveFloat = 30.0
    """Seconds a generation-side reservation waits for its KV to commit before it is freed."""
    sender_lease_s: PositiveFloat = 60.0
    """Seconds a prefill-side request keeps its blocks for a hand-over nobody acknowledged."""
    seed: NonNegativeInt = 0
    """Mixed into the seed of requests that come without one."""
    record_prefix_events: bool = True
    """Report prefix-cache stores and removals to the router (for KV-aware placement)."""
    stream_interval_ms: NonNegativeFloat = 0.0
    """Hold a request's tokens for up to this long and report them together (worker/stream_merge.py;
    vLLM's stream_interval): fewer polls for the router to pay for. First and last tokens, a
    context's first token and errors go out at once, so TTFT and end-to-end latency do not change;
    0: every step's tokens at once."""

    @classmethod
    def config_error(cls, problem: ConfigProblem) -> Exception:
        if problem.kind is ProblemKind.UNKNOWN_KEY:
            return EngineInputError(problem.path, "unknown engine option")
        if problem.kind is ProblemKind.RULE and isinstance(problem.cause, EngineInputError):
            return EngineInputError(join_path(problem.path, problem.cause.field), problem.cause.message)
        return EngineInputError(problem.path, problem.detail)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_unit_tokens % self.tokens_per_block:
            raise EngineInputError(
                "chunk_unit_tokens",
                f"must be a multiple of tokens_per_block={self.tokens_per_block}, got {self.chunk_unit_tokens}",
            )
        if self.chunking_policy is not None and self.chunk_unit_tokens > self.max_num_tokens:
            raise EngineInputError(
                "chunk_unit_tokens", f"{self.chunk_unit_tokens} exceeds max_num_tokens {self.max_num_tokens}"
            )

    def block_manager_config(self, num_blocks: int, max_seq_len: int) -> BlockManagerConfig:
        """The block manager an engine of this config runs (the simulator's instances too)."""
        return BlockManagerConfig(
            tokens_per_block=self.tokens_per_block,
            num_blocks=num_blocks,
            max_attention_window=max_seq_len,
            enable_block_reuse=self.enable_prefix_reuse,
            record_events=self.record_prefix_events and self.enable_prefix_reuse,
        )

    def scheduler_config(self) -> SchedulerConfig:
        """The two-level scheduler an engine of this config runs (the simulator's instances too)."""
        chunking = None if self.chunking_policy is None else ChunkingConfig(self.chunking_policy, self.chunk_unit_tokens)
        return SchedulerConfig(
            max_num_requests=self.max_num_requests,
            max_batch_size=self.max_batch_size,
            max_num_tokens=self.max_num_tokens,
            capacity_policy=self.capacity_policy,
            chunking=chunking,
        )

    def with_overrides(self, **overrides: object) -> EngineConfig:
        """A copy with some fields replaced (policy and role names may be given as strings)."""
        return load_config(EngineConfig, {**msgspec.structs.asdict(self), **overrides})


def hop_max_new_tokens(submit: SubmitRequest, max_seq_len: int) -> int:
    """The tokens a hop adds to its sequence at most: what its LlmRequest's max_new_tokens says, and
    so what the capacity scheduler reserves KV for and what `kv_pool_refusal` checks. A CONTEXT_ONLY
    hop samples only the first token (the generation instance makes the rest), so it adds one, as
    TensorRT-LLM's disaggregated server sends its context requests with max_tokens 1; reserving
    prompt + max_tokens there held decode blocks a prefill instance never uses. A GENERATION_ONLY
    hop generates the first token itself unless it came with the KV (`token_with_kv`). Shared by
    worker/engine.py and the simulator (cluster/sim/instance.py)."""
    produced = len(submit.output_token_ids)
    max_new = min(submit.sampling_params.max_tokens - produced, max_seq_len - len(submit.context_token_ids))
    if submit.request_type is RequestType.CONTEXT_ONLY:
        return min(max_new, 1)
    if submit.request_type is RequestType.GENERATION_ONLY and not submit.token_with_kv:
        return max_new + 1  # the first token is in output_token_ids, not in the context: generated here
    return max_new


def kv_pool_refusal(blocks: BlockManager, request: LlmRequest) -> str | None:
    """Why `request` can never run in this KV pool (the blocks it needs at its longest exceed the
    pool's), or None. Checked when a request is submitted (worker/engine.py add_request and the
    simulator's cluster/sim/instance.py submit), so that it is refused with this message instead of
    waiting in the queue until a stage timeout."""
    need = blocks.blocks_at_completion(request)
    if need <= blocks.num_blocks:
        return None
    tpb = blocks.tokens_per_block
    return (
        f"a prompt of {request.prompt_len} tokens with up to {request.max_new_tokens} new tokens needs {need} KV blocks "
        f"({need * tpb} tokens); this instance's KV pool holds {blocks.num_blocks} blocks ({blocks.num_blocks * tpb} tokens), "
        "so it could never run here (a larger engine.num_blocks or engine.kv_cache_bytes, or a smaller max_tokens)"
    )


@dataclass(frozen=True)
class Reservation:
    """Blocks a generation instance reserved for a request's incoming KV."""

    request_id: str
    transfer_id: str
    num_blocks: int
    num_tokens: int
    layout: KvLayout
    expires_at_s: float
    lease_s: float = 0.0  # the reservation timeout a renewal extends it by
