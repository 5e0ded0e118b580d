"""One serving instance: the torch model, the paged KV cache, the engine step loop.

`LLM` and `SamplingParams` are exposed lazily so that importing other `worker` modules (or this
package) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:  # pragma: no cover
    from worker.llm import LLM
    from worker.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from worker.llm import LLM

        return LLM
    if name == "SamplingParams":
        from worker.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
