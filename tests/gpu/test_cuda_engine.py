"""GPU checks (skipped without CUDA): the engine on a CUDA device equals the dense reference there,
and KV exported from a CUDA cache imports byte-identically into a CPU one."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_engine_greedy_equals_dense_reference_on_cuda() -> None:
    from worker.default_model import MARGIN_CORPUS_SEED, build_default_model, margin_corpus
    from worker.dense import DenseGenerator
    from worker.engine import Engine
    from worker.engine_types import EngineConfig
    from worker.protocol import SubmitRequest
    from worker.sampling import SamplingParams

    model, tokenizer, generation = build_default_model(dtype="float32", device="cuda")
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=512), generation_config=generation)
    prompts = margin_corpus(MARGIN_CORPUS_SEED, 8)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(SubmitRequest(f"r{index}", tuple(prompt), params))
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    for index, prompt in enumerate(prompts):
        expected = DenseGenerator(model, 1, len(prompt) + 16).generate_greedy([prompt], 16)[0]
        assert outputs[f"r{index}"] == expected
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_kv_bytes_move_between_cuda_and_cpu_caches_unchanged() -> None:
    from worker.kv_cache import PagedKvCache
    from worker.kv_layout import KvLayout

    layout = KvLayout(4, 2, 32, 16, "bfloat16", "fingerprint")
    gpu = PagedKvCache(layout, 8, "cuda")
    cpu = PagedKvCache(layout, 8, "cpu")
    gpu.tensor.normal_()
    data = gpu.export_bytes([1, 3, 5], 0, 4)
    cpu.import_blocks([0, 2, 4], 0, 4, data)
    assert cpu.export_bytes([0, 2, 4], 0, 4) == data


def test_cuda_attention_runs_without_cudnn_sdpa(monkeypatch) -> None:
    """cuDNN's SDPA builds a plan per new shape (tens of ms per decode step, measured): a CUDA engine
    turns it off for the process, so every SDPA call of its steps, prefill and decode, runs without it."""
    from torch.nn import functional

    from worker.default_model import MARGIN_CORPUS_SEED, build_default_model, margin_corpus
    from worker.engine import Engine
    from worker.engine_types import EngineConfig
    from worker.protocol import SubmitRequest
    from worker.sampling import SamplingParams

    torch.backends.cuda.enable_cudnn_sdp(True)  # torch's default, whatever earlier tests left
    cudnn_enabled_at_call: list[bool] = []
    real_sdpa = functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        cudnn_enabled_at_call.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(functional, "scaled_dot_product_attention", spy)
    model, tokenizer, generation = build_default_model(dtype="bfloat16", device="cuda")
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=256), generation_config=generation)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(margin_corpus(MARGIN_CORPUS_SEED, 4)):
        engine.add_request(SubmitRequest(f"r{index}", tuple(prompt), params))
    while engine.has_work():
        engine.step()
    assert cudnn_enabled_at_call, "the engine made no SDPA call"
    assert not any(cudnn_enabled_at_call)


def test_an_unsized_kv_pool_takes_its_share_of_the_gpu_and_serves() -> None:
    """worker/kv_pool.py on a real device: with neither num_blocks nor kv_cache_bytes, the pool, the
    weights and a full step's activations fit gpu_memory_utilization of the GPU, the pool is most of
    what that share leaves, and the engine then serves a batch of the largest steps."""
    from worker.default_model import build_default_model
    from worker.engine import Engine
    from worker.engine_types import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
    from worker.protocol import SubmitRequest
    from worker.sampling import SamplingParams

    share = 0.3  # of the device: other tests and processes may hold some of it
    model, tokenizer, generation = build_default_model(dtype="float32", device="cuda")
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated()
    total = torch.cuda.mem_get_info()[1]
    engine = Engine(model, tokenizer, EngineConfig(gpu_memory_utilization=share), generation_config=generation)
    pool = engine.kv_cache.tensor.numel() * engine.kv_cache.tensor.element_size()
    print(f"pool {pool / 2**30:.2f} GiB of {total / 2**30:.1f} GiB ({engine.blocks.num_blocks} blocks), weights {weights / 2**20:.0f} MiB")
    assert pool > DEFAULT_CPU_KV_CACHE_BYTES
    assert weights + pool <= share * total
    assert pool >= share * total - weights - 2 * 2**30  # the activations of a 2048-token step of this model: well under 2 GiB
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for index in range(16):
        engine.add_request(SubmitRequest(f"r{index}", tuple(range(1, 200)), params))
    while engine.has_work():
        engine.step()
    # The sampler's buffers are not in the measured forward: a little slack for them.
    assert torch.cuda.max_memory_reserved() <= share * total + 256 * 2**20
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    del engine
    torch.cuda.empty_cache()
