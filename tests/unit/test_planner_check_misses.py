"""bench/planner_check.py's account of why a split missed its SLOs: per point, the share of requests
over each SLO, and the second-token gap (first token to second) that holds a hand-over."""

from __future__ import annotations

import pytest

from bench.planner_check import SLO, misses, second_token_gaps_s
from cluster.loadgen.metrics import RequestRecord, compute_metrics


def _record(index: int, first_s: float, gaps_s: tuple[float, ...], *, first_tokens: int = 1, error: str | None = None) -> RequestRecord:
    times = [first_s]
    for gap in gaps_s:
        times.append(times[-1] + gap)
    tokens = (first_tokens,) + (1,) * len(gaps_s)
    return RequestRecord(
        index=index, sent_s=0.0, end_s=times[-1], chunk_times_s=tuple(times), chunk_tokens=tokens,
        output_tokens=sum(tokens), expected_output_tokens=sum(tokens), error=error,
    )


def test_the_second_token_gap_is_the_first_tokens_wait_for_the_second() -> None:
    records = [
        _record(0, 0.1, (0.06, 0.01, 0.01)),  # a slow hand-over: 60 ms to the second token
        _record(1, 0.1, (0.01, 0.01), first_tokens=2),  # the first message carried two tokens: no wait
        _record(2, 0.1, ()),  # one token: no second
        _record(3, 0.1, (0.05,), error="UNAVAILABLE: gone"),  # failed: not counted
    ]
    assert second_token_gaps_s(records) == pytest.approx([0.06, 0.0])


def test_misses_tell_a_slow_queue_from_a_slow_hand_over() -> None:
    assert (SLO.ttft_ms, SLO.tpot_ms) == (500.0, 25.0)
    records = [
        # TPOT (0.08 + 0.01 + 0.01) / 3 = 33 ms: over the TPOT SLO on the hand-over's gap alone.
        _record(0, 0.1, (0.08, 0.01, 0.01)),
        _record(1, 0.1, (0.08, 0.01, 0.01)),
        _record(2, 0.6, (0.01, 0.01, 0.01)),  # TTFT 600 ms: over the TTFT SLO
        _record(3, 0.1, (0.01, 0.01, 0.01)),  # met both
        _record(4, 0.1, (0.01,), error="DEADLINE_EXCEEDED: late"),
    ]
    metrics = compute_metrics(records, 1.0, SLO)
    why = misses(records, metrics)
    assert (why["failed"], why["over_ttft"], why["over_tpot"]) == (0.2, 0.2, 0.4)
    assert why["second_token_gap_p50_ms"] == pytest.approx(45.0)  # 10, 10, 80, 80 ms
    assert why["second_token_gap_p90_ms"] == pytest.approx(80.0)
    assert why["tpot_p90_ms"] == pytest.approx(round(metrics.tpot_ms.p90, 1))
    assert why["ttft_p90_ms"] == pytest.approx(round(metrics.ttft_ms.p90, 1))
