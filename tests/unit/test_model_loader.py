"""Checkpoint loading and config parsing: round trips, sharding, and every typed error."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from worker.default_model import build_random_model, default_model_config
from worker.dense import reference_logits
from worker.loader import CheckpointError, MissingTensorError, load_checkpoint
from worker.model_config import (
    GenerationConfig,
    LinearRopeScaling,
    Llama3RopeScaling,
    ModelConfig,
    ModelConfigError,
    UnsupportedArchitectureError,
    YarnRopeScaling,
)


@pytest.fixture(autouse=True, scope="module")
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def small_config(**changes) -> ModelConfig:
    return replace(default_model_config(), num_layers=2, **changes)


def save_checkpoint(directory: Path, config: ModelConfig, *, seed: int = 0, drop=(), extra=None, raw_changes=None):
    model = build_random_model(config, seed)
    tensors = {name: t.clone().contiguous() for name, t in model.state_dict().items() if name not in drop}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors.update(extra or {})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    raw = config.to_hf_config()
    raw.update(raw_changes or {})
    (directory / "config.json").write_text(json.dumps(raw))
    return model


def test_round_trip_gives_identical_weights_and_fingerprint(tmp_path):
    config = small_config()
    original = save_checkpoint(tmp_path, config, extra={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)})
    loaded, generation = load_checkpoint(tmp_path, "float32", "cpu")
    assert loaded.config == config
    assert loaded.fingerprint() == original.fingerprint()
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert generation.eos_token_ids == config.eos_token_ids
    torch.testing.assert_close(reference_logits(loaded, [1, 2, 3]), reference_logits(original, [1, 2, 3]))


def test_loading_in_bf16_casts_and_changes_the_fingerprint(tmp_path):
    original = save_checkpoint(tmp_path, small_config())
    loaded, _ = load_checkpoint(tmp_path, "bfloat16", "cpu")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.model.norm.weight, original.model.norm.weight.to(torch.bfloat16))
    assert loaded.fingerprint() != original.fingerprint()


def test_fingerprint_sees_weight_changes_in_large_tensors(tmp_path):
    original = save_checkpoint(tmp_path, small_config())
    loaded, _ = load_checkpoint(tmp_path, "float32", "cpu")
    assert loaded.fingerprint() == original.fingerprint()
    with torch.no_grad():
        loaded.lm_head.weight[-1, -1] += 1.0  # the last bytes of a >128 KiB tensor are sampled
    assert loaded.fingerprint() != original.fingerprint()


def test_tied_embeddings_may_omit_lm_head(tmp_path):
    config = small_config(tie_word_embeddings=True)
    original = save_checkpoint(tmp_path, config)
    loaded, _ = load_checkpoint(tmp_path, "float32", "cpu")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(reference_logits(loaded, [5, 6]), reference_logits(original, [5, 6]))


def test_missing_tensor_is_named(tmp_path):
    save_checkpoint(tmp_path, small_config(), drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.up_proj.weight") as info:
        load_checkpoint(tmp_path, "float32", "cpu")
    assert info.value.tensor_name == "model.layers.1.mlp.up_proj.weight"


def test_untied_model_needs_lm_head(tmp_path):
    save_checkpoint(tmp_path, small_config(), drop=("lm_head.weight",))
    with pytest.raises(MissingTensorError, match="lm_head.weight"):
        load_checkpoint(tmp_path, "float32", "cpu")


def test_wrong_shape_is_named(tmp_path):
    save_checkpoint(tmp_path, small_config(), extra={"model.norm.weight": torch.ones(7)})
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_checkpoint(tmp_path, "float32", "cpu")


def test_unsupported_architecture_is_named(tmp_path):
    save_checkpoint(tmp_path, small_config(), raw_changes={"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as info:
        load_checkpoint(tmp_path, "float32", "cpu")
    assert info.value.architecture == "GPT2LMHeadModel"


def test_torch_dtype_and_dtype_keys(tmp_path):
    base = small_config().to_hf_config()
    assert ModelConfig.from_hf_config({**base, "torch_dtype": "bfloat16"}).checkpoint_dtype == "bfloat16"
    assert ModelConfig.from_hf_config({**base, "dtype": "float16"}).checkpoint_dtype == "float16"
    both = {**base, "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    assert ModelConfig.from_hf_config(both).checkpoint_dtype == "bfloat16"
    with pytest.raises(ModelConfigError, match="disagree") as info:
        ModelConfig.from_hf_config({**base, "torch_dtype": "bfloat16", "dtype": "float32"})
    assert info.value.field == "dtype"
    with pytest.raises(ModelConfigError, match="torch_dtype"):
        ModelConfig.from_hf_config({**base, "torch_dtype": "int8"})
    # The checkpoint dtype does not decide the compute dtype: loading casts.
    save_checkpoint(tmp_path, small_config(), raw_changes={"torch_dtype": "bfloat16", "dtype": "bfloat16"})
    loaded, _ = load_checkpoint(tmp_path, "float32", "cpu")
    assert loaded.dtype == torch.float32


def write_sharded(directory: Path, config: ModelConfig, weight_map_changes=None) -> None:
    model = build_random_model(config, 3)
    tensors = {name: t.clone().contiguous() for name, t in model.state_dict().items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file_name, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(directory / file_name))
        weight_map.update({n: file_name for n in shard_names})
    weight_map.update(weight_map_changes or {})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config.to_hf_config()))
    return model


def test_sharded_checkpoint(tmp_path):
    original = write_sharded(tmp_path, small_config())
    loaded, _ = load_checkpoint(tmp_path, "float32", "cpu")
    assert loaded.fingerprint() == original.fingerprint()


def test_shard_paths_must_stay_inside_the_checkpoint(tmp_path):
    write_sharded(tmp_path / "ckpt", small_config(), {"model.norm.weight": "../elsewhere.safetensors"})
    with pytest.raises(CheckpointError, match="outside"):
        load_checkpoint(tmp_path / "ckpt", "float32", "cpu")


def test_index_naming_a_missing_shard(tmp_path):
    write_sharded(tmp_path, small_config(), {"model.norm.weight": "model-00003-of-00002.safetensors"})
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path, "float32", "cpu")


def test_index_pointing_at_a_shard_without_the_tensor(tmp_path):
    in_second_shard = sorted(build_random_model(small_config(), 3).state_dict())[1]
    write_sharded(tmp_path, small_config(), {in_second_shard: "model-00001-of-00002.safetensors"})
    with pytest.raises(MissingTensorError, match=in_second_shard.replace(".", "[.]")):
        load_checkpoint(tmp_path, "float32", "cpu")


def test_no_weights_and_no_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(small_config().to_hf_config()))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(tmp_path, "float32", "cpu")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "nope", "float32", "cpu")


def test_generation_config_eos_int_or_list(tmp_path):
    save_checkpoint(tmp_path, small_config())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 3, 257], "temperature": 0.6}))
    _, generation = load_checkpoint(tmp_path, "float32", "cpu")
    assert generation.eos_token_ids == (257, 3)
    assert generation.temperature == 0.6
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert load_checkpoint(tmp_path, "float32", "cpu")[1].eos_token_ids == (4,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ModelConfigError, match="eos_token_id"):
        load_checkpoint(tmp_path, "float32", "cpu")


def test_generation_config_validation():
    with pytest.raises(ModelConfigError, match="top_p"):
        GenerationConfig.from_hf_dict({"top_p": 1.5})
    with pytest.raises(ModelConfigError, match="top_k"):
        GenerationConfig.from_hf_dict({"top_k": -1})


LLAMA_BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
}


def test_older_and_newer_rope_keys():
    old = ModelConfig.from_hf_config(
        {**LLAMA_BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    new = ModelConfig.from_hf_config(
        {**LLAMA_BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    )
    assert old == new
    assert old.rope_scaling == LinearRopeScaling(2.0) and old.rope_theta == 5e5
    assert old.num_kv_heads == 4 and old.head_dim == 16  # defaults: MHA, hidden / heads
    llama3 = ModelConfig.from_hf_config(
        {
            **LLAMA_BASE,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        }
    )
    assert llama3.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 512)
    yarn = ModelConfig.from_hf_config(
        {**LLAMA_BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}
    )
    assert isinstance(yarn.rope_scaling, YarnRopeScaling)
    assert yarn.rope_scaling.resolved_attention_factor() == pytest.approx(0.1 * __import__("math").log(4.0) + 1.0)
    assert ModelConfig.from_hf_config({**LLAMA_BASE, "rope_scaling": None}).rope_scaling is None


def test_to_hf_config_round_trips():
    for config in (
        small_config(),
        small_config(rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64), tie_word_embeddings=True),
        small_config(rope_scaling=YarnRopeScaling(4.0, 64), attention_bias=True, attention_output_bias=True),
        replace(small_config(architecture="Qwen2ForCausalLM"), attention_bias=True, eos_token_ids=(1, 2)),
    ):
        assert ModelConfig.from_hf_config(config.to_hf_config()) == config


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
         "rope_scaling.high_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"vocab_size": None}, "vocab_size"),
        ({"hidden_size": 63}, "head_dim"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"eos_token_id": 100}, "eos_token_id"),
        ({"bos_token_id": -2}, "bos_token_id"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"architectures": []}, "architectures"),
        ({"architectures": ["LlamaForCausalLM", "MistralForCausalLM"]}, "architectures"),
        ({"sliding_window": 256}, "sliding_window"),
        ({"torch_dtype": "float64"}, "torch_dtype"),
    ],
)
def test_invalid_configs_name_the_field(changes, field):
    with pytest.raises(ModelConfigError) as info:
        ModelConfig.from_hf_config({**LLAMA_BASE, **changes})
    assert info.value.field == field


def test_sliding_window_that_masks_nothing_is_accepted():
    mistral = {**LLAMA_BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_hf_config(mistral).architecture == "MistralForCausalLM"
    qwen_off = {**LLAMA_BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": False}
    assert ModelConfig.from_hf_config(qwen_off).attention_bias is True
    qwen_on = {**qwen_off, "use_sliding_window": True}
    with pytest.raises(ModelConfigError, match="sliding"):
        ModelConfig.from_hf_config(qwen_on)
