"""When requests are sent: a Poisson process at a rate (gamma intervals with a burstiness factor,
as vLLM's `--burstiness`), or a fixed number of requests in flight.

Poisson: intervals are Gamma(shape=burstiness, scale=1 / (rate * burstiness)): the mean interval is
1 / rate whatever the burstiness, the coefficient of variation is 1 / sqrt(burstiness). burstiness
1 is a Poisson process; below 1 burstier, above 1 more even. A rate of infinity sends everything at
once. The first request goes at offset 0.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


class ArrivalError(ValueError):
    """An arrival setting that makes no schedule; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class PoissonArrivals:
    rate_per_s: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        rate = self.rate_per_s
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or math.isnan(rate) or rate <= 0:
            raise ArrivalError("rate_per_s", f"must be a positive number or inf, got {rate!r}")
        burstiness = self.burstiness
        if isinstance(burstiness, bool) or not isinstance(burstiness, (int, float)) or not math.isfinite(burstiness) or burstiness <= 0:
            raise ArrivalError("burstiness", f"must be a positive number, got {burstiness!r}")

    @property
    def label(self) -> str:
        return f"rate={self.rate_per_s:g}/s"

    @property
    def x_value(self) -> float:
        """The sweep axis value (requests per second)."""
        return float(self.rate_per_s)

    def offsets_s(self, count: int, seed: int) -> tuple[float, ...]:
        """Send times of `count` requests, seconds after the start; the same for the same seed."""
        if count < 0:
            raise ArrivalError("count", f"must be >= 0, got {count}")
        if math.isinf(self.rate_per_s):
            return (0.0,) * count
        rng = random.Random(seed)
        scale = 1.0 / (self.rate_per_s * self.burstiness)
        offsets = []
        now_s = 0.0
        for _ in range(count):
            offsets.append(now_s)
            now_s += rng.gammavariate(self.burstiness, scale)
        return tuple(offsets)


@dataclass(frozen=True)
class FixedConcurrency:
    """Keep `concurrency` requests in flight: each finished request releases its slot to the next."""

    concurrency: int

    def __post_init__(self) -> None:
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ArrivalError("concurrency", f"must be a positive integer, got {self.concurrency!r}")

    @property
    def label(self) -> str:
        return f"concurrency={self.concurrency}"

    @property
    def x_value(self) -> float:
        return float(self.concurrency)


@dataclass(frozen=True)
class ScheduledArrivals:
    """Send times given in advance (a replayed trace, cluster/loadgen/trace.py): request i at
    `offsets_s[i]` seconds after the start, whatever the seed."""

    offsets: tuple[float, ...]
    name: str = "trace"

    def __post_init__(self) -> None:
        previous = 0.0
        for offset in self.offsets:
            if not math.isfinite(offset) or offset < previous:
                raise ArrivalError("offsets", f"must be finite, >= 0 and non-decreasing, got {offset!r} after {previous!r}")
            previous = offset

    @property
    def label(self) -> str:
        return self.name

    @property
    def x_value(self) -> float:
        """The trace's mean request rate per second."""
        span_s = self.offsets[-1] if self.offsets else 0.0
        return len(self.offsets) / span_s if span_s > 0 else math.inf

    def offsets_s(self, count: int, seed: int) -> tuple[float, ...]:
        if count != len(self.offsets):
            raise ArrivalError("count", f"the schedule has {len(self.offsets)} send times, not {count}")
        return self.offsets


Arrivals = PoissonArrivals | FixedConcurrency | ScheduledArrivals
