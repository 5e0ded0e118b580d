"""The accounting side of the paged KV cache (TensorRT-LLM's KVCacheManager, single window).

Blocks are integers 0..num_blocks-1; the worker's KV tensors are indexed by these ids, so this class
is the one source of truth for which block belongs to whom.

- Reference counts per block; a block is free when its count is 0.
- Prefix reuse: a tree keyed by (LoRA task, chain of full token blocks). A full prompt block is
  published by `store_context_blocks` once its KV has been computed; a later sequence whose prompt
  starts with the same blocks shares them instead of allocating (`add_sequence`).
- Published blocks keep their content when their last holder goes ("cached-but-free"); they count
  as free and are evicted, least recently released first, only when a fresh block is needed.
- The scheduling snapshot used by MAX_UTILIZATION simulates freeing sequences without touching the
  real counts; it is copy-on-write, so starting one costs O(1), not O(allocated blocks).
- Optional prefix-cache events (stable block hashes stored / removed) for the router's index.

Attention windows: one window W, which is also the maximum sequence length (no cyclic reuse of
blocks, no variable-window attention).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from scheduler.block_hash import (
    PrefixEvent,
    PrefixEventKind,
    prompt_blocks,
    prompt_chain,
    prompt_stored_events,
)
from scheduler.errors import BlockAccountingError, InvalidFieldError, OutOfBlocksError
from scheduler.request import LlmRequest
from scheduler.state import LlmRequestState

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_CONTEXT_INIT_AND_TRANS = LlmRequestState.DISAGG_CONTEXT_INIT_AND_TRANS
_GEN_INIT = LlmRequestState.DISAGG_GENERATION_INIT
_GENERATION_STATES = frozenset(
    {
        LlmRequestState.GENERATION_IN_PROGRESS,
        LlmRequestState.GENERATION_TO_COMPLETE,
        LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE,
    }
)


@dataclass(frozen=True)
class BlockManagerConfig:
    tokens_per_block: int
    num_blocks: int
    max_attention_window: int
    max_seq_len: int | None = None  # defaults to max_attention_window
    sink_token_len: int = 0
    temporary_attention_window: int = 0
    max_beam_width: int = 1
    enable_block_reuse: bool = False
    two_steps_lookahead: bool = False
    is_cross_attention: bool = False
    record_events: bool = False

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "num_blocks", "max_attention_window", "max_beam_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidFieldError(name, f"must be a positive integer, got {value!r}")
        for name in ("sink_token_len", "temporary_attention_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidFieldError(name, f"must be a non-negative integer, got {value!r}")
        if self.max_seq_len is not None and (
            isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 1
        ):
            raise InvalidFieldError("max_seq_len", f"must be a positive integer, got {self.max_seq_len!r}")
        if self.is_cross_attention and self.enable_block_reuse:
            raise InvalidFieldError("enable_block_reuse", "the cross-attention pool never reuses blocks")

    @property
    def effective_max_seq_len(self) -> int:
        return self.max_attention_window if self.max_seq_len is None else self.max_seq_len

    @property
    def max_token_num(self) -> int:
        """The most tokens one sequence can hold in the window (the limit TensorRT-LLM
        cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp getNeededBlocksOneStep checks)."""
        extra = (
            self.tokens_per_block
            if self.effective_max_seq_len > self.max_attention_window and self.max_beam_width > 1
            else 0
        )
        return self.max_attention_window + self.sink_token_len + extra


class _ReuseNode:
    """A published full block: its token content (within its parent's chain) and its block id.

    Children are keyed by the chain hash of their tokens (an int: cheap to hash, unlike a tuple of
    tokens); a hit is confirmed by comparing the tokens themselves, so a hash collision can never
    make one prefix reuse another's KV."""

    __slots__ = ("key", "child_key", "block_id", "parent", "children", "digest", "__weakref__")

    def __init__(self, key: tuple[int, ...] | None, child_key: int, block_id: int, parent: _ReuseNode | None) -> None:
        self.key = key
        self.child_key = child_key
        self.block_id = block_id
        self.parent = parent
        self.children: dict[int, _ReuseNode] = {}
        self.digest: int | None = None  # its block hash (scheduler/block_hash.py), when events are recorded


class _PrefixWalk:
    """A request's last walk of the reuse tree from its root: the matched nodes, where the walk
    stopped (the children dict it looked in and the digest it did not find there, both None when
    every full block matched or the task has no root) and `find_new_context_block`'s key.

    Publishing only adds nodes, so it can extend a walk but never shorten it: the walk stays true
    while no node has been removed and no root created (the manager's walk epoch) and its missing
    digest is still missing. Checking that costs one dict lookup, where a version bumped by every
    publication (every step of a busy engine) would force every waiting prompt to walk again."""

    __slots__ = ("owner", "epoch", "matched", "children", "digest", "key")

    def __init__(
        self,
        owner: BlockManager,
        epoch: int,
        matched: list[_ReuseNode],
        children: dict[int, _ReuseNode] | None,
        digest: int | None,
        key: tuple | None,
    ) -> None:
        self.owner = owner
        self.epoch = epoch
        self.matched: list[_ReuseNode] = matched
        self.children: dict[int, _ReuseNode] | None = children
        self.digest: int | None = digest
        self.key: tuple | None = key


class KvSequence:
    """The blocks of one request. Full context blocks are shared by every beam; the rest is per beam."""

    __slots__ = ("request_id", "beam_blocks", "num_tokens", "lora_task_id", "total_blocks_per_beam", "released")

    def __init__(
        self,
        request_id: Hashable,
        beam_blocks: list[list[int]],
        num_tokens: int,
        lora_task_id,
        total_blocks_per_beam: int = 0,
    ) -> None:
        self.request_id = request_id
        self.beam_blocks = beam_blocks
        self.num_tokens = num_tokens
        self.lora_task_id = lora_task_id
        # ceil((P + N) / tpb) when the simple form of "remaining blocks to completion" holds for
        # this sequence (no sink, no temporary window, P + N within the window): then it is
        # (total_blocks_per_beam - allocated) * beam width, computed inline on the hot path.
        # 0 means "use the general formula".
        self.total_blocks_per_beam = total_blocks_per_beam
        self.released = False  # set by remove_sequence: a request's cached reference is then stale

    def distinct_blocks(self) -> list[int]:
        if len(self.beam_blocks) == 1:
            return self.beam_blocks[0]
        seen: dict[int, None] = {}
        for blocks in self.beam_blocks:
            for block in blocks:
                seen[block] = None
        return list(seen)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _new_block_key(request: LlmRequest, digests: tuple[int, ...], matched: list[_ReuseNode]) -> tuple | None:
    """`find_new_context_block`'s key from the request's digests and its matched path."""
    if len(matched) == len(digests):
        return None
    parent = matched[-1] if matched else None
    # The first missing block's chain hash names the whole prefix through it; the parent's
    # identity is in it to keep apart equal chains that diverged on an evicted block.
    return (request.lora_task_id, id(parent) if parent is not None else None, digests[len(matched)])


class BlockManager:
    def __init__(self, config: BlockManagerConfig) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.num_blocks = config.num_blocks
        self.enable_block_reuse = config.enable_block_reuse
        self._ref = [0] * config.num_blocks
        # Never-published (or no longer published) free blocks; popped from the end.
        self._free: list[int] = list(range(config.num_blocks - 1, -1, -1))
        # Published blocks whose count dropped to 0, least recently released first.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._node_of_block: dict[int, _ReuseNode] = {}
        self._roots: dict[int | None, _ReuseNode] = {}
        self._sequences: dict[Hashable, KvSequence] = {}
        self.num_reused_blocks = 0  # full blocks taken from the reuse tree, over the manager's life
        self.num_allocated_total = 0
        self._sched_free = 0
        self._sched_ref: dict[int, int] = {}
        self._events: list[PrefixEvent] = []
        self._walk_epoch = 0  # bumped when a node is unpublished or a root created (see _PrefixWalk)
        self._max_token_num = config.max_token_num
        self._max_attention_window = config.max_attention_window
        self._sink_token_len = config.sink_token_len

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Free blocks, counting cached-but-free ones (they are evicted on demand)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def sequences(self) -> dict[Hashable, KvSequence]:
        """Live sequences by request id (read-only use: the schedulers' hot loops look them up)."""
        return self._sequences

    def has_sequence(self, request_id: Hashable) -> bool:
        return request_id in self._sequences

    def sequence(self, request_id: Hashable) -> KvSequence:
        try:
            return self._sequences[request_id]
        except KeyError:
            raise BlockAccountingError(f"no KV sequence for request {request_id!r}") from None

    def block_ids(self, request_id: Hashable, beam: int = 0) -> list[int]:
        return self.sequence(request_id).beam_blocks[beam]

    def num_sequence_tokens(self, request_id: Hashable) -> int:
        return self.sequence(request_id).num_tokens

    @property
    def sequence_ids(self) -> list[Hashable]:
        return list(self._sequences)

    def drain_events(self) -> list[PrefixEvent]:
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> list[int]:
        """Hashes of every published block (for a full resync of the router's index)."""
        return [node.digest for node in self._node_of_block.values() if node.digest is not None]

    # --- block pool ---------------------------------------------------------------------------
    def _allocate_fresh(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._cached_free:
            block, _ = self._cached_free.popitem(last=False)
            self._unpublish(self._node_of_block[block], taken=block)
        else:
            raise OutOfBlocksError(f"no free KV block left (pool of {self.num_blocks})")
        self._ref[block] = 1
        self.num_allocated_total += 1
        return block

    def _unpublish(self, node: _ReuseNode, taken: int) -> None:
        """Remove `node` and its subtree from the reuse tree (their content is about to go).

        Free blocks of the subtree become plain free blocks, except `taken`, which the caller is
        about to reuse; held blocks stay with their holders, unpublished.
        """
        self._walk_epoch += 1
        parent = node.parent
        if parent is not None and node.key is not None:
            parent.children.pop(node.child_key, None)
        stack = [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            current.children = {}
            if self._node_of_block.get(current.block_id) is current:
                del self._node_of_block[current.block_id]
                if current.block_id in self._cached_free:
                    del self._cached_free[current.block_id]
                    self._free.append(current.block_id)
                elif self._ref[current.block_id] == 0 and current.block_id != taken:
                    self._free.append(current.block_id)
                if self.config.record_events and current.digest is not None:
                    self._events.append(PrefixEvent(PrefixEventKind.REMOVED, current.digest))

    def _acquire_cached(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._cached_free[block]
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        count = self._ref[block] - 1
        if count < 0:
            raise BlockAccountingError(f"block {block} released more often than acquired")
        self._ref[block] = count
        if count == 0:
            if block in self._node_of_block:
                self._cached_free[block] = None
            else:
                self._free.append(block)

    # --- prefix tree walks --------------------------------------------------------------------
    def _keys(self, request: LlmRequest) -> tuple[tuple[int, ...], ...]:
        keys = request.block_keys
        if keys is None:
            tpb = self.tokens_per_block
            prompt_len = request.prompt_len
            keys, request.block_digests = prompt_blocks(tuple(request.tokens[0][: prompt_len - prompt_len % tpb]), tpb)
            request.block_keys = keys
        return keys

    def _digests(self, request: LlmRequest) -> tuple[int, ...]:
        digests = request.block_digests
        if digests is None:
            request.block_keys = None  # (they are taken together)
            self._keys(request)
            digests = request.block_digests
        return digests

    def _matched(self, request: LlmRequest) -> list[_ReuseNode]:
        """The published nodes matching the request's full prompt blocks from the root, up to the
        first miss."""
        return self._walk(request).matched

    def _walk(self, request: LlmRequest) -> _PrefixWalk:
        """The request's walk of the tree, cached on the request while it stays true."""
        walk = request.prefix_walk
        if (
            walk is not None
            and walk.owner is self
            and walk.epoch == self._walk_epoch
            and (walk.children is None or walk.digest not in walk.children)
        ):
            return walk
        matched: list[_ReuseNode] = []
        digests = self._digests(request)
        children = None
        digest = None
        root = self._roots.get(request.lora_task_id)
        if root is not None:
            keys = request.block_keys  # (computed along with the digests)
            children = root.children
            for index, digest in enumerate(digests):
                node = children.get(digest)
                if node is None or node.key != keys[index]:
                    break
                matched.append(node)
                children = node.children
            else:
                children = digest = None  # every full block matched
        walk = _PrefixWalk(self, self._walk_epoch, matched, children, digest, _new_block_key(request, digests, matched))
        request.prefix_walk = walk
        return walk

    def count_reusable_blocks(self, request: LlmRequest, only_allocated: bool) -> int:
        """Consecutive full blocks of the request's tokens already in the tree.

        With `only_allocated`, count only matched blocks that some sequence holds: free cached blocks
        are already in the free count, so crediting them again would count them twice.
        """
        if not self.enable_block_reuse:
            return 0
        if request.lora_task_id not in self._roots:
            return 0
        # Only blocks that add_sequence will really share: the full blocks of the first P-1 tokens.
        # (TensorRT-LLM counts the full blocks of all P tokens here, which over-credits one block
        # when P is a multiple of tokens_per_block, so admission could over-commit the pool.)
        matched = self._matched(request)
        if not only_allocated:
            return len(matched[: (request.prompt_len - 1) // self.tokens_per_block])
        return self._allocated_credit(request, matched)

    def _allocated_credit(self, request: LlmRequest, matched: list[_ReuseNode]) -> int:
        """Of the matched blocks add_sequence would share (those of the first P-1 tokens), how many
        some sequence holds."""
        ref = self._ref
        return sum(1 for node in matched[: (request.prompt_len - 1) // self.tokens_per_block] if ref[node.block_id] > 0)

    def _first_step_blocks(self, request: LlmRequest) -> tuple[int, int]:
        """(full blocks, blocks needed before reuse credit) of a request's first context step."""
        # min(P + drafts, W + max new tokens) + sink, without the calls (every waiting prompt, every step).
        prompt_cache_len = request.prompt_len + len(request.draft_tokens)
        longest = self._max_attention_window + request.max_new_tokens
        if prompt_cache_len > longest:
            prompt_cache_len = longest
        prompt_cache_len += self._sink_token_len
        tpb = self.tokens_per_block
        full_blocks = prompt_cache_len // tpb
        return full_blocks, full_blocks + (request.beam_width if prompt_cache_len % tpb else 0)

    def find_new_context_block(self, request: LlmRequest) -> tuple | None:
        """A key naming the request's prefix through its first full block missing from the tree.

        Two requests get equal keys iff they share that prefix (same LoRA task, same matched path,
        same tokens in the first missing block). None if every full block is cached or there is none.
        """
        if not self.enable_block_reuse:
            return None
        return self._walk(request).key

    def first_chunk_admission(self, request: LlmRequest) -> tuple[tuple | None, int, int]:
        """For a plain context request at its first chunk, with reuse on and no cross pool (the hot
        path of MAX_UTILIZATION's admission): (`find_new_context_block`'s key,
        `needed_blocks_one_step`'s need, the reusable blocks it credited) from one walk of the
        tree. Unlike `needed_blocks_one_step` it leaves `estimated_reusable_tokens` to the caller
        (reusable * tokens_per_block), which sets it only when the request is not skipped."""
        walk = self._walk(request)
        full_blocks, need = self._first_step_blocks(request)
        reusable = 0
        if walk.matched:  # a match implies the task's root exists
            reusable = min(self._allocated_credit(request, walk.matched), full_blocks)
            need -= reusable
        return walk.key, need, reusable

    # --- sequence operations ------------------------------------------------------------------
    def add_sequence(self, request: LlmRequest, num_tokens: int | None = None, *, reuse: bool = True) -> int:
        """Allocate blocks for the request's prompt (or `num_tokens`, e.g. an encoder output).

        With reuse, the full blocks of the first P-1 prompt tokens are matched against the tree and
        shared; the request's context window is moved past them (set_prepopulated_prompt_len).
        Returns the number of reused prompt tokens. `reuse=False` allocates every block fresh (a
        generation-only request whose whole KV is about to be received). If the pool runs out,
        nothing stays allocated.
        """
        request_id = request.request_id
        if request_id in self._sequences:
            raise BlockAccountingError(f"request {request_id!r} already has a KV sequence")
        tpb = self.tokens_per_block
        length = request.prompt_len if num_tokens is None else num_tokens
        beam_width = request.beam_width
        matched: list[_ReuseNode] = []
        if self.enable_block_reuse and reuse and num_tokens is None:
            matched = self._matched(request)[: (length - 1) // tpb]
        num_full = length // tpb
        has_partial = length % tpb > 0
        needed_fresh = (num_full - len(matched)) + (beam_width if has_partial else 0)
        if needed_fresh > self.num_free_blocks - sum(
            1 for node in matched if self._ref[node.block_id] == 0
        ):
            raise OutOfBlocksError(
                f"request {request_id!r} needs {needed_fresh} fresh blocks, {self.num_free_blocks} free"
            )
        shared: list[int] = []
        for node in matched:
            self._acquire_cached(node.block_id)
            shared.append(node.block_id)
        for _ in range(num_full - len(matched)):
            shared.append(self._allocate_fresh())
        beam_blocks = [list(shared) for _ in range(beam_width)]
        if has_partial:
            for blocks in beam_blocks:
                blocks.append(self._allocate_fresh())
        cfg = self.config
        total_len = request.prompt_len + request.max_new_tokens
        simple = (
            not cfg.is_cross_attention
            and cfg.sink_token_len == 0
            and cfg.temporary_attention_window == 0
            and total_len <= cfg.max_attention_window
        )
        sequence = KvSequence(request_id, beam_blocks, length, request.lora_task_id, _ceil_div(total_len, tpb) if simple else 0)
        self._sequences[request_id] = sequence
        if not cfg.is_cross_attention:
            request.kv_sequence = sequence
        self.num_reused_blocks += len(matched)
        reused_tokens = len(matched) * tpb
        if reused_tokens:
            request.set_prepopulated_prompt_len(reused_tokens, tpb)
        return reused_tokens

    def add_token(self, request_id: Hashable) -> None:
        """Grow the sequence by one token (every beam), allocating a block at block boundaries."""
        sequence = self.sequence(request_id)
        if sequence.num_tokens % self.tokens_per_block == 0:
            for blocks in sequence.beam_blocks:
                blocks.append(self._allocate_fresh())
        sequence.num_tokens += 1

    def add_token_to_each(self, requests: Iterable[LlmRequest]) -> None:
        """`add_token` for each request's sequence, in order (a decode step's batch, in one call)."""
        sequences, tpb = self._sequences, self.tokens_per_block
        for request in requests:
            sequence = sequences.get(request.request_id)
            if sequence is None:
                raise BlockAccountingError(f"no KV sequence for request {request.request_id!r}")
            if sequence.num_tokens % tpb == 0:
                for blocks in sequence.beam_blocks:
                    blocks.append(self._allocate_fresh())
            sequence.num_tokens += 1

    def store_context_blocks(self, request: LlmRequest) -> int:
        """Publish the first floor((P-1)/tpb) full prompt blocks; returns how many became new nodes."""
        if not self.enable_block_reuse:
            return 0
        sequence = self.sequence(request.request_id)
        keys = self._keys(request)
        digests = self._digests(request)
        count = min((request.prompt_len - 1) // self.tokens_per_block, len(keys))
        blocks = sequence.beam_blocks[0]
        lora = request.lora_task_id
        root = self._roots.get(lora)
        if root is None:
            root = _ReuseNode(None, 0, -1, None)
            self._roots[lora] = root
            self._walk_epoch += 1  # a walk of this task that found no root is stale now
        parent = root
        created = 0
        node_of_block = self._node_of_block
        record_events = self.config.record_events
        events = self._events
        chain = stored_events = None  # the prompt's block hashes and events, taken when a first block is published
        for index in range(count):
            key = keys[index]
            digest = digests[index]
            node = parent.children.get(digest)
            if node is not None and node.key != key:
                break  # a chain-hash collision: leave this prefix unpublished
            if node is None:
                block = blocks[index]
                if block in node_of_block:
                    # This block already stands for other content (cannot happen for prompt blocks
                    # of one request, but never let one block carry two meanings).
                    break
                node = _ReuseNode(key, digest, block, parent)
                parent.children[digest] = node
                node_of_block[block] = node
                created += 1
                if record_events:
                    if chain is None:
                        # The chain of the request's own prompt: a node's parents are its blocks.
                        chain = prompt_chain(tuple(request.tokens[0][: request.prompt_len]), self.tokens_per_block, lora)
                        stored_events = prompt_stored_events(chain)
                    node.digest = chain[index]
                    events.append(stored_events[index])
            parent = node
        return created

    def remove_sequence(self, request_id: Hashable, request: LlmRequest | None = None) -> None:
        """Release the sequence's blocks. The sequence is marked released, so a request's cached
        reference to it (`LlmRequest.kv_sequence`) is never trusted afterwards; pass the request to
        clear that reference too."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            raise BlockAccountingError(f"no KV sequence for request {request_id!r}")
        sequence.released = True
        if request is not None and request.kv_sequence is sequence:
            request.kv_sequence = None
        # Release the tail first so that leaves of the reuse tree are evicted before their parents.
        for block in reversed(sequence.distinct_blocks()):
            self._release(block)

    # --- block estimates (TensorRT-LLM kvCacheManager.cpp: getRemainingBlocksToCompletion,
    # getNeededBlocksOneStep) ----------------------------------------------------------------
    def remaining_blocks_to_completion(self, request: LlmRequest) -> int:
        """Blocks the request still needs to run to completion (GUARANTEED_NO_EVICT, STATIC_BATCH)."""
        request.estimated_reusable_tokens = 0
        cfg = self.config
        tpb = self.tokens_per_block
        if cfg.is_cross_attention:
            if request.is_context_init_state() and request.context_current_position == 0:
                return _ceil_div(request.encoder_input_len or 0, tpb)
            return 0
        prompt_len = request.prompt_len
        window = cfg.max_attention_window + cfg.temporary_attention_window
        sink = cfg.sink_token_len
        ctx_blocks = (min(prompt_len, window) + sink) // tpb
        total_len = prompt_len + request.max_new_tokens
        total_per_beam = _ceil_div(min(total_len, window) + sink, tpb)
        gen_per_beam = total_per_beam - ctx_blocks
        sequence = self._sequences.get(request.request_id)
        allocated = len(sequence.beam_blocks[0]) if sequence is not None else 0
        reusable_ctx = 0
        if (
            self.enable_block_reuse
            and allocated == 0
            and request.is_context_init_state()
            and request.is_first_context_chunk()
        ):
            reusable_ctx = min(self.count_reusable_blocks(request, only_allocated=True), ctx_blocks)
            request.estimated_reusable_tokens = (
                min(self.count_reusable_blocks(request, only_allocated=False), ctx_blocks) * tpb
            )
        extra = 0
        if total_len > cfg.max_attention_window:
            blocks_total = _ceil_div(total_len, tpb)
            if blocks_total > _ceil_div(request.num_tokens(0), tpb) and blocks_total > total_per_beam:
                extra = 1
        beam_width = request.beam_width
        effective_ctx = ctx_blocks - reusable_ctx
        if allocated < effective_ctx:
            return effective_ctx - allocated + (gen_per_beam + extra) * beam_width
        return (total_per_beam - reusable_ctx - allocated + extra) * beam_width

    def blocks_at_completion(self, request: LlmRequest) -> int:
        """Blocks the request holds at its longest (prompt + max_new_tokens, every beam) alone in an
        empty pool with nothing cached: `remaining_blocks_to_completion` of it before it starts, with
        no reuse credit. More than `num_blocks` means it can never run to completion in this pool,
        under any capacity policy: GUARANTEED_NO_EVICT never admits it, MAX_UTILIZATION runs out
        of blocks and pauses it again and again."""
        cfg = self.config
        tpb = self.tokens_per_block
        if cfg.is_cross_attention:
            return _ceil_div(request.encoder_input_len or 0, tpb)
        window = cfg.max_attention_window + cfg.temporary_attention_window
        sink = cfg.sink_token_len
        ctx_blocks = (min(request.prompt_len, window) + sink) // tpb
        total_len = request.prompt_len + request.max_new_tokens
        total_per_beam = _ceil_div(min(total_len, window) + sink, tpb)
        extra = 0
        if total_len > cfg.max_attention_window:
            blocks_total = _ceil_div(total_len, tpb)
            if blocks_total > _ceil_div(request.num_tokens(0), tpb) and blocks_total > total_per_beam:
                extra = 1
        return ctx_blocks + (total_per_beam - ctx_blocks + extra) * request.beam_width

    def needed_blocks_one_step(self, request: LlmRequest) -> int:
        """Blocks the request needs for its next step only (MAX_UTILIZATION)."""
        request.estimated_reusable_tokens = 0
        cfg = self.config
        tpb = self.tokens_per_block
        state = request.state
        if state in _GENERATION_STATES:
            if cfg.is_cross_attention:
                return 0
            sequence = self._sequences.get(request.request_id)
            current = sequence.num_tokens if sequence is not None else request.num_tokens(0) - 1
            generated = current - request.prompt_len
            step = (2 if cfg.two_steps_lookahead else 1) * (len(request.draft_tokens) + 1)
            add = min(step, request.max_new_tokens - generated)
            following = current + add
            if following > self._max_token_num:
                return 0
            return (_ceil_div(following, tpb) - _ceil_div(current, tpb)) * request.beam_width
        is_disagg = state is _GEN_INIT
        if is_disagg or (
            (state is _CONTEXT_INIT or state is _CONTEXT_INIT_AND_TRANS) and request.is_first_context_chunk()
        ):
            if cfg.is_cross_attention:
                return _ceil_div(request.encoder_input_len or 0, tpb) if not is_disagg else 0
            full_blocks, need = self._first_step_blocks(request)
            if self.enable_block_reuse and not is_disagg and request.lora_task_id in self._roots:
                reusable = min(self.count_reusable_blocks(request, only_allocated=True), full_blocks)
                need -= reusable
                request.estimated_reusable_tokens = reusable * tpb
            return need
        return 0

    # --- the scheduling snapshot (MAX_UTILIZATION) --------------------------------------------
    def start_scheduling(self) -> None:
        self._sched_free = self.num_free_blocks
        self._sched_ref = {}

    def scheduling_has_free_blocks(self, num_blocks: int) -> bool:
        return self._sched_free >= num_blocks

    @property
    def scheduling_free_blocks(self) -> int:
        return self._sched_free

    def scheduling_remove_sequence(self, request_id: Hashable) -> None:
        """Simulate freeing the sequence: a block counts as free only when its last holder goes."""
        sequence = self._sequences.get(request_id)
        if sequence is None:
            return
        sched_ref = self._sched_ref
        ref = self._ref
        for block in sequence.distinct_blocks():
            count = sched_ref.get(block, ref[block]) - 1
            sched_ref[block] = count
            if count == 0:
                self._sched_free += 1

    # --- end of life ----------------------------------------------------------------------------
    def close(self) -> None:
        """Unlink the reuse tree: its nodes reference their parents and children, so a manager thrown
        away while the process goes on (a simulated instance's restart) would otherwise wait for the
        cyclic garbage collector, which a simulation keeps off (cluster/sim/vclock.py). The manager
        holds no cache afterwards; it is not to be used again."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.children = {}
            node.parent = None
        self._roots.clear()
        self._node_of_block.clear()
        self._cached_free.clear()

    # --- integrity ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise BlockAccountingError if counts, free lists and the tree disagree."""
        expected = [0] * self.num_blocks
        for sequence in self._sequences.values():
            for block in sequence.distinct_blocks():
                if not 0 <= block < self.num_blocks:
                    raise BlockAccountingError(f"sequence {sequence.request_id!r} holds invalid block {block}")
                expected[block] += 1
            for blocks in sequence.beam_blocks:
                if len(blocks) != _ceil_div(sequence.num_tokens, self.tokens_per_block):
                    raise BlockAccountingError(
                        f"sequence {sequence.request_id!r}: {len(blocks)} blocks for {sequence.num_tokens} tokens"
                    )
        if expected != self._ref:
            bad = [b for b in range(self.num_blocks) if expected[b] != self._ref[b]][:5]
            raise BlockAccountingError(f"reference counts disagree with sequences at blocks {bad}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockAccountingError("a block appears twice in the free list")
        cached = set(self._cached_free)
        if free & cached:
            raise BlockAccountingError("a block is both plainly free and cached-free")
        for block in free:
            if self._ref[block] != 0 or block in self._node_of_block:
                raise BlockAccountingError(f"free block {block} is referenced or published")
        for block in cached:
            if self._ref[block] != 0 or block not in self._node_of_block:
                raise BlockAccountingError(f"cached-free block {block} is referenced or unpublished")
        used = sum(1 for count in self._ref if count > 0)
        if used + len(free) + len(cached) != self.num_blocks:
            raise BlockAccountingError(
                f"{used} used + {len(free)} free + {len(cached)} cached != {self.num_blocks} blocks"
            )
        for block, node in self._node_of_block.items():
            if node.block_id != block:
                raise BlockAccountingError(f"tree node for block {block} names block {node.block_id}")
            if node.parent is None or node.parent.children.get(node.child_key) is not node:
                raise BlockAccountingError(f"tree node for block {block} is detached from its parent")

    def iter_sequences(self) -> Iterable[KvSequence]:
        return self._sequences.values()
