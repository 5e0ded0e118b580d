"""Merging a request's token outputs for a stream interval before they are reported (vLLM's and
TensorRT-LLM's stream_interval): fewer, larger messages to the router, which in a process per instance
pays a Ray call and its own work per poll, so at low load one call per token (about 1 ms of its CPU).

Only plain token outputs wait: a request's first output, its last (`finished`), a context's first
token (`context_done`), errors and hand-over acknowledgements go out at once, and whatever a request
holds goes out before them, in order; so do held tokens of a request with a state event to report.
TTFT and end-to-end latency are those of reporting every step; tokens in between arrive in groups at
most `interval_s` old. The simulator's instances (cluster/sim/instance.py) merge by the same rule.
"""

from __future__ import annotations

from collections.abc import Iterable

from worker.protocol import RequestOutput


class _Held:
    __slots__ = ("first_s", "outputs")

    def __init__(self, first_s: float, output: RequestOutput) -> None:
        self.first_s = first_s  # when its first token was held: it is due an interval later
        self.outputs = [output]


def merged(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive plain outputs of one request as one: their tokens, text and logprobs in order, the
    counts of the last."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return RequestOutput(
        last.request_id,
        tuple(token for output in outputs for token in output.new_token_ids),
        "".join(output.text_delta for output in outputs),
        tuple(logprob for output in outputs for logprob in output.logprobs),
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
    )


def _plain(output: RequestOutput) -> bool:
    return not (output.finished or output.context_done or output.handed_over or output.error is not None)


class StreamMerger:
    """Holds plain token outputs per request for up to `interval_s` (not thread-safe: the instance
    calls it under its mailbox lock)."""

    def __init__(self, interval_s: float) -> None:
        if not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s!r}")
        self.interval_s = interval_s
        self._held: dict[str, _Held] = {}
        self._started: set[str] = set()  # requests whose first output went out

    def add(self, outputs: list[RequestOutput], event_request_ids: Iterable[str], now_s: float) -> list[RequestOutput]:
        """What goes out now of a step's outputs (in order), holding the rest; the held tokens of a
        request with a state event among `event_request_ids` go out too. Without an interval: the
        outputs themselves (the per-step path pays one test)."""
        if not self.interval_s:
            return outputs
        ready: list[RequestOutput] = []
        for request_id in event_request_ids:
            self._release(request_id, ready)
        for output in outputs:
            request_id = output.request_id
            if _plain(output) and request_id in self._started:
                held = self._held.get(request_id)
                if held is None:
                    self._held[request_id] = _Held(now_s, output)
                else:
                    held.outputs.append(output)
                continue
            self._release(request_id, ready)
            ready.append(output)
            if output.finished:
                self._started.discard(request_id)
            else:
                self._started.add(request_id)
        return ready

    def take_due(self, now_s: float) -> list[RequestOutput]:
        """The held outputs due by `now_s` (held for the interval), each request's merged into one."""
        due_s = now_s - self.interval_s
        ready: list[RequestOutput] = []
        for request_id in [rid for rid, held in self._held.items() if held.first_s <= due_s]:
            self._release(request_id, ready)
        return ready

    def next_due_s(self) -> float | None:
        """When the oldest held output is due; None when nothing is held."""
        if not self._held:
            return None
        return min(held.first_s for held in self._held.values()) + self.interval_s

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _release(self, request_id: str, ready: list[RequestOutput]) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            ready.append(merged(held.outputs))
