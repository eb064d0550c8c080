"""The one percentile of the project: the server's batching stats, its
latency target's p99 and every table of ``tensorserve bench`` and
``benchmarks/`` compute theirs here, so a p99 means the same thing in all.

The definition is the **nearest rank**: the smallest observed value with at
least q% of the values at or below it (the ``ceil(q/100 * n)``-th smallest).
Chosen over interpolation (numpy's default) because

- it is a latency some request really had, never a value between two
  requests that no caller saw: "p99 = 95.6 ms" means a request took 95.6 ms;
- it says what a latency target promises: at most 1% of requests above it;
- it is what Triton's perf_analyzer reports (an element of the sorted
  latencies), so tables compare with Triton's without a footnote;
- it needs no numpy and no interpolation rule, so the bottom layer of the
  server can own it and the bench (which imports the server) use the same.

On few values the two definitions differ visibly (p99 of 10 values is the
largest here, a point 9/10 of the way from the 9th to the 10th with numpy);
on the thousands of samples of a benchmark by less than the spacing of two
neighbouring latencies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``, in
    any order; NaN when there are none (a caller that must show a number for
    "no samples" decides which)."""
    if not 0 < q <= 100:
        raise ValueError(f"a percentile is in (0, 100], not {q!r}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    # Exact arithmetic on the decimal q as written: 99.9 * 1000 / 100 in floats
    # is 999.0000000000001, whose ceiling would be the wrong rank.
    rank = math.ceil(Fraction(repr(float(q))) * len(ordered) / 100)
    return float(ordered[max(rank, 1) - 1])
