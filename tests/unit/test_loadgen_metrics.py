"""vLLM's metric definitions on synthetic timings."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.client import InstanceWork
from cluster.loadgen.metrics import (
    Distribution,
    PercentileMethod,
    RequestRecord,
    Slo,
    SloError,
    compute_metrics,
    percentile,
)


def record(index, sent, chunks, *, tokens=None, end=None, prompt=10, cached=0, error=None, expected=0):
    """A request sent at `sent` whose messages arrived at `chunks` (one token each unless `tokens`)."""
    tokens = tokens or [1] * len(chunks)
    return RequestRecord(
        index=index,
        sent_s=sent,
        end_s=end if end is not None else (chunks[-1] if chunks else sent),
        chunk_times_s=tuple(chunks),
        chunk_tokens=tuple(tokens),
        prompt_tokens=prompt,
        output_tokens=sum(tokens),
        cached_tokens=cached,
        expected_output_tokens=expected,
        error=error,
    )


def test_per_request_definitions() -> None:
    r = record(0, 1.0, [1.2, 1.25, 1.4, 1.5], end=1.6)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(0.6)
    # TPOT = (e2e - ttft) / (tokens - 1) = 0.4 / 3
    assert r.tpot_s == pytest.approx(0.4 / 3)
    assert r.itls_s == pytest.approx((0.05, 0.15, 0.1))


def test_several_tokens_in_one_message_count_for_tpot_but_are_one_itl_arrival() -> None:
    r = record(0, 0.0, [0.1, 0.3], tokens=[1, 3], end=0.3)
    assert r.output_tokens == 4
    assert r.tpot_s == pytest.approx(0.2 / 3)
    assert r.itls_s == pytest.approx((0.2,))


def test_single_token_has_no_tpot_and_no_itl() -> None:
    r = record(0, 0.0, [0.1])
    assert r.tpot_s is None and r.itls_s == ()


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(3)
    for size in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_nearest_rank_percentile_matches_numpy_inverted_cdf() -> None:
    rng = random.Random(4)
    for size in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            expected = float(np.percentile(values, q, method="inverted_cdf"))
            assert percentile(values, q, PercentileMethod.NEAREST_RANK) == expected
    assert percentile([3.0, 0.5], 50, PercentileMethod.NEAREST_RANK) == 0.5  # a value, never between two
    with pytest.raises(ValueError):
        percentile([], 50, PercentileMethod.NEAREST_RANK)


def test_status_message_and_results_form_of_a_record() -> None:
    done = RequestRecord(0, 0.0, 1.0, instances=(InstanceWork("p0", "PREFILL", "prefill"), InstanceWork("g1", "GENERATION", "generation", 2)))
    failed = RequestRecord(1, 0.0, 1.0, error="UNAVAILABLE: recovery exhausted: KV transfer failed")
    assert (done.status, done.message) == ("OK", "")
    assert (failed.status, failed.message) == ("UNAVAILABLE", "recovery exhausted: KV transfer failed")
    assert done.instance_names == ("prefill@p0", "generation@g1")
    # results.json: every field but the soak's checks, instances by name.
    written = done.to_dict()
    assert written["instances"] == ("prefill@p0", "generation@g1")
    assert not {"accepted", "lost", "token_ids", "timeline"} & set(written)
    assert set(written) == {"index", "sent_s", "end_s", "chunk_times_s", "chunk_tokens", "prompt_tokens", "output_tokens",
                            "cached_tokens", "expected_output_tokens", "scheduled_s", "conversation", "turn",
                            "finish_reason", "instances", "error"}


def test_distribution_in_milliseconds() -> None:
    d = Distribution.of_seconds([0.001, 0.002, 0.003, 0.004])
    assert (d.count, d.mean, d.p50, d.min, d.max) == (4, pytest.approx(2.5), pytest.approx(2.5), pytest.approx(1.0), pytest.approx(4.0))
    assert Distribution.of_seconds([]) is None


def test_run_metrics_throughput_goodput_and_cache() -> None:
    records = [
        # ttft 100 ms, tpot (0.5 - 0.1) / 4 = 100 ms, 5 tokens
        record(0, 0.0, [0.1, 0.2, 0.3, 0.4, 0.5], prompt=100, cached=50, expected=5),
        # ttft 300 ms (misses a 200 ms TTFT SLO), tpot 10 ms
        record(1, 1.0, [1.3, 1.31, 1.32], prompt=60, cached=0, expected=3),
        # one token: TPOT counts as 0 for goodput, absent from the TPOT distribution
        record(2, 2.0, [2.05], prompt=40, cached=40, expected=1),
        # failed: excluded from latencies and tokens, counted by kind
        record(3, 2.0, [], prompt=0, error="DEADLINE_EXCEEDED: too slow"),
        record(4, 2.0, [], prompt=0, error="SKIPPED: turn 0 of conversation 1 failed"),
    ]
    m = compute_metrics(records, duration_s=4.0, slo=Slo(ttft_ms=200, tpot_ms=150))
    assert (m.num_requests, m.completed, m.failed) == (5, 3, 2)
    assert dict(m.errors) == {"DEADLINE_EXCEEDED": 1, "SKIPPED": 1}
    assert m.input_tokens == 200 and m.output_tokens == 9 and m.cached_tokens == 90
    assert m.request_throughput_rps == pytest.approx(0.75)
    assert m.output_throughput_tps == pytest.approx(9 / 4)
    assert m.total_throughput_tps == pytest.approx(209 / 4)
    assert m.prefix_cache_hit_rate == pytest.approx(0.45)
    assert m.good_requests == 2 and m.goodput_rps == pytest.approx(0.5)
    assert m.ttft_ms.count == 3 and m.ttft_ms.p50 == pytest.approx(100)
    assert m.tpot_ms.count == 2 and m.tpot_ms.max == pytest.approx(100)
    assert m.itl_ms.count == 4 + 2
    assert m.e2e_ms.max == pytest.approx(500)
    assert m.short_outputs == 0


def test_goodput_needs_an_slo_and_tpot_slo_alone_can_fail() -> None:
    records = [record(0, 0.0, [0.1, 0.2, 0.3]), record(1, 0.0, [0.1, 0.5])]
    assert compute_metrics(records, 1.0).goodput_rps is None
    m = compute_metrics(records, 2.0, Slo(tpot_ms=200))
    assert m.good_requests == 1 and m.goodput_rps == pytest.approx(0.5)
    assert compute_metrics(records, 2.0, Slo(e2e_ms=400)).good_requests == 1


def test_short_outputs_are_counted() -> None:
    m = compute_metrics([record(0, 0.0, [0.1, 0.2], expected=8)], 1.0)
    assert m.short_outputs == 1


def test_nothing_completed_gives_empty_distributions() -> None:
    m = compute_metrics([record(0, 0.0, [], error="UNAVAILABLE: down")], 1.0, Slo(ttft_ms=1))
    assert m.completed == 0 and m.ttft_ms is None and m.prefix_cache_hit_rate is None and m.goodput_rps == 0.0
    assert m.to_dict()["errors"] == {"UNAVAILABLE": 1}


def test_bad_inputs() -> None:
    with pytest.raises(SloError) as info:
        Slo(ttft_ms=0)
    assert info.value.field == "ttft_ms"
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)
