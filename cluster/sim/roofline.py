"""An analytical step-time profile for GPUs that cannot be measured here: an estimate, not a measurement.

Inputs (every one is documented where it is declared; `duet profile --roofline --help` lists them):
a Llama-family model config (layers, hidden size, heads, KV heads, head dim, MLP size, vocabulary),
the bytes per weight and per KV element, and a device's peak dense compute (FLOP/s) and memory
bandwidth (bytes/s), each derated by an achievable fraction (`compute_efficiency`,
`memory_efficiency`), plus a fixed per-step overhead (kernel launches, the scheduler, sampling) and
a fixed hand-over control-path cost.

The model, per step (cluster/sim/profile.py, combine = "max"):
- compute: 2 x parameters FLOPs per token processed (context or generation), plus 4 x layers x
  query heads x head dim FLOPs per attended (query, key) pair of a context chunk;
- memory: every weight read once per step (in the overhead, as it does not depend on the batch),
  plus each generation request's KV read (KV bytes per token x its context length);
- the step takes the larger of the two, plus the overhead.

The KV pool of one instance (`kv_pool_bytes`, what `duet sim` gives an instance whose configuration
sizes no pool): device memory x `memory_utilization` (0.9, vLLM's default), less
`activation_reserve` (5 % of device memory: activations, the CUDA context) and the weights with
their embedding table; Llama 3 8B on an H100 keeps ~53 GiB, ~432,000 tokens. A model whose weights
do not fit one device gets none (tensor parallelism is not modelled).

What it leaves out, and why it is an estimate: attention kernels below peak at short contexts,
communication between tensor-parallel ranks, CUDA graphs, quantised kernels, and the decode-side
compute of attention. Measure (`duet profile`) wherever the device is at hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cluster.sim.profile import ProfileError, StepProfile


@dataclass(frozen=True)
class LlamaShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @property
    def parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attention = h * (self.num_heads * d) * 2 + h * (self.num_kv_heads * d) * 2  # q, o; k, v
        mlp = 3 * h * self.intermediate_size  # gate, up, down (SwiGLU)
        return self.num_layers * (attention + mlp) + self.vocab_size * h  # + the LM head (embedding reads are rows)

    @property
    def stored_parameters(self) -> int:
        """The weights held in memory: `parameters` and the embedding table (read as rows, but
        stored; none of these models ties it to the LM head)."""
        return self.parameters + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16/fp16 FLOP/s, from the datasheet
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int  # device memory as the driver reports it (nvidia-smi's total)


MIB = 1 << 20


# Hugging Face config.json figures.
MODELS: dict[str, LlamaShape] = {
    "llama-3-8b": LlamaShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": LlamaShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "qwen2-7b": LlamaShape("qwen2-7b", 28, 3584, 28, 4, 128, 18944, 152064),
    "mistral-7b": LlamaShape("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000),
}
# Datasheet peaks (dense, no sparsity); memory as nvidia-smi reports it.
DEVICES: dict[str, Device] = {
    "h100-sxm": Device("h100-sxm", 989e12, 3.35e12, 81_559 * MIB),
    "h200": Device("h200", 989e12, 4.8e12, 143_771 * MIB),
    "a100-80g": Device("a100-80g", 312e12, 2.04e12, 81_920 * MIB),
    "l40s": Device("l40s", 362e12, 0.864e12, 46_068 * MIB),
}


@dataclass(frozen=True)
class RooflineInputs:
    model: LlamaShape
    device: Device
    weight_bytes: int = 2  # bf16
    kv_bytes: int = 2
    compute_efficiency: float = 0.5  # achievable fraction of peak FLOP/s in large GEMMs
    memory_efficiency: float = 0.8  # achievable fraction of peak bandwidth in streaming reads
    step_overhead_s: float = 2e-3  # launches, scheduler, sampler per step
    handover_fixed_s: float = 2e-3  # Prepare + Commit round trips of one hand-over
    # The KV pool: the share of device memory the engine takes (vLLM's gpu_memory_utilization
    # default), less the weights and a reserve for activations and the CUDA context.
    memory_utilization: float = 0.9
    activation_reserve: float = 0.05  # of device memory

    def kv_pool_bytes(self) -> int | None:
        """One instance's KV pool on the device (one GPU, no tensor parallelism); None when the
        weights leave no room."""
        device_bytes = self.device.memory_bytes
        free = device_bytes * (self.memory_utilization - self.activation_reserve) - self.model.stored_parameters * self.weight_bytes
        return int(free) if free >= self.model.kv_bytes_per_token(self.kv_bytes) else None


def roofline_profile(inputs: RooflineInputs) -> StepProfile:
    model, device = inputs.model, inputs.device
    flops = device.peak_flops * inputs.compute_efficiency
    bandwidth = device.memory_bandwidth_bytes_per_s * inputs.memory_efficiency
    per_token_s = 2 * model.parameters / flops
    weights_read_s = model.parameters * inputs.weight_bytes / bandwidth
    kv_per_token = model.kv_bytes_per_token(inputs.kv_bytes)
    pool_bytes = inputs.kv_pool_bytes()
    return StepProfile(
        name=f"roofline-{device.name}-{model.name}",
        source="roofline",
        device=device.name,
        model=model.name,
        step_overhead_s=inputs.step_overhead_s + weights_read_s,
        prefill_s_per_token=per_token_s,
        prefill_s_per_token_pair=4 * model.num_layers * model.num_heads * model.head_dim / flops,
        decode_s_per_sequence=per_token_s,
        decode_s_per_context_token=kv_per_token / bandwidth,
        handover_fixed_s=inputs.handover_fixed_s,
        kv_bytes_per_token=kv_per_token,
        combine="max",
        kv_pool_bytes=pool_bytes,
        notes="an analytical estimate (cluster/sim/roofline.py), not a measurement"
        + ("" if pool_bytes is not None else f"; the weights do not fit one {device.name} (no KV pool estimate)"),
        fit={"inputs": {**asdict(inputs), "parameters": model.parameters}},
    )


def roofline_profile_from_spec(spec: str) -> StepProfile:
    """`roofline:DEVICE:MODEL` (names from DEVICES and MODELS)."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "roofline":
        raise ProfileError(f"{spec!r}: expected roofline:DEVICE:MODEL")
    _, device, model = parts
    if device not in DEVICES:
        raise ProfileError(f"{spec!r}: unknown device {device!r}; one of {', '.join(DEVICES)}")
    if model not in MODELS:
        raise ProfileError(f"{spec!r}: unknown model {model!r}; one of {', '.join(MODELS)}")
    return roofline_profile(RooflineInputs(MODELS[model], DEVICES[device]))
