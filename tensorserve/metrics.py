"""Prometheus metrics, exposed at ``GET /metrics``.

Batching counters are read from each model's ``BatchStats`` at scrape time
by a custom collector, so the batcher's hot path never calls into the
metrics library; only request latency is observed per request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tensorserve.batching.stats import BATCH_SIZE_BUCKETS

if TYPE_CHECKING:
    from tensorserve.serving.registry import ModelRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _BatchingCollector(Collector):
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        label = ["model"]
        requests = CounterMetricFamily("tensorserve_requests", "Inference requests accepted.", labels=label)
        items = CounterMetricFamily("tensorserve_items", "Items accepted.", labels=label)
        failed = CounterMetricFamily("tensorserve_failed_items", "Items that failed in the model.", labels=label)
        batches = CounterMetricFamily("tensorserve_batches", "Batches executed.", labels=label)
        seconds = CounterMetricFamily("tensorserve_batch_seconds", "Time spent executing batches.", labels=label)
        depth = GaugeMetricFamily("tensorserve_queue_depth", "Items waiting to be batched.", labels=label)
        efficiency = GaugeMetricFamily(
            "tensorserve_padding_efficiency", "Real elements / padded elements.", labels=label
        )
        ready = GaugeMetricFamily("tensorserve_model_ready", "1 if the model is ready.", labels=label)
        sizes = HistogramMetricFamily("tensorserve_batch_size", "Executed batch sizes.", labels=label)
        for entry in list(self.registry.entries.values()):
            ready.add_metric([entry.name], 1.0 if entry.state.value == "READY" else 0.0)
            served = entry.served
            if served is None:
                continue
            snap = served.stats.snapshot(served.batcher.queue_depth)
            name = [entry.name]
            requests.add_metric(name, snap["total_requests"])
            items.add_metric(name, snap["total_items"])
            failed.add_metric(name, snap["failed_items"])
            batches.add_metric(name, snap["total_batches"])
            seconds.add_metric(name, snap["avg_batch_duration_ms"] * snap["total_batches"] / 1000)
            depth.add_metric(name, snap["queue_depth"])
            efficiency.add_metric(name, snap["padding_efficiency"])
            cumulative, buckets = 0, []
            for bound, count in zip(BATCH_SIZE_BUCKETS, served.stats.batch_size_counts):
                cumulative += count
                buckets.append((str(float(bound)), cumulative))
            buckets.append(("+Inf", cumulative))
            sizes.add_metric(name, buckets, sum_value=snap["avg_batch_size"] * snap["total_batches"])
        yield from (requests, items, failed, batches, seconds, depth, efficiency, ready, sizes)


class Metrics:
    """One Prometheus registry per server (so many apps can live in one process)."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.prometheus = CollectorRegistry()
        self.prometheus.register(_BatchingCollector(registry))
        self.latency = Histogram(
            "tensorserve_request_seconds",
            "Inference request latency, body read to response encoded.",
            ["model"],
            registry=self.prometheus,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )

    def observe_request(self, model: str, seconds: float) -> None:
        self.latency.labels(model).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.prometheus)
