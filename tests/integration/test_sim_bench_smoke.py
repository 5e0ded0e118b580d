"""Smoke test of the simulator's benchmarks: bench/sim_scale.py and bench/disagg_at_scale.py --quick in their own processes, checking
the envelope (docs/architecture.md, "Benchmarks") and that every simulated request completed. Wall
time targets are not asserted (a shared machine's timings are noise). bench/sim_validation.py
--quick starts real Ray clusters and takes minutes: it is run by hand, not here."""

from __future__ import annotations

from bench_summary import run_bench


def test_sim_scale_quick() -> None:
    envelope, _ = run_bench("sim_scale.py", "--quick", timeout_s=170)
    assert envelope["bench"] == "sim_scale"
    figures = envelope["figures"]
    assert figures["instances"] == 16 and figures["requests"] == 1000
    assert figures["completed"] == 1000 and figures["illegal_transitions"] == 0
    assert figures["sim_requests_per_wall_s"] > 0 and figures["router_us_per_request"] > 0
    assert set(envelope["targets"]) == {"wall_s"}


def test_disagg_at_scale_quick(tmp_path) -> None:
    envelope, _ = run_bench("disagg_at_scale.py", "--quick", "--out", str(tmp_path), timeout_s=170)
    assert envelope["bench"] == "disagg_at_scale"
    figures = envelope["figures"]
    assert figures["instances"] == 2
    for mix in ("prefill_heavy", "decode_heavy"):
        assert figures[f"{mix}_colocated_goodput_per_gpu"] > 0
        assert figures[f"{mix}_window_s"] == 1.0
    assert (tmp_path / "disagg_at_scale.png").stat().st_size > 0
    assert (tmp_path / "prefill_heavy" / "plan.json").exists()
