"""The benchmark's plots: p50/p99 marked, a caption naming workload, load and target, and no
throughput plot for a single point (a lone dot says nothing the table does not)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from cluster.loadgen.arrivals import PoissonArrivals  # noqa: E402
from cluster.loadgen.metrics import RequestRecord, compute_metrics  # noqa: E402
from cluster.loadgen.plots import caption, plot_all, plot_latency_cdf  # noqa: E402
from cluster.loadgen.runner import PointResult, RunOutcome  # noqa: E402


def _point(rate: float) -> PointResult:
    records = tuple(
        RequestRecord(
            index=i, sent_s=i * 0.1, end_s=i * 0.1 + 0.5, chunk_times_s=(i * 0.1 + 0.1, i * 0.1 + 0.3, i * 0.1 + 0.5),
            chunk_tokens=(1, 1, 1), prompt_tokens=10, output_tokens=3, cached_tokens=0, expected_output_tokens=3,
        )
        for i in range(20)
    )
    return PointResult(PoissonArrivals(rate), RunOutcome(records, 2.5, 0.0), compute_metrics(records, 2.5))


def test_a_single_rate_run_has_no_throughput_plot(tmp_path) -> None:
    paths = plot_all([_point(4.0)], tmp_path, caption("fixed (128 in / 64 out, 20 requests)", "127.0.0.1:50051"))
    assert [p.name for p in paths] == ["latency_cdf_rate_4_s.png"]
    paths = plot_all([_point(4.0), _point(8.0)], tmp_path, "")
    assert sorted(p.name for p in paths) == ["latency_cdf_rate_4_s.png", "latency_cdf_rate_8_s.png", "throughput_goodput.png"]


def test_latency_plots_mark_p50_and_p99_and_carry_the_caption(tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    plot_latency_cdf(_point(4.0), tmp_path, caption("fixed (128 in / 64 out, 20 requests)", "127.0.0.1:50051"))
    (figure,) = figures
    texts = [text.get_text() for text in figure.texts]
    assert "workload fixed (128 in / 64 out, 20 requests); target 127.0.0.1:50051; rate=4/s" in texts
    for axis in figure.axes:
        labels = [line.get_label() for line in axis.get_lines()]
        assert any(label.startswith("p50 ") for label in labels) and any(label.startswith("p99 ") for label in labels), axis.get_title()
    real_close(figure)
