"""bench/router_bench.py --quick drives the whole router over 64 instant instances to the end (every
request complete and handed over, the prefix index populated) and ends with the JSON summary line.
It asserts no speed: the figures are the bench's to report."""

from __future__ import annotations

import pytest
from bench_summary import run_bench


@pytest.mark.timeout(180)
def test_quick_router_bench_completes_and_reports() -> None:
    summary, _ = run_bench("router_bench.py", "--quick", "--requests", "400")
    assert summary["bench"] == "router"
    figures = summary["figures"]
    assert figures["instances"] == 64 and figures["requests"] == 400
    assert figures["indexed_blocks"] >= 99_000  # 100k blocks over 64 instances, integer division
    assert figures["messages_per_request"] >= 10  # every request handed over: submit, reserve, push, commit...
    assert figures["requests_per_s"] > 0 and figures["floor_requests_per_s"] > figures["requests_per_s"]
    assert set(summary["targets"]) == {"requests_per_s", "placement_us_per_decision"}
