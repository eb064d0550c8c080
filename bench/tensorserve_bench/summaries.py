"""Summaries of measured values: latencies as mean, percentiles and max, and
medians over repeated runs. The percentiles are the server's own
(``tensorserve.percentiles``: nearest rank), so a p99 of ``tensorserve
bench``, of ``benchmarks/`` and of the server's stats mean the same thing."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from tensorserve.percentiles import percentile


def percentiles_ms(
    seconds: Sequence[float], points: Sequence[int] = (50, 90, 99)
) -> dict[str, float]:
    """Latencies given in seconds, summarised in milliseconds: mean, each
    ``p<point>`` and max (all NaN when there are none)."""
    if not len(seconds):
        return {k: float("nan") for k in ("mean", *(f"p{p}" for p in points), "max")}
    values = sorted(1000.0 * s for s in seconds)
    summary = {"mean": statistics.fmean(values)}
    summary.update({f"p{p}": percentile(values, p) for p in points})
    summary["max"] = values[-1]
    return summary


def medians_by(
    rows: Sequence[Mapping[str, Any]], key: Sequence[str], fields: Sequence[str]
) -> list[dict[str, Any]]:
    """One entry per distinct ``key`` (in first-seen order): the key's values,
    ``repeats`` and the median of each field over the rows that have it (None
    where none has it). The benchmarks' summaries of repeated runs."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in key), []).append(row)
    summary = []
    for values, group in groups.items():
        entry: dict[str, Any] = {**dict(zip(key, values)), "repeats": len(group)}
        for name in fields:
            found = [r[name] for r in group if r.get(name) is not None]
            entry[name] = statistics.median(found) if found else None
        summary.append(entry)
    return summary
