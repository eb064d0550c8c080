from __future__ import annotations

import pytest

from tensorserve.bench.targets import BatchingDelta, Counters, counters_from_snapshot


def test_delta_uses_raw_element_counts_when_present() -> None:
    before = Counters(10, 40, 0, 1000, 2000, 0.5, {"4": 10})
    after = Counters(15, 100, 0, 1900, 3000, 0.63, {"4": 12, "16": 3})
    delta = BatchingDelta.between(before, after)
    assert (delta.batches, delta.items, delta.avg_batch_size) == (5, 60, 12.0)
    assert delta.padding_efficiency == pytest.approx(0.9) and delta.padding_efficiency_exact
    assert delta.histogram == {"4": 2, "16": 3}


def test_delta_without_raw_counts_is_exact_only_from_a_fresh_start() -> None:
    fresh = BatchingDelta.between(Counters(), Counters(4, 8, padding_efficiency=0.8))
    assert fresh.padding_efficiency == 0.8 and fresh.padding_efficiency_exact
    later = BatchingDelta.between(
        Counters(4, 8, padding_efficiency=0.8), Counters(6, 12, padding_efficiency=0.7)
    )
    assert later.padding_efficiency == 0.7 and not later.padding_efficiency_exact


def test_counters_from_a_stats_snapshot() -> None:
    snapshot = {
        "total_batches": 4,
        "avg_batch_size": 2.5,
        "padding_efficiency": 0.75,
        "failed_items": 1,
        "batch_size_histogram": {"2": 2, "4": 2},
    }
    counters = counters_from_snapshot(snapshot)
    assert counters.batch_items == 10 and counters.real_elements is None
    assert counters.histogram == {"2": 2, "4": 2}
    exact = counters_from_snapshot({**snapshot, "real_elements": 3, "padded_elements": 4})
    assert (exact.real_elements, exact.padded_elements) == (3, 4)


def test_model_time_per_batch_comes_from_the_summed_seconds_between_two_reads() -> None:
    before = counters_from_snapshot({"total_batches": 10, "batch_items": 20, "batch_seconds": 0.5})
    after = counters_from_snapshot({"total_batches": 14, "batch_items": 30, "batch_seconds": 0.58})
    assert BatchingDelta.between(before, after).avg_batch_ms == pytest.approx(20.0)
    # A server that does not report it (or a window with no batches): unknown.
    assert BatchingDelta.between(Counters(), Counters(3, 3)).avg_batch_ms is None
    assert BatchingDelta.between(after, after).avg_batch_ms is None
