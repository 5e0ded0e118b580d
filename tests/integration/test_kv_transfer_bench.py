"""bench/transfer_bench.py --quick runs end to end and ends with the JSON summary line."""

from __future__ import annotations

import pytest
from bench_summary import run_bench


@pytest.mark.timeout(180)
def test_quick_bench_prints_the_summary_envelope() -> None:
    summary, stderr = run_bench(
        "transfer_bench.py", "--quick", "--size-mib", "8", "--repetitions", "2", "--latency-repetitions", "2"
    )
    assert summary["bench"] == "transfer"
    figures = summary["figures"]
    for name in (
        "grpc_gbps",
        "bare_grpc_gbps",
        "raw_tcp_gbps",
        "memcpy_gbps",
        "xxh3_gbps",
        "crc32_gbps",
        "ratio_grpc_vs_raw_tcp",
        "ratio_bare_grpc_vs_raw_tcp",
        "ratio_grpc_vs_bare_grpc",
    ):
        assert figures[name] > 0, name
    low, high = figures["ratio_grpc_vs_raw_tcp_range"]
    assert 0 < low <= high
    assert figures["checksum"] == "xxh3_64"
    target = summary["targets"]["ratio_grpc_vs_raw_tcp"]
    assert set(target) == {"value", "target", "met"} and target["met"] == (target["value"] >= target["target"])
    assert "rep 1" in stderr  # progress goes to stderr
    # The data planes: one transfer per size on each plane and bare, and shm against memcpy.
    for size in ("65536", "1048576", "4194304", "16777216"):
        assert set(figures["latency_p50_ms"][size]) == {"grpc", "shm", "bare", "raw"}
        assert all(value > 0 for value in figures["latency_p50_ms"][size].values())
    assert figures["shm_gbps"] > 0 and figures["ratio_shm_vs_memcpy"] > 0
    assert {"latency_4mib_grpc_ms", "latency_4mib_shm_ms", "ratio_shm_vs_memcpy"} <= set(summary["targets"])
