"""Trace replay: requests and send times from a CSV or JSONL of (arrival time, prompt tokens, output tokens).

The format is the public Azure LLM inference traces' (AzureLLMInferenceTrace_{code,conv}.csv):

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,4808,10

TIMESTAMP is a date-time (fractional seconds of any precision) or a number of seconds; send times are
relative to the first row, optionally scaled (`time_scale` 0.5 replays twice as fast). JSONL rows
carry the same three fields under those names or under `timestamp`, `prompt_tokens`,
`output_tokens`. Prompts are drawn (seeded) token ids of the given lengths, as the fixed workload's;
rows are replayed in time order. tests/data/azure_trace_sample.csv is a small synthetic trace in
this format (no download).
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cluster.loadgen.arrivals import ScheduledArrivals
from cluster.loadgen.workloads import BenchRequest, WorkloadError

TIME_FIELDS = ("TIMESTAMP", "timestamp", "arrival_time_s")
PROMPT_FIELDS = ("ContextTokens", "prompt_tokens", "context_tokens")
OUTPUT_FIELDS = ("GeneratedTokens", "output_tokens", "generated_tokens")


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # seconds, on the trace's own axis
    prompt_tokens: int
    output_tokens: int


def _field(row: Mapping[str, Any], names: tuple[str, ...], line: int) -> Any:
    for name in names:
        if name in row and row[name] not in (None, ""):
            return row[name]
    raise WorkloadError("trace", f"row {line}: no {' / '.join(names)}")


def _seconds(value: Any, line: int) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    # Azure writes 7 fractional digits; datetime takes at most 6.
    head, _, fraction = text.partition(".")
    try:
        stamp = datetime.fromisoformat(head)
    except ValueError:
        raise WorkloadError("trace", f"row {line}: {text!r} is neither seconds nor a date-time") from None
    return stamp.timestamp() + (float(f"0.{fraction}") if fraction.isdigit() else 0.0)


def _count(value: Any, name: str, line: int) -> int:
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise WorkloadError("trace", f"row {line}: {name} {value!r} is not an integer") from None
    if count < 0:
        raise WorkloadError("trace", f"row {line}: {name} {count} is negative")
    return count


def parse_rows(rows: Iterable[Mapping[str, Any]]) -> list[TraceRow]:
    parsed = []
    for line, row in enumerate(rows, start=1):
        parsed.append(
            TraceRow(
                _seconds(_field(row, TIME_FIELDS, line), line),
                _count(_field(row, PROMPT_FIELDS, line), "prompt tokens", line),
                _count(_field(row, OUTPUT_FIELDS, line), "output tokens", line),
            )
        )
    return parsed


def read_trace(path: str | Path) -> list[TraceRow]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise WorkloadError("trace", f"{path}: {error}") from None
    if path.suffix in (".jsonl", ".ndjson"):
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise WorkloadError("trace", f"{path}:{number}: {error}") from None
        return parse_rows(rows)
    return parse_rows(csv.DictReader(text.splitlines()))


def trace_workload(
    rows: list[TraceRow],
    *,
    seed: int = 0,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    max_prompt_tokens: int | None = None,
    token_range: tuple[int, int] = (32, 127),
) -> tuple[tuple[BenchRequest, ...], ScheduledArrivals]:
    """The trace's requests (prompts drawn, seeded) and their send times, from the first row's."""
    if not rows:
        raise WorkloadError("trace", "the trace has no rows")
    if not time_scale > 0:
        raise WorkloadError("time_scale", f"must be > 0, got {time_scale!r}")
    ordered = sorted(rows, key=lambda r: r.arrival_s)[:max_requests]
    start_s = ordered[0].arrival_s
    rng = random.Random(seed)
    low, high = token_range
    span = high - low
    requests = []
    offsets = []
    for index, row in enumerate(ordered):
        length = max(1, row.prompt_tokens if max_prompt_tokens is None else min(row.prompt_tokens, max_prompt_tokens))
        prompt = tuple(low + byte % span for byte in rng.randbytes(length))
        requests.append(BenchRequest(index, prompt, max(1, row.output_tokens)))
        offsets.append((row.arrival_s - start_s) * time_scale)
    return tuple(requests), ScheduledArrivals(tuple(offsets))
