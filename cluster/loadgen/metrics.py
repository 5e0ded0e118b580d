"""What one request's measurement is, and what vLLM's `bench serve` definitions make of many.

Per request (all times on the client's clock, from when the request was sent):
- TTFT: to the first token;
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests with more than one output token;
- ITL: the gaps between successive token arrivals (a message carrying several tokens is one
  arrival, as vLLM counts stream chunks);
- e2e latency: to the end of the stream.
Over a run: p50/p90/p99 (linear interpolation, numpy's default), request and token throughput over
the run's duration, goodput = requests per second that meet every SLO given (a request with one
output token has TPOT 0 for this purpose, as in vLLM), and the prefix-cache hit rate =
cached prompt tokens / prompt tokens.

The chaos soak (cluster/loadgen/chaos.py) records its requests in the same RequestRecord, with the
fields it checks besides timings (admitted, lost, output tokens, the router's timeline), and takes
its percentiles from here too (nearest rank: `PercentileMethod.NEAREST_RANK`).
"""

from __future__ import annotations

import enum
import math
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - only annotations; the records are built by the runners
    from cluster.client import InstanceWork, StateChange


class SloError(ValueError):
    """An SLO that is not a positive number of milliseconds; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class RequestRecord:
    """One request as the load runner or the chaos soak saw it. Times are seconds since the run
    started. The soak does not time tokens (no chunk times: no TTFT, TPOT or ITL)."""

    index: int
    sent_s: float
    end_s: float
    chunk_times_s: tuple[float, ...] = ()  # arrival of each message that carried tokens
    chunk_tokens: tuple[int, ...] = ()  # tokens in each of those messages
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    expected_output_tokens: int = 0
    scheduled_s: float | None = None  # the arrival process's send time (None: fixed concurrency)
    conversation: int | None = None
    turn: int = 0
    finish_reason: str | None = None
    instances: tuple[InstanceWork, ...] = ()  # the instances that worked on it, in order
    error: str | None = None  # None: completed; else "<gRPC status code name or SKIPPED>: <message>"
    # What the chaos soak checks besides timings (the load runner leaves these defaults; results.json
    # does not carry them).
    accepted: bool | None = None  # the router admitted it; None: not asked
    lost: bool = False  # admitted, but no final event came within the soak's bound
    token_ids: tuple[int, ...] = ()  # the output tokens, compared with a replay
    timeline: tuple[StateChange, ...] = ()  # the router's state timeline (recoveries are read from it)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def status(self) -> str:
        """"OK", or the kind of error: a gRPC status code name (or SKIPPED)."""
        if self.error is None:
            return "OK"
        return self.error.split(":", 1)[0].strip() or "error"

    @property
    def message(self) -> str:
        """The error's message ("" for a completed request)."""
        return "" if self.error is None else self.error.partition(": ")[2]

    @property
    def instance_names(self) -> tuple[str, ...]:
        """"phase@instance" per instance, in order."""
        return tuple(f"{work.phase}@{work.instance_id}" for work in self.instances)

    def to_dict(self) -> dict[str, Any]:
        """The request as results.json writes it: the timings and counts, instances by name."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _SOAK_FIELDS}
        data["instances"] = self.instance_names
        return data

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.sent_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """None for fewer than two output tokens (vLLM leaves those out of the TPOT distribution)."""
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> tuple[float, ...]:
        times = self.chunk_times_s
        return tuple(map(operator.sub, times[1:], times))  # later - earlier, without a frame per gap


_SOAK_FIELDS = frozenset({"accepted", "lost", "token_ids", "timeline"})


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None: not part of goodput."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise SloError(name, f"must be a positive number of milliseconds, got {value!r}")

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        ttft = record.ttft_s
        if self.ttft_ms is not None and (ttft is None or ttft * 1000.0 > self.ttft_ms):
            return False
        tpot = record.tpot_s if record.tpot_s is not None else 0.0
        if self.tpot_ms is not None and tpot * 1000.0 > self.tpot_ms:
            return False
        return self.e2e_ms is None or record.e2e_s * 1000.0 <= self.e2e_ms


class PercentileMethod(enum.Enum):
    LINEAR = "linear"  # interpolate between the closest ranks (numpy's default; vLLM's figures)
    NEAREST_RANK = "nearest_rank"  # the smallest value with at least q % of the values at or below it


def percentile(values: Sequence[float], q: float, method: PercentileMethod = PercentileMethod.LINEAR) -> float:
    """The q-th percentile (0..100) of `values`, by `method`."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    return _percentile_of_sorted(sorted(values), q, method)


def _percentile_of_sorted(ordered: Sequence[float], q: float, method: PercentileMethod = PercentileMethod.LINEAR) -> float:
    if method is PercentileMethod.NEAREST_RANK:
        return ordered[max(1, math.ceil(q / 100.0 * len(ordered))) - 1]
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency, in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Distribution | None:
        if not values_s:
            return None
        values_ms = [v * 1000.0 for v in values_s]
        ordered = sorted(values_ms)  # once for every percentile (a run's ITLs number millions at scale)
        return cls(
            count=len(values_ms),
            mean=sum(values_ms) / len(values_ms),
            p50=_percentile_of_sorted(ordered, 50),
            p90=_percentile_of_sorted(ordered, 90),
            p99=_percentile_of_sorted(ordered, 99),
            min=ordered[0],
            max=ordered[-1],
        )


@dataclass(frozen=True)
class BenchMetrics:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    request_throughput_rps: float
    output_throughput_tps: float
    total_throughput_tps: float
    prefix_cache_hit_rate: float | None  # None when no prompt token was counted
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None
    slo: Slo
    good_requests: int | None  # None without an SLO
    goodput_rps: float | None
    # Output tokens that differ from what the workload asked (an early stop, or a server that
    # ignored ignore_eos): the lengths the metrics rest on are not the workload's.
    short_outputs: int = 0
    errors: tuple[tuple[str, int], ...] = ()  # (kind, count), e.g. ("DEADLINE_EXCEEDED", 2)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["errors"] = dict(self.errors)
        return data


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo()) -> BenchMetrics:
    if not duration_s > 0:
        raise ValueError(f"duration_s must be positive, got {duration_s!r}")
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    good = sum(1 for r in done if slo.met_by(r)) if slo.any else None
    ttfts = [t for t in (r.ttft_s for r in done) if t is not None]
    tpots = [t for t in (r.tpot_s for r in done) if t is not None]
    itls: list[float] = []
    for r in done:  # millions of gaps at scale: extended, not a generator's frame per gap
        itls.extend(r.itls_s)
    return BenchMetrics(
        num_requests=len(records),
        completed=len(done),
        failed=len(failed),
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_tokens=cached_tokens,
        request_throughput_rps=len(done) / duration_s,
        output_throughput_tps=output_tokens / duration_s,
        total_throughput_tps=(input_tokens + output_tokens) / duration_s,
        prefix_cache_hit_rate=cached_tokens / input_tokens if input_tokens else None,
        ttft_ms=Distribution.of_seconds(ttfts),
        tpot_ms=Distribution.of_seconds(tpots),
        itl_ms=Distribution.of_seconds(itls),
        e2e_ms=Distribution.of_seconds([r.e2e_s for r in done]),
        slo=slo,
        good_requests=good,
        goodput_rps=good / duration_s if good is not None else None,
        short_outputs=sum(1 for r in done if r.expected_output_tokens and r.output_tokens != r.expected_output_tokens),
        errors=tuple(sorted(Counter(r.status for r in failed).items())),
    )
