"""The prefix index: chain overlap, removals, resets, sequence gaps, stale snapshots."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.router.prefix_index import ApplyOutcome, PrefixIndex
from cluster.router.snapshot import InstanceSnapshot
from scheduler.block_hash import PrefixEvent, PrefixEventKind, block_hash_chain
from worker.protocol import EngineLoad, InstanceRole

STORED = PrefixEventKind.STORED
REMOVED = PrefixEventKind.REMOVED


def snap(
    instance_id: str,
    sequence: int,
    *events: tuple[PrefixEventKind, tuple[int, ...]],
    reset: bool = False,
    total_blocks: int = 1000,
) -> InstanceSnapshot:
    """A snapshot whose prefix events are runs of (kind, block hashes), one event per block."""
    load = EngineLoad(
        role=InstanceRole.MIXED,
        total_blocks=total_blocks,
        free_blocks=total_blocks,
        tokens_per_block=4,
        queued_requests=0,
        running_requests=0,
        queued_prompt_tokens=0,
        tokens_in_flight=0,
        num_paused=0,
        prefix_events=tuple(PrefixEvent(kind, block_hash) for kind, hashes in events for block_hash in hashes),
    )
    return InstanceSnapshot(instance_id, load, sequence=sequence, reset=reset)


CHAIN = (11, 12, 13, 14)


def test_overlap_counts_leading_blocks_only():
    index = PrefixIndex()
    index.apply(snap("a", 0, (STORED, (11, 12, 13))))
    index.apply(snap("b", 0, (STORED, (11, 13, 14))))  # hole at block 1
    index.apply(snap("c", 0, (STORED, (12, 13, 14))))  # no first block
    index.apply(snap("d", 0, (STORED, (11, 12, 13, 14, 99))))
    assert index.overlap(CHAIN) == {"a": 3, "b": 1, "d": 4}


def test_overlap_of_an_empty_or_unknown_chain_is_empty():
    index = PrefixIndex()
    index.apply(snap("a", 0, (STORED, (11,))))
    assert index.overlap(()) == {}
    assert index.overlap((55, 11)) == {}


def test_overlap_with_real_block_hashes_shares_the_common_prefix():
    tokens_per_block = 4
    system_prompt = list(range(100, 112))  # 3 full blocks
    first = block_hash_chain(system_prompt + [1, 2, 3, 4, 5, 6, 7, 8], tokens_per_block)
    second = block_hash_chain(system_prompt + [9, 9, 9, 9], tokens_per_block)
    other_lora = block_hash_chain(system_prompt + [1, 2, 3, 4], tokens_per_block, lora_task_id=3)
    index = PrefixIndex()
    index.apply(snap("a", 0, (STORED, tuple(first))))
    assert index.overlap(first) == {"a": 5}
    assert index.overlap(second) == {"a": 3}
    assert index.overlap(other_lora) == {}


def test_removal_cuts_the_chain():
    index = PrefixIndex()
    index.apply(snap("a", 0, (STORED, CHAIN)))
    index.apply(snap("a", 1, (REMOVED, (13,))))
    assert index.overlap(CHAIN) == {"a": 2}
    index.apply(snap("a", 2, (REMOVED, (11,))))
    assert index.overlap(CHAIN) == {}
    assert index.num_blocks("a") == 2  # 12 and 14 remain, unreachable as a prefix


def test_events_apply_in_order_within_a_snapshot():
    index = PrefixIndex()
    index.apply(snap("a", 0, (STORED, (11, 12)), (REMOVED, (12,)), (STORED, (12,)), (REMOVED, (11,))))
    assert not index.holds("a", 11)
    assert index.holds("a", 12)


def test_removing_an_unknown_block_is_harmless():
    index = PrefixIndex()
    assert index.apply(snap("a", 0, (REMOVED, (5,)))) is ApplyOutcome.APPLIED
    assert index.num_blocks("a") == 0


def test_stale_and_duplicate_snapshots_change_nothing():
    index = PrefixIndex()
    index.apply(snap("a", 5, (STORED, (11, 12))))
    assert index.apply(snap("a", 5, (REMOVED, (11,)))) is ApplyOutcome.STALE_IGNORED
    assert index.apply(snap("a", 3, (STORED, (13,)))) is ApplyOutcome.STALE_IGNORED
    assert index.overlap(CHAIN) == {"a": 2}
    assert index.last_sequence("a") == 5


def test_a_sequence_gap_clears_the_instance_then_applies_the_new_events():
    index = PrefixIndex()
    index.apply(snap("a", 0, (STORED, (11, 12, 13))))
    index.apply(snap("b", 0, (STORED, (11, 12))))
    outcome = index.apply(snap("a", 2, (STORED, (21,))))
    assert outcome is ApplyOutcome.GAP_CLEARED
    assert index.overlap(CHAIN) == {"b": 2}  # other instances untouched
    assert index.holds("a", 21)
    assert index.num_blocks("a") == 1
    assert index.apply(snap("a", 3, (STORED, (11,)))) is ApplyOutcome.APPLIED


def test_reset_forgets_everything_and_rebases_the_sequence():
    index = PrefixIndex()
    index.apply(snap("a", 40, (STORED, (11, 12, 13))))
    # The instance restarted: its sequence starts again at 0.
    assert index.apply(snap("a", 0, (STORED, (11,)), reset=True)) is ApplyOutcome.RESET
    assert index.overlap(CHAIN) == {"a": 1}
    assert index.last_sequence("a") == 0
    assert index.apply(snap("a", 1, (STORED, (12,)))) is ApplyOutcome.APPLIED
    assert index.overlap(CHAIN) == {"a": 2}


def test_first_snapshot_is_the_baseline_whatever_its_sequence():
    index = PrefixIndex()
    assert index.apply(snap("a", 17, (STORED, (11,)))) is ApplyOutcome.APPLIED
    assert index.apply(snap("a", 18)) is ApplyOutcome.APPLIED


def test_remove_instance_forgets_blocks_and_sequence():
    index = PrefixIndex()
    index.apply(snap("a", 0, (STORED, CHAIN)))
    index.apply(snap("b", 0, (STORED, CHAIN[:2])))
    index.remove_instance("a")
    assert index.overlap(CHAIN) == {"b": 2}
    assert index.instance_ids() == {"b"}
    assert index.last_sequence("a") is None
    index.remove_instance("never-seen")  # no error
    # Coming back, it is a new baseline.
    assert index.apply(snap("a", 0, (STORED, (11,)))) is ApplyOutcome.APPLIED
    assert index.overlap(CHAIN) == {"a": 1, "b": 2}


def test_more_blocks_than_the_pool_holds_clears_the_instance():
    index = PrefixIndex()
    index.apply(snap("a", 0, (STORED, (1, 2, 3)), total_blocks=4))
    outcome = index.apply(snap("a", 1, (STORED, (4, 5)), total_blocks=4))
    assert outcome is ApplyOutcome.OVERFLOW_CLEARED
    assert index.num_blocks("a") == 0
    assert index.overlap((1,)) == {}


class CountingDict(dict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def test_query_cost_follows_matched_blocks_not_index_size():
    index = PrefixIndex()
    for n in range(20):
        index.apply(snap(f"i{n}", 0, (STORED, tuple(range(n * 500, n * 500 + 500)))))
    counting = CountingDict(index._holders)
    index._holders = counting  # white-box: count hash lookups
    chain = (0, 1, 2) + tuple(range(100_000, 101_000))
    assert index.overlap(chain) == {"i0": 3}
    assert counting.lookups <= 5  # blocks 0..3 and the first miss, not 1003 nor 10000


# --- model-based check against a naive reference -------------------------------------------------

HASHES = st.integers(0, 7)


EVENTS = st.lists(
    st.tuples(st.sampled_from([STORED, REMOVED]), st.lists(HASHES, min_size=1, max_size=4).map(tuple)),
    max_size=3,
)
# (instance, sequence step: mostly +1, sometimes a gap, a duplicate or a stale one; reset?, events)
STEPS = st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([1, 1, 1, 2, 0, -1]), st.booleans(), EVENTS)


def histories(steps):
    sequences = {"a": -1, "b": -1}
    for instance, jump, reset_coin, events in steps:
        reset = reset_coin and jump == 0  # about one step in twelve
        sequence = 0 if reset else max(sequences[instance] + jump, 0)
        if jump > 0 or reset:
            sequences[instance] = sequence
        yield instance, sequence, reset, events


@settings(max_examples=100, deadline=None)
@given(st.lists(STEPS, min_size=1, max_size=20), st.lists(HASHES, max_size=6).map(tuple))
def test_index_matches_a_naive_model(steps, chain):
    index = PrefixIndex()
    model: dict[str, set[int]] = {}
    last: dict[str, int] = {}
    for instance, sequence, reset, events in histories(steps):
        index.apply(snap(instance, sequence, *events, reset=reset))
        if not reset and instance in last and sequence <= last[instance]:
            continue
        if reset or (instance in last and sequence > last[instance] + 1):
            model[instance] = set()
        last[instance] = sequence
        blocks = model.setdefault(instance, set())
        for kind, hashes in events:
            if kind is STORED:
                blocks.update(hashes)
            else:
                blocks.difference_update(hashes)
    expected = {}
    for instance, blocks in model.items():
        depth = 0
        while depth < len(chain) and chain[depth] in blocks:
            depth += 1
        if depth:
            expected[instance] = depth
    assert index.overlap(chain) == expected
    for instance, blocks in model.items():
        assert index.num_blocks(instance) == len(blocks)
