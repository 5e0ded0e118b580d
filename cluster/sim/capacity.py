"""A cluster's capacity in requests per second, from a profile and the engine limits: where to aim a load.

Prefill side: an instance's context throughput is a full step (max_num_tokens of context) divided by
that step's time; its request rate is that over the mean prompt. Generation side: at the batch the
engine allows (max_batch_size, max_num_requests, and the KV pool at the mean sequence length), a
decode step emits one token per request; its request rate is that throughput over the mean output.
A disaggregated cluster's capacity is the smaller of its PREFILL and GENERATION sides; a MIXED
instance splits its time between the two (1 / (1 / prefill rate + 1 / decode rate)). Instances of a
profile with `contention` (sharing one host's cores) slow each other: at saturation a MIXED instance
has every other one busy, an instance of a disaggregated cluster's slower side has the other
instances of its side busy and those of the faster side busy for the share of their capacity
the slower side uses; its steps take `profile.contended` of that many times their time alone. A first-order
figure for choosing a load (bench/sim_scale.py aims at 70 % of it), not a prediction: queueing,
chunking and the hand-over are what the simulation itself is for.
"""

from __future__ import annotations

from cluster.sim.profile import StepProfile, context_pairs
from worker.engine_types import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig


def pool_blocks(engine: EngineConfig, profile: StepProfile) -> int:
    """An instance's KV pool in blocks: engine.num_blocks, or what engine.kv_cache_bytes (unset: a CPU
    instance's default; cluster.py's with_profile_pool sets a simulated GPU's) holds of the profile's model."""
    pool_bytes = engine.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    return engine.num_blocks or max(1, pool_bytes // (profile.kv_bytes_per_token * engine.tokens_per_block))


def prefill_rps(profile: StepProfile, engine: EngineConfig, mean_prompt_tokens: float) -> float:
    chunk = engine.max_num_tokens
    # A full step of chunks of the mean prompt's size (attention within each prompt only).
    prompts_per_step = max(1.0, chunk / mean_prompt_tokens)
    pairs = prompts_per_step * context_pairs(0, int(mean_prompt_tokens))
    step_s = profile.step_s(chunk, int(pairs), 0, 0)
    return chunk / step_s / mean_prompt_tokens


def decode_rps(profile: StepProfile, engine: EngineConfig, num_blocks: int, mean_prompt_tokens: float, mean_output_tokens: float) -> float:
    mean_context = mean_prompt_tokens + mean_output_tokens / 2
    blocks_per_request = -(-(mean_prompt_tokens + mean_output_tokens) // engine.tokens_per_block)
    batch = max(1, int(min(engine.max_batch_size, engine.max_num_requests, num_blocks // blocks_per_request)))
    step_s = profile.step_s(0, 0, batch, int(batch * mean_context))
    return batch / step_s / mean_output_tokens


def cluster_rps(
    profile: StepProfile,
    engine: EngineConfig,
    *,
    num_prefill: int,
    num_generation: int,
    num_mixed: int = 0,
    mean_prompt_tokens: float,
    mean_output_tokens: float,
) -> float:
    num_blocks = pool_blocks(engine, profile)
    prefill = prefill_rps(profile, engine, mean_prompt_tokens)
    decode = decode_rps(profile, engine, num_blocks, mean_prompt_tokens, mean_output_tokens)
    others = num_prefill + num_generation + num_mixed - 1
    disaggregated = 0.0
    if num_prefill and num_generation:
        sides = sorted([(num_prefill * prefill, num_prefill), (num_generation * decode, num_generation)])
        (slow_rps, slow_count), (fast_rps, fast_count) = sides
        busy = slow_count - 1 + fast_count * slow_rps / fast_rps + num_mixed
        disaggregated = slow_rps / profile.contended(busy)
    mixed = num_mixed / (1 / prefill + 1 / decode) / profile.contended(others) if num_mixed else 0.0
    return disaggregated + mixed
