"""Histograms as Prometheus keeps them: counts per upper bound, a sum and a
count, one ``bisect`` and two additions per observation. A model's batching
stats, an ensemble's step timings and the metrics that merge them at scrape
time all keep theirs in ``Buckets``, so it sits below every one of them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# Upper bounds (seconds) of the duration histograms: queue wait, pad, compute,
# un-pad, an ensemble's steps.
SECONDS_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class Buckets:
    """A histogram: counts per upper bound (the last, unbounded bucket is
    ``+Inf``), a sum and a count. Not thread-safe on its own: its owner holds
    its lock around ``observe``."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # + the +Inf bucket
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def observe_many(self, values: Sequence[float]) -> None:
        """``observe`` each of ``values`` (a batch's items: one call, not one each)."""
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1
        self.total += sum(values)
        self.count += len(values)

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(upper bound, cumulative count), ..., ("+Inf", count)]``."""
        out, running = [], 0
        for bound, count in zip((*map(str, map(float, self.bounds)), "+Inf"), self.counts):
            running += count
            out.append((bound, running))
        return out

    def copy(self) -> Buckets:
        other = Buckets(self.bounds)
        other.counts, other.total, other.count = list(self.counts), self.total, self.count
        return other
