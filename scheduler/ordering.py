"""Order of the active list: the insertion rule and the reorder hooks run before admission.

The schedulers themselves never sort; they walk the list in the order these produce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler.config import ReorderPolicy
from scheduler.request import LlmRequest

ReorderHook = Callable[[Sequence[LlmRequest]], Sequence[LlmRequest]]


def insert_by_priority(active: list[LlmRequest], request: LlmRequest) -> None:
    """Insert before the first request of strictly lower priority, else append (FIFO among equals)."""
    priority = request.priority
    for index, other in enumerate(active):
        if other.priority < priority:
            active.insert(index, request)
            return
    active.append(request)


def identity_order(active: Sequence[LlmRequest]) -> Sequence[LlmRequest]:
    return active


def priority_order(active: Sequence[LlmRequest]) -> Sequence[LlmRequest]:
    """Priority descending; the sort is stable, so arrival order holds among equal priorities."""
    return sorted(active, key=lambda request: -request.priority)


def reorder_hook(policy: ReorderPolicy) -> ReorderHook:
    return priority_order if policy is ReorderPolicy.PRIORITY else identity_order
