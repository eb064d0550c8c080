"""The bench's printed line and plots: the per-point line says the padding
efficiency under that name (not the model's time per batch); plots have a
log load axis, p50/p90/p99, a padding-efficiency panel, and titles with the
model, date and machine."""

from __future__ import annotations

from typing import Any

import pytest
from tensorserve_bench.loadgen import PointResult
from tensorserve_bench.plots import (
    latency_figure,
    matplotlib_available,
    padding_figure,
    run_context,
    throughput_figure,
)
from tensorserve_bench.report import format_point
from tensorserve_bench.sweep import BenchResult


def point(concurrency: int, efficiency: float | None, model_ms: float) -> PointResult:
    return PointResult(
        mode="closed", concurrency=concurrency, rate=None, variant="fifo", duration_s=1.0,
        elapsed_s=1.0, requests=100, items=100, errors=0, dropped=0, items_per_s=100.0,
        requests_per_s=100.0,
        latency_ms={"mean": 2.0, "p50": 1.5, "p90": 2.5, "p99": 3.5, "max": 4.0},
        batches=40, avg_batch_size=2.5, padding_efficiency=efficiency,
        padding_efficiency_exact=True, batch_size_histogram={"2": 20, "4": 20},
        avg_batch_ms=model_ms,
    )


def test_the_point_line_prints_padding_efficiency_under_its_name() -> None:
    line = format_point(point(8, 0.741, 3.23))
    assert line.endswith("model 3.23 ms, padding efficiency 0.741")
    assert "padding efficiency 3.23" not in line
    assert format_point(point(8, None, 2.30)).endswith("padding efficiency -")


pytestmark = pytest.mark.skipif(not matplotlib_available(), reason="matplotlib not installed")

POINTS = [point(c, e, 1.0) for c, e in ((1, 1.0), (8, 0.8), (32, 0.9), (64, None))]


def test_the_load_axis_is_logarithmic_and_ticked_at_the_levels() -> None:
    for make in (throughput_figure, latency_figure, padding_figure):
        (ax,) = make(POINTS).axes
        assert ax.get_xscale() == "log"
        assert list(ax.get_xticks()) == [1, 8, 32, 64]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "8", "32", "64"]


def test_latency_has_p50_p90_p99_and_padding_its_own_panel() -> None:
    (ax,) = latency_figure(POINTS).axes
    assert [line.get_label() for line in ax.get_lines()] == ["fifo p50", "fifo p90", "fifo p99"]
    assert list(ax.get_lines()[1].get_ydata()) == [2.5] * 4
    (ax,) = padding_figure(POINTS).axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1, 8, 32] and list(line.get_ydata()) == [1.0, 0.8, 0.9]
    assert ax.get_ylim() == (0, 1.05)


def test_titles_say_model_date_and_machine() -> None:
    result = BenchResult(
        settings={}, targets=[{"variant": "fifo", "kind": "http", "model": "tagger"}],
        lengths={}, points=POINTS, created="2026-11-23T16:40:02+00:00",
        machine={"platform": "Linux-6.1.0-x86_64-with-glibc2.36", "processor": "x86_64",
                 "cpu_count": 2, "python": "3.11.7", "torch": "2.13.0"},
    )
    context = run_context(result)
    assert context == "tagger · 2026-11-23 16:40 UTC · Linux x86_64, 2 CPUs, torch 2.13.0"
    fig: Any = throughput_figure(POINTS, "policies", context)
    assert fig.axes[0].get_title() == f"Throughput: policies\n{context}"
