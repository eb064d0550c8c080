"""The ensembles' step metrics, read from each ``EnsembleStats`` at scrape
time (label ``step``: the step's model, or ``model#index`` when one model
runs in several steps of the ensemble).

As for a model's batching metrics (``collector.py``), every stats object
seen for an (ensemble, version) is kept and summed, so a reload never makes
a counter go backwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tensorserve.ensemble import Ensemble
from tensorserve.ensemble.stats import EnsembleStats
from tensorserve.histograms import Buckets

if TYPE_CHECKING:
    from tensorserve.serving.registry import ModelRegistry

LABELS = ["model", "version", "step", "step_model"]
# (StepCounts field, metric name, help)
STEP_COUNTERS = (
    ("calls", "tensorserve_ensemble_step_calls", "Requests that ran the ensemble step."),
    ("items", "tensorserve_ensemble_step_items", "Items the ensemble step returned."),
    (
        "failures",
        "tensorserve_ensemble_step_failures",
        "Requests whose ensemble step failed (its error names the step).",
    ),
)


class EnsembleCollector(Collector):
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self._seen: dict[tuple[str, str], dict[int, EnsembleStats]] = {}

    def collect(self) -> Iterator[Metric]:
        for entry in list(self.registry.entries.values()):
            if isinstance(entry.served, Ensemble):
                stats = entry.served.stats
                self._seen.setdefault((entry.name, str(entry.served.version)), {})[id(stats)] = (
                    stats
                )
        counters = {
            field: CounterMetricFamily(metric, text, labels=LABELS)
            for field, metric, text in STEP_COUNTERS
        }
        seconds = HistogramMetricFamily(
            "tensorserve_ensemble_step_seconds",
            "Per request: an ensemble step's run, its model's queue included (successful steps).",
            labels=LABELS,
        )
        for (model, version), all_stats in sorted(self._seen.items()):
            totals: dict[tuple[str, str], dict[str, int]] = {}
            merged: dict[tuple[str, str], Buckets] = {}
            for stats in all_stats.values():
                for label, step_model, counts, buckets in stats.snapshot()["steps"]:
                    key = (label, step_model)
                    total = totals.setdefault(key, dict.fromkeys(vars(counts), 0))
                    for field, value in vars(counts).items():
                        total[field] += value
                    if key not in merged:
                        merged[key] = buckets
                        continue
                    into = merged[key]
                    into.counts = [a + b for a, b in zip(into.counts, buckets.counts)]
                    into.total += buckets.total
                    into.count += buckets.count
            for key, total in totals.items():
                labels = [model, version, *key]
                for field, family in counters.items():
                    family.add_metric(labels, total[field])
                seconds.add_metric(labels, merged[key].cumulative(), merged[key].total)
        yield from counters.values()
        yield seconds
