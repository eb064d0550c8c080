"""The one percentile (tensorserve/percentiles.py): nearest rank, used by the
server's stats, its latency target and the bench."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from tensorserve.percentiles import percentile


def test_it_is_the_nearest_rank_an_observed_value() -> None:
    # numpy's interpolation would give 2.5 and 9.91: values no request had.
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0
    assert percentile(range(1, 11), 99) == 10.0
    assert percentile(range(1, 11), 90) == 9.0  # exactly 90% at or below 9
    assert percentile(range(1, 101), 99) == 99.0
    assert percentile([7.0], 1) == percentile([7.0], 100) == 7.0


def test_at_most_q_percent_lie_above_it() -> None:
    rng = random.Random(3)
    for n in (1, 2, 7, 99, 100, 101, 1000, 1001):
        values = [rng.random() for _ in range(n)]
        for q in ("1", "25", "50", "90", "99", "99.9", "100"):
            share = Fraction(q) / 100 * n  # exact: 99.9% of 1000 is 999, not 998.99...
            p = percentile(values, float(q))
            assert p in values
            assert sum(v <= p for v in values) >= share  # at least q% at or below
            assert sum(v < p for v in values) < share  # and it is the smallest such


def test_a_decimal_q_picks_its_exact_rank() -> None:
    # 99.9 * 1000 / 100 is 999.0000000000001 in floats: rank 1000 would be wrong.
    assert percentile(range(1, 1001), 99.9) == 999.0
    assert percentile(range(1, 1001), 0.1) == 1.0


def test_no_values_is_nan_and_a_q_out_of_range_is_refused() -> None:
    assert math.isnan(percentile([], 99))
    for q in (0, -1, 100.5):
        with pytest.raises(ValueError, match="percentile is in"):
            percentile([1.0], q)
