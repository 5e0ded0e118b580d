"""The fault plan: parsing from config data, deterministic seeded draws, matching, limits, holds."""

from __future__ import annotations

import pytest

from worker.kv_transfer.faults import (
    NO_CHUNK_FAULTS,
    FaultInjector,
    FaultKind,
    FaultPlan,
    FaultPlanError,
    FaultSide,
)


def _injector(rules: list[dict], seed: int = 7, **kwargs) -> FaultInjector:
    return FaultInjector(FaultPlan.from_mapping({"seed": seed, "rules": rules}), **kwargs)


def test_default_and_empty_plans_inject_nothing() -> None:
    for injector in (FaultInjector(FaultPlan()), FaultInjector.from_mapping(None), FaultInjector.from_mapping({})):
        assert not injector.enabled
        faults = injector.begin_transfer(FaultSide.SENDER, "t", "r")
        assert not faults.active and faults.on_chunk(0) is NO_CHUNK_FAULTS
        assert injector.hold_seconds("r", "DISAGG_GENERATION_INIT") == 0.0
    disabled = FaultInjector.from_mapping({"enabled": False, "rules": [{"kind": "drop"}]})
    assert disabled.begin_transfer(FaultSide.SENDER, "t", "r").on_chunk(0) is NO_CHUNK_FAULTS


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"rules": [{"kind": "explode"}]}, r"rules\[0\]\.kind"),
        ({"rules": [{"kind": "drop", "probability": 1.5}]}, r"rules\[0\].*probability"),
        ({"rules": [{"kind": "drop", "chunks": 1}]}, r"unknown field"),
        ({"rules": [{"kind": "delay"}]}, r"needs seconds"),
        ({"rules": [{"kind": "hold", "seconds": 1}]}, r"needs state"),
        ({"rules": [{"kind": "corrupt", "side": "receiver"}]}, r"cannot act on the receiver side"),
        ({"rules": [{"kind": "drop", "request_ids": "r1"}]}, r"request_ids"),
        ({"rules": [{"kind": "drop", "scope": "forever"}]}, r"scope"),
        ({"rules": [{"probability": 0.5}]}, r"kind is required"),
        ({"rule": []}, r"unknown field"),
        ({"seed": "x", "rules": []}, r"seed"),
    ],
)
def test_invalid_plans_name_the_offending_field(data: dict, message: str) -> None:
    with pytest.raises(FaultPlanError, match=message):
        FaultPlan.from_mapping(data)


def test_draws_are_deterministic_and_roughly_calibrated() -> None:
    rules = [{"kind": "drop", "probability": 0.3}]

    def decisions(seed: int) -> list[bool]:
        injector = _injector(rules, seed=seed)
        out = []
        for request in range(40):
            faults = injector.begin_transfer(FaultSide.SENDER, f"t{request}", f"req-{request}")
            out.extend(faults.on_chunk(chunk).drop for chunk in range(10))
        return out

    first, again, other = decisions(7), decisions(7), decisions(8)
    assert first == again
    assert first != other
    assert 0.2 < sum(first) / len(first) < 0.4


def test_a_retried_transfer_draws_afresh() -> None:
    injector = _injector([{"kind": "corrupt", "scope": "transfer", "probability": 0.5}])
    hits = [injector.begin_transfer(FaultSide.SENDER, f"t{i}", "same-request").on_chunk(0).corrupt for i in range(40)]
    assert 5 < sum(hits) < 35


def test_request_filter_side_and_chunk_selection() -> None:
    injector = _injector(
        [
            {"kind": "corrupt", "request_ids": ["victim"], "chunk": 2},
            {"kind": "expire", "side": "receiver"},
        ]
    )
    victim = injector.begin_transfer(FaultSide.SENDER, "t1", "victim")
    assert [victim.on_chunk(index).corrupt for index in range(4)] == [False, False, True, False]
    bystander = injector.begin_transfer(FaultSide.SENDER, "t2", "bystander")
    assert not bystander.active
    receiver = injector.begin_transfer(FaultSide.RECEIVER, "t1", "victim")
    assert receiver.on_chunk(0).expire and not receiver.on_chunk(0).corrupt


def test_transfer_scope_hits_one_chunk_and_max_fires_limits() -> None:
    injector = _injector([{"kind": "duplicate", "scope": "transfer", "max_fires": 2}])
    hits = []
    for index in range(4):
        faults = injector.begin_transfer(FaultSide.SENDER, f"t{index}", f"r{index}")
        hits.append([faults.on_chunk(chunk).duplicate for chunk in range(3)])
    assert hits == [[True, False, False], [True, False, False], [False] * 3, [False] * 3]
    assert injector.fires() == (2,)


def test_delay_and_stall_carry_their_seconds() -> None:
    injector = _injector([{"kind": "delay", "seconds": 0.25}, {"kind": "delay", "seconds": 0.5}, {"kind": "stall", "seconds": 1.5}])
    faults = injector.begin_transfer(FaultSide.SENDER, "t", "r").on_chunk(0)
    assert faults.delay_s == pytest.approx(0.75)
    assert faults.stall and faults.stall_extra_s == 1.5


def test_refuse_is_decided_at_prepare() -> None:
    injector = _injector([{"kind": "refuse", "side": "receiver", "request_ids": ["r1"]}])
    assert injector.begin_transfer(FaultSide.RECEIVER, "t", "r1").refuse()
    assert not injector.begin_transfer(FaultSide.RECEIVER, "t", "r2").refuse()


def test_hold_seconds_answers_per_request_and_state() -> None:
    injector = _injector(
        [
            {"kind": "hold", "state": "DISAGG_GENERATION_INIT", "seconds": 2.0, "request_ids": ["r1"]},
            {"kind": "hold", "state": "DISAGG_GENERATION_INIT", "seconds": 0.5},
        ]
    )
    assert injector.hold_seconds("r1", "DISAGG_GENERATION_INIT") == 2.0
    assert injector.hold_seconds("r2", "DISAGG_GENERATION_INIT") == 0.5
    assert injector.hold_seconds("r1", "GENERATION_IN_PROGRESS") == 0.0


def test_kill_uses_the_injected_killer() -> None:
    killed = []
    injector = _injector([{"kind": "kill"}], kill=lambda: killed.append(True))
    faults = injector.begin_transfer(FaultSide.SENDER, "t", "r").on_chunk(0)
    assert faults.kill
    injector.kill()
    assert killed == [True]


def test_every_kind_is_documented_in_the_module_table() -> None:
    import worker.kv_transfer.faults as module

    for kind in FaultKind:
        assert f"| {kind.value:<9} |" in module.__doc__, kind
