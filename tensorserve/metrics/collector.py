"""The batching metrics, read from each model's ``BatchStats`` at scrape time.

The batcher's hot path never calls into the metrics library: it adds to plain
counters and bucket counts (``batching/stats.py``), and this collector turns
them into Prometheus families when ``/metrics`` is scraped.

A reload builds a new ``ServedModel`` with fresh stats. So that no counter
ever goes backwards, the collector keeps every ``BatchStats`` it has seen for
a (model, version) and exports their sum; a model unloaded keeps its last
totals. (An instance loaded and replaced between two scrapes is never seen:
reloading twice within one scrape interval loses the middle one's counts.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tensorserve.batching.stats import BatchStats
from tensorserve.ensemble import Ensemble
from tensorserve.histograms import Buckets

if TYPE_CHECKING:
    from tensorserve.serving.liveness import Liveness
    from tensorserve.serving.registry import ModelRegistry

MODEL_STATES = ("LOADING", "READY", "FAILED", "UNLOADING", "UNAVAILABLE")

# (stats field, metric name, help): cumulative counters per model and version.
COUNTERS = (
    (
        "total_requests",
        "tensorserve_admitted_requests",
        "Inference requests admitted to the queue.",
    ),
    ("total_items", "tensorserve_admitted_items", "Items admitted to the queue."),
    ("total_batches", "tensorserve_batches", "Batches executed."),
    (
        "batch_items",
        "tensorserve_batch_items",
        "Items that reached the model (sum of batch sizes).",
    ),
    (
        "failed_items",
        "tensorserve_model_failed_items",
        "Items whose batch (or row) failed in the model.",
    ),
    ("real_elements", "tensorserve_real_elements", "Elements of real data in executed batches."),
    (
        "padded_elements",
        "tensorserve_padded_elements",
        "Elements in executed batches, padding included.",
    ),
)
# (stats histogram, metric name, help)
HISTOGRAMS = (
    ("batch_size", "tensorserve_batch_size", "Items per executed batch."),
    (
        "padded_length",
        "tensorserve_batch_padded_length",
        "Longest item's variable extent in a batch: the length it is padded to.",
    ),
    (
        "queue_wait_seconds",
        "tensorserve_queue_wait_seconds",
        "Per item: from admission to leaving the queue in a batch.",
    ),
    ("pad_seconds", "tensorserve_batch_pad_seconds", "Per batch: assembling (padding) the batch."),
    ("compute_seconds", "tensorserve_batch_compute_seconds", "Per batch: the model's run."),
    (
        "unpad_seconds",
        "tensorserve_batch_unpad_seconds",
        "Per batch: un-padding outputs into rows.",
    ),
)


@dataclass
class _Seen:
    """Every stats object of one (model, version), and the last worker
    restart count read from each one's executor."""

    stats: dict[int, BatchStats] = field(default_factory=dict)
    restarts: dict[int, int] = field(default_factory=dict)


def _sum_counters(stats: list[BatchStats]) -> dict[str, float]:
    totals = dict.fromkeys((name for name, _, _ in COUNTERS), 0.0)
    for one in stats:
        with one._lock:
            for name in totals:
                totals[name] += getattr(one, name)
    return totals


def _sum_recoveries(stats: list[BatchStats]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for one in stats:
        with one._lock:
            for kind, count in getattr(one, "recoveries", {}).items():
                totals[kind] = totals.get(kind, 0) + count
    return totals


def _sum_histograms(stats: list[BatchStats]) -> dict[str, Buckets]:
    merged: dict[str, Buckets] = {}
    for one in stats:
        for name, buckets in one.histogram_snapshot().items():
            if name not in merged:
                merged[name] = buckets
                continue
            into = merged[name]
            into.counts = [a + b for a, b in zip(into.counts, buckets.counts)]
            into.total += buckets.total
            into.count += buckets.count
    return merged


class BatchingCollector(Collector):
    def __init__(self, registry: ModelRegistry, liveness: Liveness | None = None) -> None:
        self.registry = registry
        self.liveness = liveness
        self._seen: dict[tuple[str, str], _Seen] = {}

    def _observe_current(self) -> dict[tuple[str, str], Any]:
        """Remember the served instances of now; returns (name, version) -> served."""
        current = {}
        for entry in list(self.registry.entries.values()):
            served = entry.served
            if served is None or isinstance(served, Ensemble):  # its steps' models batch
                continue
            key = (entry.name, str(served.version))
            seen = self._seen.setdefault(key, _Seen())
            seen.stats[id(served.stats)] = served.stats
            seen.restarts[id(served.stats)] = served.executor.restarts
            current[key] = served
        return current

    def per_model(self) -> Iterator[tuple[tuple[str, str], list[BatchStats], int]]:
        """(model, version), every stats object it has had, its queue depth
        now: what a scrape reads, for the Triton-named metrics (triton.py) too."""
        current = self._observe_current()
        for key, seen in sorted(self._seen.items()):
            served = current.get(key)
            yield key, list(seen.stats.values()), served.batcher.queue_depth if served else 0

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        current = self._observe_current()
        counters = {
            name: CounterMetricFamily(metric, text, labels=labels)
            for name, metric, text in COUNTERS
        }
        recoveries = CounterMetricFamily(
            "tensorserve_batch_recoveries",
            "Failed batches answered by splitting or re-running them, by kind (split: a "
            "poison, a crash or the watchdog; rows: RowErrors; rerun: a worker died before "
            "running it; oom: out of memory).",
            labels=[*labels, "kind"],
        )
        restarts = CounterMetricFamily(
            "tensorserve_worker_restarts",
            "Worker processes started again after one died.",
            labels=labels,
        )
        histograms = {
            name: HistogramMetricFamily(metric, text, labels=labels)
            for name, metric, text in HISTOGRAMS
        }
        depth = GaugeMetricFamily(
            "tensorserve_queue_depth", "Items waiting to be batched.", labels=labels
        )
        for key, seen in sorted(self._seen.items()):
            stats = list(seen.stats.values())
            totals = _sum_counters(stats)
            for name, family in counters.items():
                family.add_metric(key, totals[name])
            restarts.add_metric(key, sum(seen.restarts.values()))
            for kind, count in sorted(_sum_recoveries(stats).items()):
                recoveries.add_metric([*key, kind], count)
            for name, buckets in _sum_histograms(stats).items():
                histograms[name].add_metric(key, buckets.cumulative(), buckets.total)
            served = current.get(key)
            depth.add_metric(key, served.batcher.queue_depth if served is not None else 0)
        yield from counters.values()
        yield restarts
        yield recoveries
        yield from histograms.values()
        yield depth
        yield from _target_families(current)
        yield from self._model_families()

    def _model_families(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily(
            "tensorserve_model_ready", "1 if the model is ready.", labels=["model"]
        )
        state = GaugeMetricFamily(
            "tensorserve_model_state",
            "1 for the model's current state, 0 for the others.",
            labels=["model", "state"],
        )
        load = GaugeMetricFamily(
            "tensorserve_model_load_seconds",
            "How long the model's last load took (import, weights, warm-up).",
            labels=["model"],
        )
        device = GaugeMetricFamily(
            "tensorserve_model_device_info",
            "1 for each device a served model's instances run on (what device = auto became).",
            labels=["model", "device"],
        )
        for entry in sorted(self.registry.entries.values(), key=lambda e: e.name):
            if entry.served is not None:
                for name in entry.served.devices:
                    device.add_metric([entry.name, name], 1.0)
            ready.add_metric([entry.name], 1.0 if entry.state.value == "READY" else 0.0)
            for name in MODEL_STATES:
                state.add_metric([entry.name, name], 1.0 if entry.state.value == name else 0.0)
            seconds = getattr(entry, "load_seconds", None)
            if seconds is not None:
                load.add_metric([entry.name], seconds)
        yield from (ready, state, load, device)
        wedged = GaugeMetricFamily(
            "tensorserve_instance_wedged_seconds",
            "How long a model instance has been stuck in a forward the watchdog could not "
            "stop, for each one that makes /v2/health/live fail (--liveness-stall-s).",
            labels=["model", "version", "instance"],
        )
        for w in self.liveness.wedged() if self.liveness is not None else []:
            wedged.add_metric([w.model, w.version, str(w.instance)], w.stalled_s)
        yield wedged
        lost = GaugeMetricFamily(
            "tensorserve_cuda_context_lost",
            "1 once a sticky CUDA error lost this server process's CUDA context (readiness "
            "and /v2/health/live fail until it restarts), else 0.",
        )
        lost.add_metric(
            [], 1.0 if self.liveness is not None and self.liveness.context_lost() else 0.0
        )
        yield lost


# (report key, metric name, help, scale): a latency target's controller
# (batching/target.py), for the models that have a target.
TARGET_GAUGES = (
    (
        "target_p99_ms",
        "tensorserve_latency_target_seconds",
        "The model's p99 latency target.",
        1e-3,
    ),
    (
        "achieved_p99_ms",
        "tensorserve_latency_achieved_p99_seconds",
        "p99 latency (admission to batch end) of the model's last 1000 served items.",
        1e-3,
    ),
    (
        "batch_cap",
        "tensorserve_latency_target_batch_cap",
        "Most items per batch the latency target's controller allows now.",
        1.0,
    ),
    (
        "queue_delay_ms",
        "tensorserve_latency_target_queue_delay_seconds",
        "Longest queue delay the latency target's controller allows.",
        1e-3,
    ),
    (
        "safety",
        "tensorserve_latency_target_safety",
        "The controller's correction of its predicted wait (1: as predicted).",
        1.0,
    ),
)


def _target_families(current: dict[tuple[str, str], Any]) -> Iterator[Metric]:
    families = {
        key: GaugeMetricFamily(metric, text, labels=["model", "version"])
        for key, metric, text, _ in TARGET_GAUGES
    }
    for labels, served in sorted(current.items()):
        target = served.batcher.latency_target
        if target is None:
            continue
        report = target.report()
        for key, _, _, scale in TARGET_GAUGES:
            if report[key] is not None:
                families[key].add_metric(labels, report[key] * scale)
    yield from families.values()
