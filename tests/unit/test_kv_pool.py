"""Sizing an instance's KV pool when its configuration does not: the CPU default, a GPU's share of
its memory (pure arithmetic over what torch reports), the activation peak measured by a forward of
the largest step, and the share of instances that split a GPU."""

from __future__ import annotations

import pytest
import torch

from cluster.deploy.config import ClusterConfig
from cluster.deploy.launch import PlannedInstance, instance_engine
from worker.default_model import build_default_model
from worker.engine import Engine
from worker.engine_types import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from worker.kv_pool import GpuMemory, gpu_pool_bytes, run_largest_step, unsized_pool_bytes
from worker.model_runner import ModelRunner
from worker.protocol import EngineInputError

GIB = 1 << 30


@pytest.fixture(scope="module")
def default_model():
    torch.set_num_threads(1)
    return build_default_model(dtype="float32", device="cpu")


def test_a_gpu_pool_is_the_share_less_weights_and_activations() -> None:
    # An 80 GiB device of its own: 0.9 of it (72 GiB) less 16 GiB of weights and 2 GiB of activations.
    alone = GpuMemory(total_bytes=80 * GIB, free_bytes=63 * GIB, weights_bytes=16 * GIB, peak_bytes=18 * GIB)
    assert gpu_pool_bytes(alone, 0.9) == 72 * GIB - 18 * GIB
    # Another process holds 40 GiB of it: only what is free, less the activations still to come.
    crowded = GpuMemory(total_bytes=80 * GIB, free_bytes=23 * GIB, weights_bytes=16 * GIB, peak_bytes=18 * GIB)
    assert gpu_pool_bytes(crowded, 0.9) == 23 * GIB - 2 * GIB
    # A lower share (half a GPU each for two instances) halves the budget before the weights come off.
    assert gpu_pool_bytes(alone, 0.45) == int(80 * GIB * 0.45) - 18 * GIB


@pytest.mark.parametrize(
    "memory, utilization",
    [
        (GpuMemory(total_bytes=24 * GIB, free_bytes=7 * GIB, weights_bytes=16 * GIB, peak_bytes=17 * GIB), 0.5),
        (GpuMemory(total_bytes=80 * GIB, free_bytes=1 * GIB, weights_bytes=16 * GIB, peak_bytes=18 * GIB), 0.9),
    ],
    ids=["share-too-small", "device-full"],
)
def test_no_room_for_a_pool_is_a_clear_error_naming_what_to_change(memory, utilization) -> None:
    with pytest.raises(EngineInputError) as error:
        gpu_pool_bytes(memory, utilization)
    assert error.value.field == "gpu_memory_utilization"
    assert "no room for a KV pool" in error.value.message and "engine.kv_cache_bytes" in error.value.message


def test_a_cpu_instance_keeps_its_default_pool_and_an_explicit_size_wins(default_model) -> None:
    model, tokenizer, generation = default_model
    block_bytes = None
    for config, pool_bytes in ((EngineConfig(), DEFAULT_CPU_KV_CACHE_BYTES), (EngineConfig(kv_cache_bytes=64 << 20), 64 << 20)):
        engine = Engine(model, tokenizer, config, generation_config=generation)
        block_bytes = engine.layout.run_bytes(engine.layout.num_layers, 1)
        assert engine.blocks.num_blocks == pool_bytes // block_bytes
    assert Engine(model, tokenizer, EngineConfig(num_blocks=77), generation_config=generation).blocks.num_blocks == 77


def test_the_activation_peak_is_measured_on_the_largest_step(default_model, monkeypatch) -> None:
    """The forward whose peak a GPU pool leaves room for holds max_num_tokens tokens over
    max_batch_size sequences, each wanting logits, on a scratch cache of just their blocks."""
    model, tokenizer, generation = default_model
    config = EngineConfig(max_num_tokens=1000, max_batch_size=6)
    engine = Engine(model, tokenizer, config, generation_config=generation)
    seen = []
    forward = ModelRunner.forward

    def spy(self, chunks):
        seen.append((self.kv_cache.num_blocks, [len(c.token_ids) for c in chunks], [c.want_logits for c in chunks],
                     [list(c.block_ids) for c in chunks]))
        return forward(self, chunks)

    monkeypatch.setattr(ModelRunner, "forward", spy)
    run_largest_step(model, engine.layout, config, engine.max_seq_len)
    [(num_blocks, lengths, logits, tables)] = seen
    assert lengths == [167, 167, 167, 167, 166, 166] and all(logits)
    assert sorted(b for table in tables for b in table) == list(range(num_blocks)) and num_blocks == 6 * 11


@pytest.mark.parametrize("num_gpus, expected", [(0.0, 0.9), (1.0, 0.9), (2.0, 0.9), (0.5, 0.45), (0.25, 0.225)])
def test_instances_sharing_a_gpu_each_size_their_pool_to_their_fraction(num_gpus, expected) -> None:
    config = ClusterConfig.from_dict({"instances": [{"role": "MIXED", "count": 2, "num_gpus": num_gpus}]})
    planned = PlannedInstance("mixed-0", config.instances[0], num_gpus)
    assert instance_engine(config, planned).gpu_memory_utilization == pytest.approx(expected)
    assert instance_engine(config, planned).role is config.engine_config(config.instances[0]).role


def test_gpu_memory_utilization_is_validated() -> None:
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(EngineInputError) as error:
            EngineConfig().with_overrides(gpu_memory_utilization=bad)
        assert error.value.field == "gpu_memory_utilization"


def test_a_gpu_engine_sizes_its_pool_from_what_it_measured_and_says_so(default_model, monkeypatch, caplog) -> None:
    """unsized_pool_bytes (what the engine asks when nothing sizes its pool) on a (pretended) CUDA
    model: the measurement's pool, logged with its inputs; a largest step that does not fit the GPU
    is an error naming max_num_tokens."""
    import logging
    from types import SimpleNamespace

    import worker.kv_pool as kv_pool_module

    model, tokenizer, generation = default_model
    config = EngineConfig(gpu_memory_utilization=0.5)
    engine = Engine(model, tokenizer, config, generation_config=generation)
    cuda_model = SimpleNamespace(device=torch.device("cuda"))

    def pool_bytes() -> int:
        return unsized_pool_bytes(cuda_model, engine.layout, config, engine.max_seq_len, "g7")

    memory = GpuMemory(total_bytes=40 * GIB, free_bytes=30 * GIB, weights_bytes=8 * GIB, peak_bytes=9 * GIB)
    calls = []
    monkeypatch.setattr(kv_pool_module, "measure_gpu_memory", lambda step, device: calls.append(device) or memory)
    with caplog.at_level(logging.INFO, logger="worker.kv_pool"):
        assert pool_bytes() == 20 * GIB - 9 * GIB
    assert calls == [torch.device("cuda")]
    assert "g7: KV pool 11.00 GiB, sized from the GPU: 0.5 of its 40.0 GiB" in caplog.text

    def out_of_memory(step, device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kv_pool_module, "measure_gpu_memory", out_of_memory)
    with pytest.raises(EngineInputError) as error:
        pool_bytes()
    assert error.value.field == "max_num_tokens" and "does not fit the GPU" in error.value.message
