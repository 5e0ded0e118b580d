"""Request states with TensorRT-LLM's numeric values, their predicates, and the transition table.

The numbers matter: "has reached state S" is `state >= S`, and the schedulers accept a request iff
`until <= state < after`. DISAGG_TRANS_ERROR is -1 so that it lies below every window.
"""

from __future__ import annotations

from enum import IntEnum


class LlmRequestState(IntEnum):
    UNKNOWN = 0
    ENCODER_INIT = 1
    DISAGG_CONTEXT_WAIT_SCHEDULER = 7
    DISAGG_GENERATION_INIT = 8
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 9
    CONTEXT_INIT = 10
    DISAGG_CONTEXT_INIT_AND_TRANS = 11
    DISAGG_GENERATION_TRANS_COMPLETE = 12
    GENERATION_IN_PROGRESS = 13
    GENERATION_TO_COMPLETE = 14
    GENERATION_COMPLETE = 20
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 21
    DISAGG_CONTEXT_COMPLETE = 22
    DISAGG_GENERATION_WAIT_TOKENS = 23
    DISAGG_TRANS_ERROR = -1

    # Predicates: these, not raw equality, drive scheduling decisions (TensorRT-LLM
    # cpp/include/tensorrt_llm/batch_manager/llmRequest.h: isContextInitState,
    # isGenerationInProgressState, ...).
    @property
    def is_context_init(self) -> bool:
        return self is S.CONTEXT_INIT or self is S.DISAGG_CONTEXT_INIT_AND_TRANS

    @property
    def is_generation_in_progress(self) -> bool:
        return self in _GENERATION_IN_PROGRESS

    @property
    def is_disagg_generation_init(self) -> bool:
        return self is S.DISAGG_GENERATION_INIT

    @property
    def is_context_finished(self) -> bool:
        return self in _GENERATION_IN_PROGRESS or self is S.DISAGG_CONTEXT_INIT_AND_TRANS

    @property
    def is_finished(self) -> bool:
        return self is S.GENERATION_COMPLETE or self is S.DISAGG_CONTEXT_TRANS_IN_PROGRESS

    @property
    def is_terminal(self) -> bool:
        """No transition leaves this state."""
        return not TRANSITIONS[self]


S = LlmRequestState

_GENERATION_IN_PROGRESS = frozenset(
    {S.GENERATION_IN_PROGRESS, S.GENERATION_TO_COMPLETE, S.DISAGG_GENERATION_TRANS_COMPLETE}
)

# Every legal edge. Abort/cancel of a live request ends it in GENERATION_COMPLETE (TensorRT-LLM
# marks failed and cancelled requests complete), which is why most states list it.
TRANSITIONS: dict[LlmRequestState, frozenset[LlmRequestState]] = {
    S.UNKNOWN: frozenset({S.ENCODER_INIT, S.CONTEXT_INIT, S.DISAGG_GENERATION_INIT, S.DISAGG_CONTEXT_WAIT_SCHEDULER}),
    S.ENCODER_INIT: frozenset({S.CONTEXT_INIT, S.GENERATION_COMPLETE}),
    S.DISAGG_CONTEXT_WAIT_SCHEDULER: frozenset({S.CONTEXT_INIT, S.GENERATION_COMPLETE}),
    S.DISAGG_GENERATION_INIT: frozenset(
        {
            S.DISAGG_GENERATION_TRANS_IN_PROGRESS,
            S.DISAGG_GENERATION_TRANS_COMPLETE,  # synchronous receive
            S.DISAGG_TRANS_ERROR,
            S.GENERATION_COMPLETE,
        }
    ),
    S.DISAGG_GENERATION_TRANS_IN_PROGRESS: frozenset(
        {S.DISAGG_GENERATION_TRANS_COMPLETE, S.DISAGG_TRANS_ERROR, S.GENERATION_COMPLETE}
    ),
    S.CONTEXT_INIT: frozenset(
        {
            S.GENERATION_IN_PROGRESS,  # last context chunk done (colocated)
            S.DISAGG_CONTEXT_INIT_AND_TRANS,
            S.DISAGG_CONTEXT_TRANS_IN_PROGRESS,  # context-only request done, KV handed over
            S.ENCODER_INIT,  # pause of an encoder-decoder request
            S.GENERATION_COMPLETE,  # finished by its first token, or aborted
        }
    ),
    S.DISAGG_CONTEXT_INIT_AND_TRANS: frozenset(
        {S.DISAGG_CONTEXT_TRANS_IN_PROGRESS, S.DISAGG_TRANS_ERROR, S.GENERATION_COMPLETE}
    ),
    S.DISAGG_GENERATION_TRANS_COMPLETE: frozenset(
        {S.GENERATION_IN_PROGRESS, S.CONTEXT_INIT, S.GENERATION_COMPLETE}  # CONTEXT_INIT: paused
    ),
    S.GENERATION_IN_PROGRESS: frozenset(
        {S.GENERATION_TO_COMPLETE, S.GENERATION_COMPLETE, S.CONTEXT_INIT, S.ENCODER_INIT}
    ),
    S.GENERATION_TO_COMPLETE: frozenset({S.GENERATION_COMPLETE}),
    S.GENERATION_COMPLETE: frozenset(),
    S.DISAGG_CONTEXT_TRANS_IN_PROGRESS: frozenset(
        {S.DISAGG_CONTEXT_COMPLETE, S.DISAGG_TRANS_ERROR, S.GENERATION_COMPLETE}
    ),
    S.DISAGG_CONTEXT_COMPLETE: frozenset(),
    S.DISAGG_GENERATION_WAIT_TOKENS: frozenset({S.GENERATION_IN_PROGRESS, S.GENERATION_COMPLETE}),
    S.DISAGG_TRANS_ERROR: frozenset(),
}


def is_legal_transition(old: LlmRequestState, new: LlmRequestState) -> bool:
    return new in TRANSITIONS[old]


def parse_state(name: str) -> LlmRequestState:
    try:
        return LlmRequestState[name]
    except KeyError:
        raise ValueError(f"unknown request state {name!r}") from None
