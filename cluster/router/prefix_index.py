"""Which instance caches which KV blocks, fed by the prefix events in the instances' load snapshots.

Block hashes are chain hashes (scheduler/block_hash.py): the hash of block i folds in every token
before it and the LoRA task, so a flat map hash -> holders is enough to describe a radix tree of
prefixes; no parent pointers are needed. A request's overlap with an instance is the number of
leading blocks of its hash chain that the instance holds, without a hole (block i counts only when
blocks 0..i-1 count), because an engine can only reuse a prefix.

Keeping the index exact (the rules `apply` follows):

* Snapshots of one instance are applied in sequence order. The first snapshot seen from an
  instance is the baseline, whatever its sequence number.
* A snapshot whose sequence number is not above the last one applied is stale (duplicated or
  reordered) and changes nothing.
* A gap (sequence > last + 1) means events were lost, so what the index knows about that instance
  may be wrong in either direction: its entries are cleared before the new snapshot's events are
  applied. The index then under-estimates that instance's cache (never over-estimates it) until
  the blocks are stored again or the instance sends a `reset` snapshot listing its cache.
* `reset` (a restarted instance, or one that dropped its cache) clears the instance's entries and
  makes this snapshot the new baseline, even if its sequence number went down.
* An instance can never cache more blocks than its pool holds; if the index would say so, removal
  events were lost, and the instance's entries are cleared (and a warning logged).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum

from cluster.router.snapshot import InstanceSnapshot
from scheduler.block_hash import PrefixEventKind

logger = logging.getLogger(__name__)


class ApplyOutcome(Enum):
    APPLIED = "applied"
    RESET = "reset"
    GAP_CLEARED = "gap_cleared"
    STALE_IGNORED = "stale_ignored"
    OVERFLOW_CLEARED = "overflow_cleared"


class PrefixIndex:
    """Block hash -> instances holding it, and the reverse, kept in step."""

    def __init__(self) -> None:
        # Holders as a bit mask over instance slots, not a set of ids: an int per block is no
        # container for the cyclic garbage collector to walk (a router holds 100,000s of blocks).
        self._holders: dict[int, int] = {}
        self._blocks: dict[str, set[int]] = {}
        self._last_sequence: dict[str, int] = {}
        self._slots: dict[str, int] = {}  # instance id -> its bit
        self._ids: list[str | None] = []  # bit -> instance id (None: free)

    def _bit(self, instance_id: str) -> int:
        slot = self._slots.get(instance_id)
        if slot is None:
            slot = self._ids.index(None) if None in self._ids else len(self._ids)
            if slot == len(self._ids):
                self._ids.append(instance_id)
            else:
                self._ids[slot] = instance_id
            self._slots[instance_id] = slot
        return 1 << slot

    def _holder_ids(self, mask: int):
        while mask:
            low = mask & -mask
            yield self._ids[low.bit_length() - 1]
            mask ^= low

    def apply(self, snapshot: InstanceSnapshot) -> ApplyOutcome:
        """Fold one snapshot's prefix events into the index (see the module docstring for the rules)."""
        instance_id = snapshot.instance_id
        load = snapshot.load
        last = self._last_sequence.get(instance_id)
        if snapshot.reset:
            outcome = ApplyOutcome.RESET
            self._clear(instance_id)
        elif last is None:
            outcome = ApplyOutcome.APPLIED
        elif snapshot.sequence <= last:
            logger.debug(
                "instance %s: stale snapshot %d (last applied %d) ignored", instance_id, snapshot.sequence, last
            )
            return ApplyOutcome.STALE_IGNORED
        elif snapshot.sequence > last + 1:
            logger.info(
                "instance %s: snapshots %d..%d lost; clearing its prefix entries",
                instance_id,
                last + 1,
                snapshot.sequence - 1,
            )
            outcome = ApplyOutcome.GAP_CLEARED
            self._clear(instance_id)
        else:
            outcome = ApplyOutcome.APPLIED
        self._last_sequence[instance_id] = snapshot.sequence
        blocks = self._blocks.setdefault(instance_id, set())
        bit = self._bit(instance_id)
        holders = self._holders
        for event in load.prefix_events:
            block_hash = event.block_hash
            if event.kind is PrefixEventKind.STORED:
                blocks.add(block_hash)
                holders[block_hash] = holders.get(block_hash, 0) | bit
            else:
                # Removing an unknown block is normal after a gap or a reset.
                blocks.discard(block_hash)
                mask = holders.get(block_hash)
                if mask is not None:
                    mask &= ~bit
                    if mask:
                        holders[block_hash] = mask
                    else:
                        del holders[block_hash]
        if len(blocks) > load.total_blocks:
            logger.warning(
                "instance %s: index holds %d blocks but its pool has %d; removal events were lost, clearing",
                instance_id,
                len(blocks),
                load.total_blocks,
            )
            self._clear(instance_id)
            return ApplyOutcome.OVERFLOW_CLEARED
        return outcome

    def overlap(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `block_hashes` held by each instance; instances with no overlap are absent.

        Cost: O(matched blocks x instances still matching), independent of the index size.
        """
        result: dict[str, int] = {}
        if not block_hashes:
            return result
        holders = self._holders
        active = holders.get(block_hashes[0], 0)
        depth = 0
        for block_hash in block_hashes:
            dropped = active & ~holders.get(block_hash, 0)
            if dropped:
                for instance_id in self._holder_ids(dropped):
                    result[instance_id] = depth
                active ^= dropped
            if not active:
                break
            depth += 1
        for instance_id in self._holder_ids(active):
            result[instance_id] = depth
        return {instance_id: depth for instance_id, depth in result.items() if depth > 0}

    def remove_instance(self, instance_id: str) -> None:
        """Forget an instance entirely (it left the cluster or was declared dead)."""
        self._clear(instance_id)
        self._blocks.pop(instance_id, None)
        self._last_sequence.pop(instance_id, None)
        slot = self._slots.pop(instance_id, None)
        if slot is not None:
            self._ids[slot] = None

    def instance_ids(self) -> frozenset[str]:
        return frozenset(self._last_sequence)

    def num_blocks(self, instance_id: str) -> int:
        return len(self._blocks.get(instance_id, ()))

    def holds(self, instance_id: str, block_hash: int) -> bool:
        slot = self._slots.get(instance_id)
        return slot is not None and bool(self._holders.get(block_hash, 0) >> slot & 1)

    def last_sequence(self, instance_id: str) -> int | None:
        return self._last_sequence.get(instance_id)

    def _clear(self, instance_id: str) -> None:
        blocks = self._blocks.get(instance_id)
        if not blocks:
            return
        keep = ~self._bit(instance_id)
        holders = self._holders
        for block_hash in blocks:
            mask = holders[block_hash] & keep
            if mask:
                holders[block_hash] = mask
            else:
                del holders[block_hash]
        blocks.clear()
