"""Results as a human table (one row per sweep point), a vLLM-style detail block, the results.json
document, and the envelope line that ends a benchmark's stdout (the JSON object of
bench/_common.py's emit_result: {"bench", "figures", "targets"})."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.loadgen.arrivals import PoissonArrivals, ScheduledArrivals
from cluster.loadgen.metrics import BenchMetrics, Distribution
from cluster.loadgen.runner import PointResult


@dataclass(frozen=True)
class TargetValue:
    """A target of the envelope (the same shape as bench/_common.Target)."""

    value: float
    target: float
    higher_is_better: bool

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target


def _ms(distribution: Distribution | None, name: str) -> float | None:
    return None if distribution is None else getattr(distribution, name)


def format_cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[format_cell(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for index, row in enumerate(cells):
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines) + "\n"


SWEEP_HEADERS = (
    "load", "done", "failed", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
    "ITL p99", "E2E p99", "goodput", "cache hit",
)


def sweep_row(label: str, metrics: BenchMetrics) -> list[object]:
    return [
        label,
        metrics.completed,
        metrics.failed,
        metrics.request_throughput_rps,
        metrics.output_throughput_tps,
        _ms(metrics.ttft_ms, "p50"),
        _ms(metrics.ttft_ms, "p99"),
        _ms(metrics.tpot_ms, "p50"),
        _ms(metrics.tpot_ms, "p99"),
        _ms(metrics.itl_ms, "p99"),
        _ms(metrics.e2e_ms, "p99"),
        metrics.goodput_rps,
        metrics.prefix_cache_hit_rate,
    ]


def render_sweep(results: Sequence[PointResult]) -> str:
    """One row per rate (or concurrency); latencies in ms, goodput in requests/s."""
    return render_table(SWEEP_HEADERS, [sweep_row(r.arrivals.label, r.metrics) for r in results])


def render_detail(label: str, metrics: BenchMetrics) -> str:
    """vLLM's `bench serve` summary block for one point."""
    lines = [f"============ Serving Benchmark Result ({label}) ============"]

    def line(name: str, value: object) -> None:
        lines.append(f"{name:<40}{format_cell(value):>12}")

    line("Successful requests:", metrics.completed)
    line("Failed requests:", metrics.failed)
    line("Benchmark duration (s):", metrics.duration_s)
    line("Total input tokens:", metrics.input_tokens)
    line("Total generated tokens:", metrics.output_tokens)
    line("Request throughput (req/s):", metrics.request_throughput_rps)
    line("Output token throughput (tok/s):", metrics.output_throughput_tps)
    line("Total token throughput (tok/s):", metrics.total_throughput_tps)
    if metrics.goodput_rps is not None:
        line("Request goodput (req/s):", metrics.goodput_rps)
    line("Prefix cache hit rate:", metrics.prefix_cache_hit_rate)
    for title, distribution in (
        ("Time to First Token", metrics.ttft_ms),
        ("Time per Output Token (excl. 1st token)", metrics.tpot_ms),
        ("Inter-token Latency", metrics.itl_ms),
        ("End-to-end Latency", metrics.e2e_ms),
    ):
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        short = title.split(" (")[0]
        line(f"Mean {short} (ms):", _ms(distribution, "mean"))
        for name in ("p50", "p90", "p99"):
            line(f"{name.upper()} {short} (ms):", _ms(distribution, name))
    if metrics.errors:
        line("Errors:", ", ".join(f"{kind} x{count}" for kind, count in metrics.errors))
    if metrics.short_outputs:
        line("Outputs shorter than asked:", metrics.short_outputs)
    return "\n".join(lines) + "\n"


def describe_arrivals(result: PointResult) -> dict[str, Any]:
    arrivals = result.arrivals
    if isinstance(arrivals, ScheduledArrivals):
        # A trace's send times are its requests' own `scheduled_s`: not repeated here.
        return {"kind": "scheduled", "name": arrivals.name, "requests": len(arrivals.offsets), "mean_rate_per_s": arrivals.x_value}
    data: dict[str, Any] = {"kind": "poisson" if isinstance(arrivals, PoissonArrivals) else "concurrency"}
    data.update(asdict(arrivals))
    return data


def point_document(result: PointResult, *, include_requests: bool = True) -> dict[str, Any]:
    data: dict[str, Any] = {
        "label": result.arrivals.label,
        "arrivals": describe_arrivals(result),
        "metrics": result.metrics.to_dict(),
        "max_send_lag_s": result.outcome.max_send_lag_s,
    }
    if include_requests:
        data["requests"] = [record.to_dict() for record in result.outcome.records]
    return data


def _finite(value: Any) -> Any:
    """JSON has no inf or NaN: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def results_document(settings: Mapping[str, Any], results: Sequence[PointResult], plots: Sequence[str] = ()) -> dict[str, Any]:
    return _finite({
        "settings": dict(settings),
        "points": [point_document(result) for result in results],
        "plots": list(plots),
    })


def write_json(path: Path, document: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")
    return path


def summary_figures(metrics: BenchMetrics) -> dict[str, Any]:
    """The figures a benchmark envelope carries for one measured point."""
    return _finite({
        "completed": metrics.completed,
        "failed": metrics.failed,
        "request_throughput_rps": round(metrics.request_throughput_rps, 4),
        "output_throughput_tps": round(metrics.output_throughput_tps, 3),
        "ttft_p50_ms": _round(_ms(metrics.ttft_ms, "p50")),
        "ttft_p99_ms": _round(_ms(metrics.ttft_ms, "p99")),
        "tpot_p50_ms": _round(_ms(metrics.tpot_ms, "p50")),
        "tpot_p99_ms": _round(_ms(metrics.tpot_ms, "p99")),
        "itl_p99_ms": _round(_ms(metrics.itl_ms, "p99")),
        "e2e_p99_ms": _round(_ms(metrics.e2e_ms, "p99")),
        "goodput_rps": _round(metrics.goodput_rps),
        "prefix_cache_hit_rate": _round(metrics.prefix_cache_hit_rate),
    })


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def envelope(bench: str, figures: Mapping[str, Any], targets: Mapping[str, TargetValue]) -> str:
    """The very last stdout line of a benchmark."""
    return json.dumps(
        {
            "bench": bench,
            "figures": _finite(dict(figures)),
            "targets": {
                name: {"value": round(t.value, 4), "target": t.target, "met": t.met} for name, t in targets.items()
            },
        },
        sort_keys=True,
        allow_nan=False,
    )
