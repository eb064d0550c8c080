"""The printed table of a benchmark result (pure text, no I/O)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tensorserve_bench.loadgen import PointResult

COLUMNS = (
    ("variant", "<"),
    ("load", ">"),
    ("items/s", ">"),
    ("p50 ms", ">"),
    ("p90 ms", ">"),
    ("p99 ms", ">"),
    ("errors", ">"),
    ("batch", ">"),
    ("model ms", ">"),
    ("pad eff", ">"),
)


def _number(value: float | None, digits: int) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def point_row(point: PointResult) -> list[str]:
    load = f"c={point.concurrency}" if point.mode == "closed" else f"{point.rate:g}/s"
    efficiency = _number(point.padding_efficiency, 3)
    if point.padding_efficiency is not None and not point.padding_efficiency_exact:
        efficiency = "~" + efficiency  # the server's cumulative ratio, not this window's
    errors = str(point.errors) + (f"+{point.refused}r" if point.refused else "")
    errors += f"+{point.dropped}d" if point.dropped else ""
    return [
        point.variant,
        load,
        _number(point.items_per_s, 1),
        _number(point.latency_ms["p50"], 2),
        _number(point.latency_ms["p90"], 2),
        _number(point.latency_ms["p99"], 2),
        errors,
        _number(point.avg_batch_size, 2),
        _number(point.avg_batch_ms, 2),
        efficiency,
    ]


def format_table(points: Sequence[PointResult]) -> str:
    """A fixed-width table, one row per point."""
    rows = [[name for name, _ in COLUMNS]] + [point_row(p) for p in points]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for index, row in enumerate(rows):
        cells = [f"{cell:{align}{width}}" for cell, (_, align), width in zip(row, COLUMNS, widths)]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_point(point: PointResult) -> str:
    """One line, for logs while a sweep runs."""
    row = point_row(point)
    return (
        f"{row[0]} {row[1]}: {row[2]} items/s, p50 {row[3]} ms, p99 {row[5]} ms, "
        f"errors {row[6]}, batch {row[7]}, model {row[8]} ms, padding efficiency {row[9]}"
    )
