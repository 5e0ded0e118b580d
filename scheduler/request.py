"""The request object the schedulers work on (TensorRT-LLM's LlmRequest, the parts they rely on).

Hot path: the schedulers read these attributes for thousands of requests every step, so the class
uses __slots__ and plain attributes; derived quantities are cheap properties or methods.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from scheduler.errors import IllegalStateTransition, InvalidFieldError
from scheduler.state import TRANSITIONS, LlmRequestState

S = LlmRequestState
_CONTEXT_INIT = S.CONTEXT_INIT
_CONTEXT_INIT_AND_TRANS = S.DISAGG_CONTEXT_INIT_AND_TRANS
_GEN_INIT = S.DISAGG_GENERATION_INIT
_TRANS_COMPLETE = S.DISAGG_GENERATION_TRANS_COMPLETE

DEFAULT_PRIORITY = 0.5


def _require_int(field: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldError(field, f"must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise InvalidFieldError(field, f"must be >= {minimum}, got {value}")
    return value


class LlmRequest:
    __slots__ = (
        "request_id",
        "tokens",
        "prompt_len",
        "orig_prompt_len",
        "max_new_tokens",
        "state",
        "context_current_position",
        "context_chunk_size",
        "prepopulated_prompt_len",
        "draft_tokens",
        "beam_width",
        "beam_width_by_iter",
        "lora_task_id",
        "priority",
        "estimated_reusable_tokens",
        "snapshot_points",
        "encoder_input_len",
        "decoding_iter",
        "num_pauses",
        "block_keys",
        "is_plain",
        "kv_sequence",
        "block_digests",
        "prefix_walk",
    )

    def __init__(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        beam_width: int = 1,
        lora_task_id: int | None = None,
        priority: float = DEFAULT_PRIORITY,
        num_draft_tokens: int = 0,
        snapshot_points: Sequence[int] = (),
        encoder_input_len: int | None = None,
        state: LlmRequestState | None = None,
        context_chunk_size: int | None = None,
    ) -> None:
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise InvalidFieldError("prompt_token_ids", "must not be empty")
        _require_int("max_new_tokens", max_new_tokens, 1)
        _require_int("beam_width", beam_width, 1)
        _require_int("num_draft_tokens", num_draft_tokens, 0)
        if lora_task_id is not None:
            _require_int("lora_task_id", lora_task_id, 0)
        if encoder_input_len is not None:
            _require_int("encoder_input_len", encoder_input_len, 1)
        if not isinstance(priority, (int, float)) or isinstance(priority, bool) or not (0.0 <= priority <= 1.0):
            raise InvalidFieldError("priority", f"must be a number in [0, 1], got {priority!r}")
        points = tuple(snapshot_points)
        for point in points:
            _require_int("snapshot_points", point, 1)
        if list(points) != sorted(set(points)) or (points and points[-1] > prompt_len):
            raise InvalidFieldError(
                "snapshot_points", "must be strictly increasing positions within the prompt"
            )

        self.request_id = request_id
        base = list(prompt_token_ids)
        self.tokens: list[list[int]] = [base] + [list(base) for _ in range(beam_width - 1)]
        self.prompt_len = prompt_len
        self.orig_prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        if state is None:
            state = S.ENCODER_INIT if encoder_input_len is not None else S.CONTEXT_INIT
        self.state = state
        self.context_current_position = 0
        self.context_chunk_size = prompt_len  # constructor default: the whole prompt
        self.prepopulated_prompt_len = 0
        self.draft_tokens: list[int] = [0] * num_draft_tokens
        self.beam_width = beam_width
        self.beam_width_by_iter = beam_width
        self.lora_task_id = lora_task_id
        self.priority = float(priority)
        self.estimated_reusable_tokens = 0
        self.snapshot_points = points
        self.encoder_input_len = encoder_input_len
        self.decoding_iter = 0
        self.num_pauses = 0
        # Cached (lora, tuple-of-block-tokens) keys of the prompt's full blocks, filled lazily by the
        # block manager; reset whenever the prompt changes (pause).
        self.block_keys: tuple[tuple[int, ...], ...] | None = None
        # No LoRA task and one beam: the schedulers' hot paths handle such requests inline.
        self.is_plain = lora_task_id is None and beam_width == 1
        # The self-attention KV sequence while it has one (set and cleared by the block manager;
        # read by the schedulers' hot paths instead of a lookup by id).
        self.kv_sequence = None
        # Per-block chain hashes of block_keys (dict keys of the reuse tree; cheap to hash), and
        # the block manager's last walk of its tree for this prompt (block_manager._PrefixWalk).
        self.block_digests: tuple[int, ...] | None = None
        self.prefix_walk = None
        if context_chunk_size is not None:
            self.set_context_chunk_size(context_chunk_size)

    def __repr__(self) -> str:
        return (
            f"LlmRequest(id={self.request_id!r}, state={self.state.name}, prompt_len={self.prompt_len}, "
            f"tokens={self.num_tokens(0)}, pos={self.context_current_position}, chunk={self.context_chunk_size})"
        )

    # --- states -------------------------------------------------------------------------------
    def set_state(self, new_state: LlmRequestState) -> None:
        """Move to `new_state`, enforcing the transition table."""
        if new_state is not self.state and new_state not in TRANSITIONS[self.state]:
            raise IllegalStateTransition(
                f"request {self.request_id!r}: {self.state.name} -> {new_state.name} is not a legal transition"
            )
        self.state = new_state

    def is_context_init_state(self) -> bool:
        state = self.state
        return state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS

    def is_generation_in_progress_state(self) -> bool:
        return self.state.is_generation_in_progress

    def is_disagg_generation_init_state(self) -> bool:
        return self.state is _GEN_INIT

    # --- tokens -------------------------------------------------------------------------------
    def num_tokens(self, beam: int = 0) -> int:
        return len(self.tokens[beam])

    @property
    def max_num_generated_tokens(self) -> int:
        return max(len(beam) for beam in self.tokens) - self.prompt_len

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.tokens[0][: self.prompt_len]

    def add_new_token(self, token: int, beam: int = 0) -> None:
        self.tokens[beam].append(token)

    def add_new_tokens(self, beam_tokens: Sequence[int]) -> None:
        """One new token per beam."""
        for beam, token in enumerate(beam_tokens):
            self.tokens[beam].append(token)

    # --- drafts -------------------------------------------------------------------------------
    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_tokens)

    def has_draft_tokens(self) -> bool:
        return bool(self.draft_tokens)

    def set_num_draft_tokens(self, count: int) -> None:
        _require_int("num_draft_tokens", count, 0)
        self.draft_tokens = [0] * count

    def discard_draft_tokens(self, count: int) -> None:
        if not 0 < count <= len(self.draft_tokens):
            raise InvalidFieldError(
                "num_draft_tokens", f"cannot discard {count} of {len(self.draft_tokens)} draft tokens"
            )
        del self.draft_tokens[len(self.draft_tokens) - count :]

    # --- context chunks -----------------------------------------------------------------------
    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    def set_context_chunk_size(self, size: int) -> None:
        """Store min(size, remaining), as TensorRT-LLM does (a silent clamp, by design)."""
        state = self.state
        if not (
            state is _CONTEXT_INIT
            or state is _CONTEXT_INIT_AND_TRANS
            or state is _GEN_INIT
            or state is _TRANS_COMPLETE
        ):
            raise IllegalStateTransition(
                f"request {self.request_id!r}: chunk size can only be set in a context state, not {state.name}"
            )
        if size < 0:
            raise InvalidFieldError("context_chunk_size", f"must be >= 0, got {size}")
        remaining = self.prompt_len - self.context_current_position
        self.context_chunk_size = size if size < remaining else remaining

    def is_last_context_chunk(self) -> bool:
        state = self.state
        return (
            state is _GEN_INIT
            or state is _TRANS_COMPLETE
            or self.context_current_position + self.context_chunk_size == self.prompt_len
        )

    def is_first_context_chunk(self) -> bool:
        # The reused prefix counts as already done: "first" is relative to the prepopulated length.
        return self.context_current_position == self.prepopulated_prompt_len

    def move_to_next_context_chunk(self) -> None:
        self.context_current_position += self.context_chunk_size
        self.context_chunk_size = 0

    def set_prepopulated_prompt_len(self, prepopulated_len: int, tokens_per_block: int) -> None:
        """Skip a reused prefix: shift the chunk window right instead of enlarging it."""
        if not 0 <= prepopulated_len < self.prompt_len:
            raise InvalidFieldError(
                "prepopulated_prompt_len",
                f"must be in [0, prompt_len={self.prompt_len}), got {prepopulated_len}",
            )
        self.prepopulated_prompt_len = prepopulated_len
        if prepopulated_len > 0:
            chunk = self.context_chunk_size
            if prepopulated_len + chunk < self.prompt_len:
                # Keep the chunk's end on a block boundary.
                end = (prepopulated_len + chunk) // tokens_per_block * tokens_per_block
                chunk = end - prepopulated_len
            self.context_current_position = prepopulated_len
            self.set_context_chunk_size(max(chunk, 0))

    def next_snapshot_point(self) -> int | None:
        """The first snapshot point strictly after the current position, if any."""
        position = self.context_current_position
        for point in self.snapshot_points:
            if point > position:
                return point
        return None

    # --- pause / recompute --------------------------------------------------------------------
    def pause(self, max_input_len: int) -> None:
        """Evict the request: its KV is dropped and it will be recomputed from CONTEXT_INIT.

        Beam width 1: the generated tokens join the prompt (capped at max_input_len) and
        max_new_tokens shrinks by as much, so the request still ends at the same total length.
        Beam width > 1: the beams are truncated back to the prompt (generated tokens discarded).
        """
        _require_int("max_input_len", max_input_len, 1)
        if self.beam_width > 1:
            for beam in self.tokens:
                del beam[self.prompt_len :]
        else:
            beam = self.tokens[0]
            new_prompt_len = min(max_input_len, len(beam))
            del beam[new_prompt_len:]
            self.max_new_tokens -= new_prompt_len - self.prompt_len
            self.prompt_len = new_prompt_len
        new_state = S.ENCODER_INIT if self.encoder_input_len is not None else S.CONTEXT_INIT
        self.set_state(new_state)
        self.context_current_position = 0
        self.prepopulated_prompt_len = 0
        self.context_chunk_size = self.prompt_len
        self.decoding_iter = 0
        self.num_pauses += 1
        self.block_keys = None
        self.block_digests = None
        self.prefix_walk = None
