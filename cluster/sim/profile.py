"""Step-time profiles: how long one engine step takes, as a function of what the step runs.

A profile is a small JSON file (`duet profile` writes a measured one; cluster/sim/roofline.py
estimates one for a GPU from its datasheet). One step of an instance runs context chunks and
generation tokens together (worker/engine.py); the model of its duration is

    step_s = overhead_s + [context_step_s if the step runs any context] + combine(compute_s, memory_s)
    compute_s = prefill_s_per_token x context tokens
              + prefill_s_per_token_pair x attended (query, key) pairs of the context chunks
              + decode_s_per_sequence x generation requests
    memory_s  = decode_s_per_context_token x context length summed over generation requests
              + prefill_s_per_cached_token x cached tokens the context chunks attend

`prefill_s_per_cached_token` is what a context chunk pays per token already in the cache that it
attends (a chunk after the first of its prompt, or after a reused prefix): the engine reads those
tokens' K/V out of the paged cache in every layer (worker/attention.py), whatever the chunk's
length. Without it the per-pair cost has to stand for it too: a short chunk on a long cache (a
prefix hit) attends few pairs per cached token and ran 1.1-1.2 x such a model measured in one
process, a long chunk 0.9 x (on a deployment, whose calibration had prefix hits to fit, 0.8 x to
1.2 x). `duet profile` measures it; a profile measured as deployed holds it at 0 (its calibration
cannot tell it from the per-pair cost: cluster/sim/deployed.py DEPLOYED_WITHOUT). Roofline profiles
leave it at 0: a GPU's attention reads the cache at a bandwidth the compute on it hides.

`context_step_s` is what a step pays for running context at all, beyond its tokens: about 0 for an
engine alone in one process; as deployed (below) the prefill-started event it publishes and the
hand-over its finished context starts run on the instance's other threads during the step, on the
same shared cores. `combine` is "sum" for measured profiles (a linear fit of measured steps: on a CPU the parts do not
overlap) and "max" for roofline ones (a GPU step is bound by compute or by memory traffic, the
weights' read being in `overhead_s`). A KV hand-over costs `handover_fixed_s` of control path
(Prepare and Commit round trips) plus the link's time for `kv_bytes_per_token` x its tokens
(cluster/sim/link.py); `handover_busy_s`, where a deployed profile measured it, instead when the
receiving instance is mid-step as the push starts (it takes the KV in on cores its step is using:
1.4-2.4x the idle figure on this 2-core host).

A profile measured as deployed (`duet profile --deployed`, cluster/sim/deployed.py) also carries
how its steps' times spread around the model, `step_time_ratios` (measured / modelled, at evenly
spaced quantiles, mean 1: instances that share a small host's cores do not take the same time for
the same batch twice, and a queue behind variable steps is longer than behind steady ones; the
simulated instances draw each step's factor from it, seeded); with `context_step_time_ratios`, the
steps that run any context draw from those instead and `step_time_ratios` is the spread of the
steps that do not (a long context step scatters less, relative to its time, than a short decode
step: as deployed here a 300-token chunk's coefficient of variation is 0.2-0.3 against 0.4-0.65 for
decode-only steps, and one spread for both made every long prefill as irregular as a decode step,
which lengthens the queue in front of the prefills), and the control path it measured
around the steps: `rpc_latency_s`, a router-to-instance call's one-way
latency (half the median Ray actor call round trip from the router's event loop, under the
calibration load), and `frontend_latency_s`, the gRPC front end's one-way latency per message (half
the median health-check round trip from the load's client, under that load). None: not measured;
the simulation's own settings apply (cluster/sim/cluster.py SimSettings).

Instances that share one host's cores slow each other down: on this 2-core machine a step that
starts while the other instance is mid-step takes 1.2-1.5x what it takes alone. A deployed profile
measures that too, as `contention`: a step that starts while n of the simulation's other instances
are mid-step takes (1 + contention x n) times the model above, whose coefficients are then those of
a step run alone. It is what lets one profile serve loads that keep the instances busy in different
proportions (a prefill-heavy load leaves a generation instance mostly idle, a decode-heavy one the
prefill instance), and, per busy instance rather than per share of them, clusters of more processes
than the host has cores (each one more takes its share of the cores). It describes one host: a
simulation of more instances than share one host wants a profile without it. 0 (roofline and
single-process profiles): instances that do not share (a GPU each), or a profile that does not know;
the simulated instances then never look at each other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "duet.step_profile.v1"


class ProfileError(ValueError):
    """A profile file that cannot be read or is inconsistent."""


@dataclass(frozen=True)
class StepProfile:
    name: str
    source: str  # "measured" or "roofline"
    device: str
    model: str
    step_overhead_s: float
    prefill_s_per_token: float
    prefill_s_per_token_pair: float
    decode_s_per_sequence: float
    decode_s_per_context_token: float
    handover_fixed_s: float
    kv_bytes_per_token: int
    combine: str = "sum"  # "sum" or "max" (see the module docstring)
    context_step_s: float = 0.0  # seconds a step with any context chunk pays beyond its tokens (the module docstring)
    prefill_s_per_cached_token: float = 0.0  # seconds per cached token a context chunk attends (the module docstring)
    # How a step's time spreads around the model's (the module docstring): the ratio of measured to
    # modelled time at the quantiles (i + 0.5) / n, ascending; () for none.
    step_time_ratios: tuple[float, ...] = ()
    # The spread of the steps that run context, the same way; () for one spread for every step.
    context_step_time_ratios: tuple[float, ...] = ()
    rpc_latency_s: float | None = None  # seconds, one way, as deployed (the module docstring); None: not measured
    frontend_latency_s: float | None = None  # seconds, one way per message, as deployed; None: not measured
    # A step's slowdown per other instance mid-step as it starts (the module docstring).
    contention: float = 0.0
    # The hand-over's control path when the receiving instance is mid-step as the push starts (it
    # shares that instance's cores): None for handover_fixed_s whatever the receiver does.
    handover_busy_s: float | None = None
    # One instance's KV pool on the profiled device, for instances whose configuration sizes none
    # (cluster/sim/cluster.py with_profile_pool): a roofline's estimate of device memory less the
    # weights; None for measured profiles, whose engine configuration is the one measured.
    kv_pool_bytes: int | None = None
    notes: str = ""
    fit: dict[str, Any] = field(default_factory=dict)  # how it was measured: samples, residuals

    def __post_init__(self) -> None:
        if self.combine not in ("sum", "max"):
            raise ProfileError(f"combine: 'sum' or 'max', got {self.combine!r}")
        for name in (
            "step_overhead_s", "prefill_s_per_token", "prefill_s_per_token_pair", "decode_s_per_sequence",
            "decode_s_per_context_token", "handover_fixed_s", "context_step_s", "prefill_s_per_cached_token", "contention",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ProfileError(f"{name}: a number >= 0, got {value!r}")
        for name in ("step_time_ratios", "context_step_time_ratios"):
            ratios = tuple(getattr(self, name))
            if any(not isinstance(r, (int, float)) or not r > 0 for r in ratios) or list(ratios) != sorted(ratios):
                raise ProfileError(f"{name}: ascending numbers > 0, got {getattr(self, name)!r}")
            object.__setattr__(self, name, ratios)  # a JSON list becomes the tuple it stands for
        if self.context_step_time_ratios and not self.step_time_ratios:
            raise ProfileError("context_step_time_ratios without step_time_ratios (the spread of the other steps)")
        for name in ("rpc_latency_s", "frontend_latency_s", "handover_busy_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise ProfileError(f"{name}: a number >= 0 or null, got {value!r}")
        if not isinstance(self.kv_bytes_per_token, int) or self.kv_bytes_per_token <= 0:
            raise ProfileError(f"kv_bytes_per_token: a positive integer, got {self.kv_bytes_per_token!r}")
        pool = self.kv_pool_bytes
        if pool is not None and (type(pool) is not int or pool < self.kv_bytes_per_token):
            raise ProfileError(f"kv_pool_bytes: null or an integer of at least kv_bytes_per_token, got {pool!r}")

    def step_s(
        self, context_tokens: int, context_pairs: int, decode_sequences: int, decode_context_tokens: int,
        context_cached_tokens: int = 0,
    ) -> float:
        """Seconds of one step that runs these (0 for an empty step: the engine does not step);
        `context_cached_tokens`: the cached tokens its context chunks attend, summed over them."""
        if not context_tokens and not decode_sequences:
            return 0.0
        compute_s = (
            self.prefill_s_per_token * context_tokens
            + self.prefill_s_per_token_pair * context_pairs
            + self.decode_s_per_sequence * decode_sequences
        )
        memory_s = self.decode_s_per_context_token * decode_context_tokens + self.prefill_s_per_cached_token * context_cached_tokens
        body_s = compute_s + memory_s if self.combine == "sum" else max(compute_s, memory_s)
        return self.step_overhead_s + (self.context_step_s if context_tokens else 0.0) + body_s

    def contended(self, busy_instances: float) -> float:
        """The factor on a step's time when `busy_instances` other instances sharing its host are
        mid-step as it starts (1.0 for a profile without contention)."""
        return 1.0 + self.contention * busy_instances

    def step_factor(self, u: float, runs_context: bool = False) -> float:
        """The step-time ratio at quantile `u` in [0, 1) (linear between the listed quantiles, the
        ends held): a simulated step takes `step_s` times this for a uniform draw `u`, from
        `context_step_time_ratios` for a step that runs context if the profile has them, else from
        `step_time_ratios`; 1.0 if the profile lists no spread."""
        ratios = (runs_context and self.context_step_time_ratios) or self.step_time_ratios
        if not ratios:
            return 1.0
        position = u * len(ratios) - 0.5
        if position <= 0:
            return ratios[0]
        if position >= len(ratios) - 1:
            return ratios[-1]
        below = int(position)
        return ratios[below] + (ratios[below + 1] - ratios[below]) * (position - below)

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, **asdict(self)}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Any) -> StepProfile:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"not a {PROFILE_FORMAT} profile")
        fields = {k: v for k, v in data.items() if k != "format"}
        try:
            return cls(**fields)
        except TypeError as error:
            raise ProfileError(str(error)) from None


def context_pairs(cached_tokens: int, chunk_tokens: int) -> int:
    """(query, key) pairs a context chunk attends: each of its tokens sees the cache and the chunk's
    tokens before it (causal)."""
    return chunk_tokens * cached_tokens + chunk_tokens * (chunk_tokens + 1) // 2
