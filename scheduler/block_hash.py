"""Stable identifiers of full KV blocks, shared by the block manager's events and the router.

A block's hash covers the LoRA task and the whole token prefix through the end of that block
(a chain: each hash folds in its parent's), so equal hashes mean equal KV content for a given
model. blake2b is used, not Python's hash(), so that every process computes the same values.

The chain of a prompt is a pure function of its tokens, so a process that hashes each prompt more
than once can keep the last ones (`memoise_prompt_chains`): the simulator runs the router and both
instances of a request in one process, and each of them hashes the same prompt (a blake2b per block,
three times per request). An engine or a router hashes each prompt once: they keep none (the default).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence

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


def memoise_prompt_chains(max_prompts: int) -> None:
    """Keep the chains of the last `max_prompts` prompts hashed in this process (0: keep none). A new
    memo each call."""
    global _prompt_chain
    _prompt_chain = functools.lru_cache(maxsize=max_prompts)(_chain) if max_prompts > 0 else _chain


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
