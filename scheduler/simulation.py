"""A model-free executor for the scheduler: applies a step's schedule to requests and the block manager.

Used by property tests and the scheduler benchmark to drive many steps without a model. Tokens are
a pure function of (request id, position), so a request that is paused and recomputed must end with
exactly the tokens it would have had unpaused. The real engine (worker/) follows the same order of
block operations: evict paused requests, allocate for this step, run, then advance.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Sequence

from scheduler.block_manager import BlockManager
from scheduler.request import LlmRequest
from scheduler.scheduler import ScheduleOutput
from scheduler.state import LlmRequestState

S = LlmRequestState


def synthetic_token(request_id: Hashable, position: int, vocab_size: int = 32000) -> int:
    """The token a request "generates" at `position` (deterministic, independent of scheduling)."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % vocab_size


class SimulatedExecutor:
    def __init__(self, kv: BlockManager | None, max_input_len_for_pause: int = 0x7FFFFFFF) -> None:
        self.kv = kv
        self.max_input_len_for_pause = max_input_len_for_pause
        self.num_pauses = 0

    def prepare(self, output: ScheduleOutput) -> None:
        """Before the forward pass: evict paused requests, allocate KV for this step."""
        kv = self.kv
        for request in output.paused:
            if kv is not None and kv.has_sequence(request.request_id):
                kv.remove_sequence(request.request_id)
            request.pause(self.max_input_len_for_pause)
            self.num_pauses += 1
        for request in output.disagg_generation_init:
            if kv is not None:
                kv.add_sequence(request, reuse=False)
            request.set_state(S.DISAGG_GENERATION_TRANS_IN_PROGRESS)
        for request in output.context:
            if kv is not None and not kv.has_sequence(request.request_id):
                kv.add_sequence(request)
        for request in output.generation:
            if kv is not None:
                kv.add_token(request.request_id)

    def complete(self, output: ScheduleOutput) -> list[LlmRequest]:
        """After the forward pass: advance chunks, append tokens; returns the requests that finished."""
        kv = self.kv
        finished: list[LlmRequest] = []
        for request in output.context:
            request.move_to_next_context_chunk()
            if request.context_remaining_length == 0:
                if kv is not None:
                    kv.store_context_blocks(request)
                request.add_new_token(synthetic_token(request.request_id, request.num_tokens(0)))
                request.set_state(S.GENERATION_IN_PROGRESS)
                self._finish_if_done(request, finished)
        for request in output.generation:
            if request.state is S.DISAGG_GENERATION_TRANS_COMPLETE:
                request.set_state(S.GENERATION_IN_PROGRESS)
            request.add_new_token(synthetic_token(request.request_id, request.num_tokens(0)))
            self._finish_if_done(request, finished)
        return finished

    def receive_all(self, requests: Sequence[LlmRequest]) -> list[LlmRequest]:
        """Complete every pending KV reception (the first token arrives with the KV); returns the
        requests that the first token already finished."""
        finished: list[LlmRequest] = []
        for request in requests:
            if request.state is S.DISAGG_GENERATION_TRANS_IN_PROGRESS:
                request.set_state(S.DISAGG_GENERATION_TRANS_COMPLETE)
                request.add_new_token(synthetic_token(request.request_id, request.num_tokens(0)))
                request.context_current_position = request.prompt_len
                self._finish_if_done(request, finished)
        return finished

    def _finish_if_done(self, request: LlmRequest, finished: list[LlmRequest]) -> None:
        if request.num_tokens(0) >= request.prompt_len + request.max_new_tokens:
            request.set_state(S.GENERATION_COMPLETE)
            if self.kv is not None:
                self.kv.remove_sequence(request.request_id)
            finished.append(request)
