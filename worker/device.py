"""Resolve the user's device and dtype choices ("auto" included) into torch values.

"auto" prefers CUDA when present. dtype "auto" for a checkpoint (`resolve_model_dtype`) follows
vLLM: on a CPU the checkpoint's own dtype, so that results match what it was saved in (bfloat16
instead of a float32 checkpoint changes greedy tokens within a few steps); on a GPU a float32 (or
unstated) checkpoint runs in bfloat16 where the GPU supports it, else float16, and a half-precision
checkpoint in its dtype (float16 for bfloat16 where bfloat16 is unsupported). For the built-in model
(`resolve_dtype`), "auto" picks bfloat16 only where the hardware computes it natively (a CUDA device
that supports it, or a CPU with native bf16 instructions), otherwise float32: emulated bf16 on a CPU
without those instructions is slower than fp32.
"""

from __future__ import annotations

import logging
import re

import torch

logger = logging.getLogger(__name__)

DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
NAME_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}

_CUDA_SPEC = re.compile(r"^cuda(?::(\d+))?$")


class DeviceConfigError(ValueError):
    """An invalid or unavailable device or dtype choice; `field` names the offending setting."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def resolve_device(spec: str) -> torch.device:
    """Map "auto" | "cpu" | "cuda" | "cuda:N" to a torch.device; a CUDA choice must be present."""
    if not isinstance(spec, str):
        raise DeviceConfigError("device", f"expected a string, got {type(spec).__name__}")
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    match = _CUDA_SPEC.match(spec)
    if match is None:
        raise DeviceConfigError("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {spec!r}")
    if not torch.cuda.is_available():
        raise DeviceConfigError("device", f"{spec!r} requested but CUDA is not available")
    index = int(match.group(1)) if match.group(1) is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceConfigError("device", f"{spec!r} requested but only {count} CUDA device(s) exist")
    return torch.device("cuda", index)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 / AMX), as oneDNN reports it."""
    if not torch.backends.mkldnn.is_available():
        return False
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is None:  # older or stripped builds: treat as unsupported rather than guess
        return False
    return bool(probe())


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """Map "auto" | "float32" | "bfloat16" | "float16" to a torch dtype for `device`."""
    if not isinstance(spec, str):
        raise DeviceConfigError("dtype", f"expected a string, got {type(spec).__name__}")
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    dtype = DTYPE_BY_NAME.get(spec)
    if dtype is None:
        raise DeviceConfigError("dtype", f"must be 'auto' or one of {sorted(DTYPE_BY_NAME)}, got {spec!r}")
    return dtype


def resolve_model_dtype(spec: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`resolve_dtype` for a checkpoint whose config.json names `checkpoint_dtype` (None: unstated,
    which transformers and vLLM read as float32)."""
    if spec != "auto":
        return resolve_dtype(spec, device)
    saved = DTYPE_BY_NAME[checkpoint_dtype or "float32"]
    if device.type != "cuda":
        return saved
    if saved is torch.float32 or saved is torch.bfloat16:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return saved


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name ("float32", "bfloat16", "float16") used by KvLayout and fingerprints."""
    name = NAME_BY_DTYPE.get(dtype)
    if name is None:
        raise DeviceConfigError("dtype", f"unsupported torch dtype {dtype}")
    return name
