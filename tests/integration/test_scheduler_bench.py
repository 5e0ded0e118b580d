"""bench/scheduler_bench.py --quick runs every policy and pool to the end (no pool over-committed by
the bench's own setup) and ends with the JSON summary line."""

from __future__ import annotations

import pytest
from bench_summary import run_bench

POLICIES = ("MAX_UTILIZATION", "GUARANTEED_NO_EVICT", "STATIC_BATCH")


@pytest.mark.timeout(180)
def test_quick_bench_runs_every_policy_and_pool() -> None:
    summary, _ = run_bench("scheduler_bench.py", "--quick")
    assert summary["bench"] == "scheduler_bench"
    figures = summary["figures"]
    assert 0 < figures["floor_hot_us_per_request"] < figures["floor_us_per_request"] * 10
    for policy in POLICIES:
        for pool in ("roomy", "pressure"):
            for size in (256, 1024):
                assert figures[f"{policy}_{pool}_{size}_us_per_request"] > 0
            for name in (f"{policy}_{pool}_1024_x_floor", f"{policy}_{pool}_1024_vs_256"):
                assert summary["targets"][name]["value"] > 0, name
    # The pressure pool makes MAX_UTILIZATION pause (the runs are seeded, so this is deterministic);
    # the other policies never pause.
    assert figures["MAX_UTILIZATION_pressure_256_pauses"] + figures["MAX_UTILIZATION_pressure_1024_pauses"] >= 1
    for policy in POLICIES[1:]:
        for pool in ("roomy", "pressure"):
            assert figures[f"{policy}_{pool}_256_pauses"] == figures[f"{policy}_{pool}_1024_pauses"] == 0
