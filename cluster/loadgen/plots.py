"""PNG plots of a benchmark: latency CDFs (one figure per sweep point, p50 and p99 marked) and
throughput and goodput against the swept rate or concurrency. Every figure carries a caption that
names the workload, the load and the target, so that a PNG read on its own says what it measured.
A throughput plot needs two or more points: a single-point run's throughput is a number (in the
table and results.json), and a lone dot on an axis says nothing more, so it is not drawn.
matplotlib is imported here, lazily, with the Agg backend (no display needed); it is a dev
dependency, so a missing one is a typed error the CLI reports."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.loadgen.arrivals import FixedConcurrency
from cluster.loadgen.metrics import percentile
from cluster.loadgen.report import PointResult

# The percentiles marked on each latency CDF, with their line styles.
MARKED_PERCENTILES = ((50, "--"), (99, ":"))


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


def save_figure(figure: Any, path: Path, *, dpi: int = 100, rect: tuple[float, float, float, float] | None = None) -> Path:
    """Lay `figure` out (within `rect`, leaving room for a caption), write it to `path` and free it."""
    figure.tight_layout(rect=rect)
    figure.savefig(path, dpi=dpi)
    _pyplot().close(figure)
    return path


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


def _caption(figure: Any, caption: str) -> None:
    if caption:
        figure.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=8, color="0.3", wrap=True)


def plot_latency_cdf(result: PointResult, out_dir: Path, caption: str = "") -> Path:
    plt = _pyplot()
    series = latency_series_ms(result)
    figure, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.8))
    for axis, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            xs, ys = _cdf(values)
            axis.step(xs, ys, where="post", color="tab:blue")
            for q, style in MARKED_PERCENTILES:
                value = percentile(values, q)
                axis.axvline(value, linestyle=style, color="tab:red", linewidth=1, label=f"p{q} {value:.3g} ms")
            axis.legend(loc="lower right", fontsize=8)
        else:
            axis.text(0.5, 0.5, "no samples", ha="center", va="center", transform=axis.transAxes)
        axis.set_title(name)
        axis.set_xlabel("ms")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    figure.suptitle(f"latency CDF, {result.arrivals.label}")
    _caption(figure, f"{caption}; {result.arrivals.label}" if caption else result.arrivals.label)
    return save_figure(figure, out_dir / f"latency_cdf_{_slug(result.arrivals.label)}.png", rect=(0, 0.06, 1, 1))


def plot_throughput(results: Sequence[PointResult], out_dir: Path, caption: str = "") -> Path | None:
    """Request throughput and goodput (left), output token throughput (right) against the load;
    None (no plot) for fewer than two points."""
    if len(results) < 2:
        return None
    plt = _pyplot()
    ordered = sorted(results, key=lambda r: r.arrivals.x_value)
    numeric = all(math.isfinite(r.arrivals.x_value) for r in ordered)
    # An infinite rate has no place on a numeric axis: then the points are evenly spaced and labelled.
    xs = [r.arrivals.x_value if numeric else float(i) for i, r in enumerate(ordered)]
    axis_name = "concurrency" if ordered and isinstance(ordered[0].arrivals, FixedConcurrency) else "request rate (req/s)"
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
    _caption(figure, caption)
    return save_figure(figure, out_dir / "throughput_goodput.png", rect=(0, 0.06, 1, 1))


def plot_all(results: Sequence[PointResult], out_dir: Path, caption: str = "") -> list[Path]:
    """Every plot of a run; `caption` names the workload and the target (see `caption`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency_cdf(result, out_dir, caption) for result in results]
    throughput = plot_throughput(results, out_dir, caption)
    if throughput is not None:
        paths.append(throughput)
    return paths


def caption(workload: str, target: str) -> str:
    """"workload fixed (128 in / 64 out, 100 requests); target 10.0.0.5:50051"."""
    return f"workload {workload}; target {target}"
