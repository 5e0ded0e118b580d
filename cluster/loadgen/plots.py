"""PNG plots of a benchmark: latency CDFs (one figure per sweep point) and throughput and goodput
against the swept rate or concurrency. matplotlib is imported here, lazily, with the Agg backend
(no display needed); it is a dev dependency, so a missing one is a typed error the CLI reports."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.loadgen.arrivals import PoissonArrivals
from cluster.loadgen.report import PointResult


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise PlotsUnavailable(f"plots need matplotlib ({error}); pip install matplotlib") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    count = len(ordered)
    return ordered, [(i + 1) / count for i in range(count)]


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label).strip("_")


def latency_series_ms(result: PointResult) -> dict[str, list[float]]:
    records = [r for r in result.outcome.records if r.ok]
    return {
        "TTFT": [r.ttft_s * 1000 for r in records if r.ttft_s is not None],
        "TPOT": [r.tpot_s * 1000 for r in records if r.tpot_s is not None],
        "ITL": [gap * 1000 for r in records for gap in r.itls_s],
        "E2E": [r.e2e_s * 1000 for r in records],
    }


def plot_latency_cdf(result: PointResult, out_dir: Path) -> Path:
    plt = _pyplot()
    series = latency_series_ms(result)
    figure, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.4))
    for axis, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            xs, ys = _cdf(values)
            axis.step(xs, ys, where="post")
        axis.set_title(name)
        axis.set_xlabel("ms")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    figure.suptitle(f"latency CDF, {result.arrivals.label}")
    figure.tight_layout()
    path = out_dir / f"latency_cdf_{_slug(result.arrivals.label)}.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_throughput(results: Sequence[PointResult], out_dir: Path) -> Path:
    """Request throughput and goodput (left), output token throughput (right) against the load."""
    plt = _pyplot()
    ordered = sorted(results, key=lambda r: r.arrivals.x_value)
    numeric = all(math.isfinite(r.arrivals.x_value) for r in ordered)
    # An infinite rate has no place on a numeric axis: then the points are evenly spaced and labelled.
    xs = [r.arrivals.x_value if numeric else float(i) for i, r in enumerate(ordered)]
    axis_name = "request rate (req/s)" if ordered and isinstance(ordered[0].arrivals, PoissonArrivals) else "concurrency"
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    if not numeric:
        for axis in (left, right):
            axis.set_xticks(xs, [r.arrivals.label for r in ordered])
    left.plot(xs, [r.metrics.request_throughput_rps for r in ordered], marker="o", label="throughput")
    goodput = [r.metrics.goodput_rps for r in ordered]
    if all(g is not None for g in goodput):
        left.plot(xs, goodput, marker="s", label="goodput (SLOs met)")
    left.set_xlabel(axis_name)
    left.set_ylabel("requests/s")
    left.legend()
    left.grid(alpha=0.3)
    right.plot(xs, [r.metrics.output_throughput_tps for r in ordered], marker="o", color="tab:green")
    right.set_xlabel(axis_name)
    right.set_ylabel("output tokens/s")
    right.grid(alpha=0.3)
    figure.tight_layout()
    path = out_dir / "throughput_goodput.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_all(results: Sequence[PointResult], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency_cdf(result, out_dir) for result in results]
    paths.append(plot_throughput(results, out_dir))
    return paths
