"""The router's instance snapshots: an instance's EngineLoad stamped with its id, sequence and reset.

The load's own wire checks (types, ranges, size, version) are tests/unit/test_protocol.py's.
"""

from __future__ import annotations

import dataclasses

import pytest

from cluster.router.snapshot import MAX_INSTANCE_ID_CHARS, InstanceSnapshot, InvalidSnapshot
from worker.protocol import MAX_COUNTER, EngineLoad, InstanceRole

LOAD = EngineLoad(InstanceRole.PREFILL, total_blocks=100, free_blocks=40, tokens_per_block=16)


def test_a_snapshot_carries_the_load_and_its_stamp():
    snapshot = InstanceSnapshot("prefill-0", LOAD, sequence=3, reset=True)
    assert (snapshot.instance_id, snapshot.load, snapshot.sequence, snapshot.reset) == ("prefill-0", LOAD, 3, True)
    assert InstanceSnapshot("p", LOAD).sequence == 0 and not InstanceSnapshot("p", LOAD).reset


@pytest.mark.parametrize(
    ("field", "overrides"),
    [
        ("instance_id", {"instance_id": ""}),
        ("instance_id", {"instance_id": 7}),
        ("instance_id", {"instance_id": "x" * (MAX_INSTANCE_ID_CHARS + 1)}),
        ("instance_id", {"instance_id": "bad\nid"}),
        ("load", {"load": {"free_blocks": 3}}),
        ("sequence", {"sequence": -1}),
        ("sequence", {"sequence": MAX_COUNTER + 1}),
        ("sequence", {"sequence": True}),
        ("sequence", {"sequence": 1.0}),
        ("reset", {"reset": 1}),
        ("reset", {"reset": "yes"}),
    ],
)
def test_construction_is_validated(field, overrides):
    values = {"instance_id": "prefill-0", "load": LOAD, "sequence": 0, "reset": False, **overrides}
    with pytest.raises(InvalidSnapshot) as info:
        InstanceSnapshot(**values)
    assert info.value.field == field


def test_the_longest_printable_instance_id_is_accepted():
    assert InstanceSnapshot("i" * MAX_INSTANCE_ID_CHARS, LOAD, sequence=MAX_COUNTER).sequence == MAX_COUNTER


def test_snapshots_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        InstanceSnapshot("p", LOAD).sequence = 3  # type: ignore[misc]
