"""The benchmarks' one percentile: numpy's default, linear interpolation
between the two nearest ranks (``statistics.quantiles(..., method="inclusive")``
gives the same). Every latency table of ``tensorserve bench`` and of
``benchmarks/`` is computed with it, so their p99s mean the same thing."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``; NaN when there are none."""
    array = np.fromiter(values, dtype=np.float64)
    return float(np.percentile(array, q)) if array.size else float("nan")


def percentiles_ms(
    seconds: Sequence[float], points: Sequence[int] = (50, 90, 99)
) -> dict[str, float]:
    """Latencies given in seconds, summarised in milliseconds: mean, each
    ``p<point>`` and max (all NaN when there are none)."""
    if not len(seconds):
        return {k: float("nan") for k in ("mean", *(f"p{p}" for p in points), "max")}
    values = np.asarray(seconds, dtype=np.float64) * 1000.0
    summary = {"mean": float(values.mean())}
    summary.update(
        {f"p{p}": float(v) for p, v in zip(points, np.percentile(values, list(points)))}
    )
    summary["max"] = float(values.max())
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
