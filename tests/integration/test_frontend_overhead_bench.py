"""bench/frontend_overhead.py --quick serves gRPC and the OpenAI HTTP API on one router over instant
instances, drives both from a separate load-generator process at concurrency 1 and 32, and ends
with the JSON summary line. It asserts no speed: the figures are the bench's to report."""

from __future__ import annotations

import pytest
from bench_summary import run_bench


@pytest.mark.timeout(180)
def test_quick_frontend_overhead_bench_completes_and_reports() -> None:
    summary, _ = run_bench("frontend_overhead.py", "--quick", "--requests", "100")
    assert summary["bench"] == "frontend_overhead"
    figures = summary["figures"]
    for backend in ("grpc", "http"):
        for concurrency in (1, 32):
            assert figures[f"{backend}_rps_c{concurrency}"] > 0
            assert figures[f"{backend}_ttft_p50_ms_c{concurrency}"] > 0
    assert set(summary["targets"]) == {"http_vs_grpc_rps_ratio_c32", "http_minus_grpc_ttft_p50_ms_c1"}
