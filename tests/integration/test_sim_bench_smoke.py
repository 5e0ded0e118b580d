"""Smoke test of the simulator's benchmarks: bench/sim_scale.py, bench/disagg_at_scale.py and
bench/sim_validation.py --quick in their own processes, checking the envelope (docs/architecture.md,
"Benchmarks") and that every simulated request completed. Wall time and accuracy targets are not
asserted (a shared machine's timings are noise; sim_validation's --quick runs 6 requests a case)."""

from __future__ import annotations

import json

from bench_summary import run_bench

from worker.profiler import read_step_log

VALIDATION_METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")


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


def test_sim_validation_quick_and_its_replay(tmp_path) -> None:
    """--quick runs both cases on real 1P+1G clusters (embedded Ray on 127.0.0.1, a fresh one per
    run, about a minute here) and in the simulator, and emits every figure; --replay of what --out
    kept gives the same comparison without running anything real."""
    kept = tmp_path / "steps"
    envelope, _ = run_bench("sim_validation.py", "--quick", "--out", str(tmp_path), "--keep-steps", str(kept), timeout_s=400)
    assert envelope["bench"] == "sim_validation"
    figures = envelope["figures"]
    assert figures["cases_total"] == 2 and figures["metrics_total"] == 8
    for case in ("1p1g_prefill_heavy", "1p1g_decode_heavy"):
        assert figures[f"{case}_rate_per_s"] > 0
        for metric in VALIDATION_METRICS:
            assert figures[f"{case}_{metric}_rel_error"] >= 0
            assert figures[f"{case}_{metric}_real_vs_real"] >= 0
    assert 0 <= figures["median_noise_floor"] < 1 and figures["median_rel_error"] >= 0
    # The real runs' instances logged their steps: how fast the host ran them against the profile.
    for case in ("1p1g_prefill_heavy", "1p1g_decode_heavy"):
        assert figures[f"{case}_real_step_speed"] > 0
    assert figures["speed_matched_median_rel_error"] >= 0
    # --keep-steps kept the logs behind those figures: both instances' steps of each run.
    for case in ("prefill_heavy", "decode_heavy"):
        for run in (1, 2):
            logs = sorted((kept / "1p1g" / f"{case}-{run}").glob("*.jsonl"))
            assert [log.stem for log in logs] == ["generation-0", "prefill-0"]
            assert all(list(read_step_log(log)) for log in logs)
    assert set(envelope["targets"]) == {"median_rel_error"}

    stored = json.loads((tmp_path / "real_runs.json").read_text())
    assert set(stored["real"]) == {"1p1g"} and set(stored["real"]["1p1g"]) == {"prefill_heavy", "decode_heavy"}
    # The quick calibration's generation instance is rarely idle in its loaded pass; the hand-over is
    # still measured (from the first pass too), not left at 0 as it was.
    assert stored["profiles"]["1p1g"]["handover_fixed_s"] > 0
    replayed, _ = run_bench("sim_validation.py", "--replay", str(tmp_path / "real_runs.json"), timeout_s=120)
    again = replayed["figures"]
    # The simulation is seeded: against the same real runs it makes the same errors.
    for key in ("median_rel_error", "median_noise_floor", "cases_within_bound", "metrics_within_bound", "speed_matched_median_rel_error"):
        assert again[key] == figures[key], key
    assert again["replayed"].endswith("real_runs.json")
