"""Load a local Hugging Face checkpoint directory: config.json, safetensors weights (single file or
sharded with model.safetensors.index.json), generation_config.json and tokenizer files.

Weights are read only with `safetensors` (never torch.load / pickle). Every parameter the model
needs must be present (a tied lm_head may be absent); extra tensors (e.g. rotary inv_freq buffers of
old exports) are ignored with a debug log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from worker.device import resolve_device, resolve_model_dtype
from worker.model import DecoderLM
from worker.model_config import GenerationConfig, ModelConfig
from worker.tokenizer import HfTokenizer

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (missing or malformed files, wrong shapes)."""


class MissingTensorError(CheckpointError):
    def __init__(self, tensor_name: str, where: str) -> None:
        super().__init__(f"tensor {tensor_name!r} is missing from {where}")
        self.tensor_name = tensor_name


def read_json_object(path: Path) -> Mapping[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error}") from error
    except ValueError as error:
        raise CheckpointError(f"{path}: invalid JSON: {error}") from error
    if not isinstance(value, Mapping):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def load_model_config(path: str | Path) -> ModelConfig:
    directory = Path(path)
    return ModelConfig.from_hf_config(read_json_object(directory / "config.json"))


def load_generation_config(path: str | Path, config: ModelConfig) -> GenerationConfig:
    """generation_config.json when present (its eos ids win, as in transformers), else config.json's ids."""
    file = Path(path) / "generation_config.json"
    if file.is_file():
        generation = GenerationConfig.from_hf_dict(read_json_object(file))
        if generation.eos_token_ids:
            return generation
        return replace(generation, eos_token_ids=config.eos_token_ids)
    return GenerationConfig(eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> file holding it (for a sharded checkpoint, from the index's weight_map)."""
    index_file = directory / INDEX_FILE
    if index_file.is_file():
        weight_map = read_json_object(index_file).get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise CheckpointError(f"{index_file}: 'weight_map' must be a non-empty object")
        root = directory.resolve()
        files: dict[str, Path] = {}
        for name, file_name in weight_map.items():
            if not isinstance(file_name, str):
                raise CheckpointError(f"{index_file}: weight_map[{name!r}] must be a file name")
            file = (directory / file_name).resolve()
            if root not in file.parents:  # a shard name must not point outside the checkpoint
                raise CheckpointError(f"{index_file}: shard {file_name!r} lies outside {directory}")
            files[name] = file
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt", device="cpu") as handle:
            return {name: single for name in handle.keys()}
    raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def load_weights(model: DecoderLM, directory: str | Path) -> None:
    """Copy every parameter of `model` from the checkpoint's safetensors files (cast to the model dtype)."""
    from safetensors import safe_open

    directory = Path(directory)
    files = _weight_files(directory)
    needed = dict(model.named_parameters())  # a tied lm_head appears once, under embed_tokens
    if model.config.tie_word_embeddings:
        needed.pop("lm_head.weight", None)
    for name in needed:
        if name not in files:
            raise MissingTensorError(name, str(directory))
    extra = sorted(set(files) - set(needed))
    if extra:
        logger.debug("ignoring %d checkpoint tensors the model does not use: %s", len(extra), extra[:8])
    by_file: dict[Path, list[str]] = {}
    for name in needed:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            if not file.is_file():
                raise CheckpointError(f"shard {file} listed in the index does not exist")
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                present = set(handle.keys())
                for name in names:
                    if name not in present:
                        raise MissingTensorError(name, str(file))
                    tensor = handle.get_tensor(name)
                    param = needed[name]
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise CheckpointError(
                            f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
    logger.info("loaded %d tensors from %s", len(needed), directory)


def load_checkpoint(
    path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"
) -> tuple[DecoderLM, GenerationConfig]:
    """Model and generation config (no tokenizer) from a checkpoint directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    config = load_model_config(directory)
    resolved_device = device if isinstance(device, torch.device) else resolve_device(device)
    resolved_dtype = (
        dtype if isinstance(dtype, torch.dtype) else resolve_model_dtype(dtype, resolved_device, config.checkpoint_dtype)
    )
    model = DecoderLM(config, dtype=resolved_dtype, device=resolved_device)
    load_weights(model, directory)
    return model, load_generation_config(directory, config)


def load_model(
    path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"
) -> tuple[DecoderLM, HfTokenizer, GenerationConfig]:
    """(model, tokenizer, generation config) from a local HF directory; tokenizer.json is required."""
    model, generation = load_checkpoint(path, dtype, device)
    extra_eos = tuple(dict.fromkeys([*generation.eos_token_ids, *model.config.eos_token_ids]))
    tokenizer = HfTokenizer.from_directory(path, extra_eos_token_ids=extra_eos)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocab_size {model.config.vocab_size}"
        )
    return model, tokenizer, generation
