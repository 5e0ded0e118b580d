"""bench/stream_interval.py --quick deploys two MIXED instances as Ray actors, one reporting every
step and one grouping tokens for 20 ms, and ends with the JSON summary line. It asserts no speed
(the figures are the bench's to report), only what grouping means: the same number of requests on
both sides, fewer token events on the grouped one."""

from __future__ import annotations

import pytest
from bench_summary import run_bench


@pytest.mark.timeout(180)
def test_quick_stream_interval_bench_completes_and_reports() -> None:
    summary, _ = run_bench("stream_interval.py", "--quick")
    assert summary["bench"] == "stream_interval"
    figures = summary["figures"]
    assert figures["every_step_events_per_request"] == figures["max_tokens"] == 40
    assert 1 < figures["interval_events_per_request"] < 40
    for side in ("every_step", "interval"):
        assert figures[f"{side}_driver_cpu_us_per_token"] > 0 and figures[f"{side}_ttft_ms"] > 0
