"""Arrival processes: Poisson/gamma send times with burstiness, fixed concurrency."""

from __future__ import annotations

import math
import statistics

import pytest

from cluster.loadgen.arrivals import ArrivalError, FixedConcurrency, PoissonArrivals


def _intervals(offsets):
    return [b - a for a, b in zip(offsets, offsets[1:], strict=False)]


def test_poisson_starts_at_zero_and_is_seeded() -> None:
    arrivals = PoissonArrivals(5.0)
    offsets = arrivals.offsets_s(50, seed=1)
    assert offsets[0] == 0.0 and len(offsets) == 50
    assert all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    assert arrivals.offsets_s(50, seed=1) == offsets
    assert arrivals.offsets_s(50, seed=2) != offsets


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_intervals_keep_the_rate_and_set_the_spread(burstiness) -> None:
    rate = 8.0
    gaps = _intervals(PoissonArrivals(rate, burstiness).offsets_s(40001, seed=7))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    # Gamma(shape=b): coefficient of variation 1/sqrt(b); b=1 is exponential (Poisson).
    assert statistics.pstdev(gaps) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert PoissonArrivals(math.inf).offsets_s(4, seed=0) == (0.0, 0.0, 0.0, 0.0)
    assert PoissonArrivals(math.inf).label == "rate=inf/s"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rate_per_s": 0.0}, "rate_per_s"),
        ({"rate_per_s": -1.0}, "rate_per_s"),
        ({"rate_per_s": float("nan")}, "rate_per_s"),
        ({"rate_per_s": 1.0, "burstiness": 0.0}, "burstiness"),
        ({"rate_per_s": 1.0, "burstiness": math.inf}, "burstiness"),
    ],
)
def test_bad_poisson_settings(kwargs, field) -> None:
    with pytest.raises(ArrivalError) as info:
        PoissonArrivals(**kwargs)
    assert info.value.field == field


def test_fixed_concurrency() -> None:
    assert FixedConcurrency(3).label == "concurrency=3" and FixedConcurrency(3).x_value == 3.0
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ArrivalError):
            FixedConcurrency(bad)
