"""Smoke test of the load benchmarks: `--quick` of each comparison script and of `duet bench`, each
in its own process, checking the envelope of docs/architecture.md, "Benchmarks" (the JSON object on
the very last stdout line) and what `duet bench` writes to --out. Performance targets are not
asserted (timings on a shared machine are noise); the envelope's shape and that every request
completed are.

The processes join one local Ray head that this module starts on 127.0.0.1 (through RAY_ADDRESS,
as under `ray job submit`), so that the ten-odd seconds of starting Ray are paid once, not per script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ray_address():
    from ray.cluster_utils import Cluster

    # tests/conftest.py pins Ray to 127.0.0.1 when joining a cluster; the subprocesses inherit it.
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"
    head = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    try:
        yield head.address
    finally:
        head.shutdown()


def _env(ray_address: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env.pop("RAY_ADDRESS", None)
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(args: list[str], ray_address: str) -> dict:
    result = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=_env(ray_address), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    lines = result.stdout.rstrip("\n").splitlines()
    assert len(lines) > 1, result.stdout  # a table, then the envelope
    envelope = json.loads(lines[-1])
    assert set(envelope) == {"bench", "figures", "targets"}
    assert envelope["targets"], envelope
    for name, target in envelope["targets"].items():
        assert set(target) == {"value", "target", "met"}, name
        assert isinstance(target["met"], bool) and isinstance(target["value"], (int, float)), name
    return envelope


# `duet bench`, through `python -m cluster.cli` so that it runs this checkout's code.
BENCH_COMMAND = ["-m", "cluster.cli", "bench"]


def test_duet_bench_quick(ray_address, tmp_path) -> None:
    out = tmp_path / "results"
    envelope = _run([*BENCH_COMMAND, "--quick", "--no-progress", "--slo-ttft-ms", "60000", "--out", str(out)], ray_address)
    assert envelope["bench"] == "duet_bench"
    assert envelope["targets"]["completed_fraction"] == {"value": 1.0, "target": 1.0, "met": True}
    points = envelope["figures"]["points"]
    assert sorted(points) == ["rate=16/s", "rate=4/s"]  # --quick sweeps two rates
    for figures in points.values():
        assert figures["completed"] == 12 and figures["failed"] == 0
        assert figures["ttft_p50_ms"] > 0 and figures["tpot_p99_ms"] > 0
        assert figures["goodput_rps"] > 0  # a one-minute TTFT objective is met
    document = json.loads((out / "results.json").read_text())
    assert len(document["points"]) == 2
    requests = document["points"][0]["requests"]
    assert len(requests) == 12 and all(r["error"] is None and r["output_tokens"] == 16 for r in requests)
    assert all(len(r["chunk_times_s"]) >= 1 for r in requests)
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["latency_cdf_rate_16_s.png", "latency_cdf_rate_4_s.png", "throughput_goodput.png"]
    assert all(p.stat().st_size > 1000 for p in out.glob("*.png"))


def test_disagg_vs_colocated_quick(ray_address) -> None:
    envelope = _run(["bench/disagg_vs_colocated.py", "--quick"], ray_address)
    assert envelope["bench"] == "disagg_vs_colocated"
    assert set(envelope["targets"]) == {"prefill_heavy_tpot_p99_ratio", "prefill_heavy_goodput_ratio", "decode_heavy_goodput_ratio"}
    for mix in ("prefill-heavy", "decode-heavy"):
        for side in ("disagg", "colocated"):
            assert envelope["figures"][mix][side]["failed"] == 0, (mix, side)
        assert envelope["figures"][mix]["ratios_disagg_over_colocated"]["tpot_p99"] > 0


def test_placement_policies_quick(ray_address) -> None:
    envelope = _run(["bench/placement_policies.py", "--quick"], ray_address)
    assert envelope["bench"] == "placement_policies"
    assert set(envelope["targets"]) == {
        "shared_prefix_kv_aware_minus_round_robin_hit_rate",
        "multi_turn_kv_aware_minus_round_robin_hit_rate",
    }
    for workload in ("shared-prefix", "multi-turn"):
        for policy in ("round_robin", "least_loaded", "kv_aware"):
            figures = envelope["figures"][workload][policy]
            assert figures["failed"] == 0, (workload, policy)
            assert 0.0 <= figures["prefix_cache_hit_rate"] <= 1.0


def test_bench_rejects_bad_flags_without_starting_anything() -> None:
    result = subprocess.run(
        [sys.executable, *BENCH_COMMAND, "--workload", "shared-prefix", "--num-requests", "5"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--num-requests" in result.stderr


def test_unreachable_target_is_one_line_and_exit_5(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, *BENCH_COMMAND, "--target", "127.0.0.1:1", "--quick", "--out", str(tmp_path)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 5, result.stderr
    assert "cannot reach the duet front end at 127.0.0.1:1" in result.stderr
    assert "Traceback" not in result.stderr
