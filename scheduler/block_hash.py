"""Stable identifiers of full KV blocks and the prefix-cache events that carry them, shared by the
block manager and the router; and what a process may keep of the prompts it cut into blocks.

A block's hash covers the LoRA task and the whole token prefix through the end of that block
(a chain: each hash folds in its parent's), so equal hashes mean equal KV content for a given
model. blake2b is used, not Python's hash(), so that every process computes the same values. A
block manager publishes a block as a STORED PrefixEvent with its hash and evicts it as REMOVED; the
router's prefix index (cluster/router/prefix_index.py) applies them.

A prompt's chain, its full blocks as the reuse tree's keys with their in-process hashes
(`prompt_blocks`), and its STORED events are pure functions of its tokens, so a process that cuts
each prompt more than once can keep the last ones (`memoise_prompts`): the simulator runs the router
and both instances of a request in one process, and each of them cuts and hashes the same prompt
(a blake2b per block, three times per request). An engine or a router sees each prompt once: they
keep none (the default).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

BLOCK_HASH_BYTES = 8

_ROOT = b"duet-block-v1"


def _lora_bytes(lora_task_id: int | None) -> bytes:
    return b"none" if lora_task_id is None else struct.pack("<q", lora_task_id)


def block_packer(tokens_per_block: int) -> Callable[..., bytes]:
    """Packs one full block's tokens (as arguments) the way its hash reads them: little-endian int64s."""
    return struct.Struct(f"<{tokens_per_block}q").pack


def block_hash_chain(
    token_ids: Sequence[int], tokens_per_block: int, lora_task_id: int | None = None
) -> list[int]:
    """Hashes of every full block of `token_ids` (a trailing partial block gets none)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    return list(prompt_chain(token_ids if type(token_ids) is tuple else tuple(token_ids), tokens_per_block, lora_task_id))


def prompt_chain(token_ids: tuple[int, ...], tokens_per_block: int, lora_task_id: int | None) -> tuple[int, ...]:
    """`block_hash_chain` of a tuple of tokens, from the memo when one is kept (read-only: it may be shared)."""
    return _prompt_chain(token_ids, tokens_per_block, lora_task_id)



def _chain(token_ids: tuple[int, ...], tokens_per_block: int, lora_task_id: int | None) -> tuple[int, ...]:
    hashes: list[int] = []
    parent = hashlib.blake2b(_ROOT + _lora_bytes(lora_task_id), digest_size=BLOCK_HASH_BYTES).digest()
    num_full = len(token_ids) // tokens_per_block
    pack = block_packer(tokens_per_block)
    for index in range(num_full):
        block = token_ids[index * tokens_per_block : (index + 1) * tokens_per_block]
        digest = hashlib.blake2b(parent + pack(*block), digest_size=BLOCK_HASH_BYTES).digest()
        hashes.append(int.from_bytes(digest, "little"))
        parent = digest
    return tuple(hashes)


_prompt_chain: Callable[[tuple[int, ...], int, int | None], tuple[int, ...]] = _chain


class PrefixEventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"


# Slots: one is built for every published and every evicted block, and a slotted one builds in
# 60 % of the time.
@dataclass(frozen=True, slots=True)
class PrefixEvent:
    kind: PrefixEventKind
    block_hash: int


def prompt_stored_events(chain: tuple[int, ...]) -> tuple[PrefixEvent, ...]:
    """The STORED events of a prompt's blocks (by its chain), from the memo when one is kept (frozen:
    every manager that publishes the prompt shares them)."""
    return _stored_events(chain)


def prompt_blocks(full_blocks: tuple[int, ...], tokens_per_block: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """A prompt's full blocks as tuples (the reuse tree's keys) and their in-process chain hashes (its
    dict keys), from the memo when one is kept (the managers that cut the same prompt then share
    them, and their trees the same key tuples)."""
    return _prompt_blocks(full_blocks, tokens_per_block)


def memoise_prompts(max_prompts: int) -> None:
    """Keep, for the last `max_prompts` prompts seen in this process, their block hash chain, reuse-tree
    keys and STORED events (0: keep none, the default; the module docstring says who keeps some). A
    new memo each call."""
    global _prompt_chain, _stored_events, _prompt_blocks
    if max_prompts > 0:
        _prompt_chain = functools.lru_cache(maxsize=max_prompts)(_chain)
        _stored_events = functools.lru_cache(maxsize=max_prompts)(_stored_events_of)
        _prompt_blocks = functools.lru_cache(maxsize=max_prompts)(_blocks_of)
    else:
        _prompt_chain, _stored_events, _prompt_blocks = _chain, _stored_events_of, _blocks_of


def _stored_events_of(chain: tuple[int, ...]) -> tuple[PrefixEvent, ...]:
    return tuple([PrefixEvent(PrefixEventKind.STORED, block_hash) for block_hash in chain])


def _blocks_of(full_blocks: tuple[int, ...], tokens_per_block: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    # zip over one iterator `tpb` times takes the tokens tpb at a time (no slice and tuple per block).
    tokens = iter(full_blocks)
    keys = tuple(zip(*([tokens] * tokens_per_block), strict=True))
    digests = []
    chain = 0
    for key in keys:
        chain = hash((chain, key))  # deterministic for ints; only ever used in-process
        digests.append(chain)
    return keys, tuple(digests)


_stored_events: Callable[[tuple[int, ...]], tuple[PrefixEvent, ...]] = _stored_events_of
_prompt_blocks: Callable[[tuple[int, ...], int], tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]] = _blocks_of
