"""LoRA/PEFT page budget (the part of TensorRT-LLM's PEFT cache manager the schedulers use)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.errors import InvalidFieldError
from scheduler.request import LlmRequest


@dataclass(frozen=True)
class PeftBudget:
    """Every LoRA task costs `pages_per_task` device pages the first time a scheduling pass sees it."""

    max_device_pages: int
    pages_per_task: int

    def __post_init__(self) -> None:
        for name in ("max_device_pages", "pages_per_task"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidFieldError(name, f"must be a non-negative integer, got {value!r}")

    def determine_num_pages(self, request: LlmRequest) -> int:
        return 0 if request.lora_task_id is None else self.pages_per_task
