"""Triton's metric names for the same quantities, so dashboards, alerts and
autoscalers written for Triton read tensorserve too. Nothing new is measured:
at scrape time this reads the batching stats (``collector.py``) and the
request metrics (``requests.py``), the events tensorserve's own metrics count.

As Triton defines them (its metrics guide, "Inference Request Metrics"):
per model and version, counts and cumulative microseconds; a request counts
once whatever its items; a batch's compute time is charged to each of its
requests. Where tensorserve's unit is the item (queue wait, the compute
durations), an item stands for a request: a one-item request, the common
case, is the same either way.

prometheus-client writes a counter's name with ``_total``, and Triton's have
none, so the counters are exported untyped under Triton's exact names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tensorserve.metrics.requests import OK, UNKNOWN_MODEL

if TYPE_CHECKING:
    from tensorserve.batching.stats import BatchStats
    from tensorserve.metrics.collector import BatchingCollector
    from tensorserve.metrics.requests import RequestMetrics

US = 1e6
# (name, help, BatchStats field, scale): from the batching stats.
FROM_BATCHES = (
    (
        "nv_inference_count",
        "Number of inferences performed (items that reached the model).",
        "batch_items",
        1,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (batches).",
        "total_batches",
        1,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative time items spent waiting in the scheduling queue, in microseconds.",
        "queue_seconds",
        US,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative time items spent in their batch's input padding, in microseconds.",
        "item_pad_seconds",
        US,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative time items spent in their batch's model execution, in microseconds.",
        "item_compute_seconds",
        US,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative time items spent in their batch's output un-padding, in microseconds.",
        "item_unpad_seconds",
        US,
    ),
)
SUCCESS = ("nv_inference_request_success", "Number of successful inference requests.")
FAILURE = (
    "nv_inference_request_failure",
    "Number of failed inference requests (every outcome but ok, disconnects included).",
)
DURATION = (
    "nv_inference_request_duration_us",
    "Cumulative end-to-end duration of successful inference requests, in microseconds.",
)
PENDING = ("nv_inference_pending_request_count", "Items waiting in the queue for a batch.")
LATENCY = "tensorserve_request_duration_seconds"
Key = tuple[str, str]


def _counter(name: str, text: str) -> Metric:
    return Metric(name, text, "unknown")


def _sum(stats: list[BatchStats], field: str) -> float:
    total = 0.0
    for one in stats:
        with one._lock:
            total += getattr(one, field)
    return total


class TritonCollector(Collector):
    def __init__(self, batching: BatchingCollector, requests: RequestMetrics) -> None:
        self.batching = batching
        self.requests = requests

    def _request_totals(self) -> dict[Key, list[float]]:
        """(model, version) -> [ok requests, other requests, ok seconds], from
        the latency histogram, which observes every outcome once."""
        totals: dict[Key, list[float]] = {}
        for family in self.requests.latency.collect():
            for sample in family.samples:
                labels = sample.labels
                if labels["model"] == UNKNOWN_MODEL:  # no model, as Triton counts none
                    continue
                row = totals.setdefault((labels["model"], labels["version"]), [0.0, 0.0, 0.0])
                ok = labels["code"] == OK
                if sample.name == f"{LATENCY}_count":
                    row[0 if ok else 1] += sample.value
                elif sample.name == f"{LATENCY}_sum" and ok:
                    row[2] += sample.value
        return totals

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        success, failure, duration = (_counter(*spec) for spec in (SUCCESS, FAILURE, DURATION))
        for (model, version), (ok, failed, seconds) in sorted(self._request_totals().items()):
            key = {"model": model, "version": version}
            success.add_sample(success.name, key, ok)
            failure.add_sample(failure.name, key, failed)
            duration.add_sample(duration.name, key, seconds * US)
        batches = [
            (_counter(name, text), field, scale) for name, text, field, scale in FROM_BATCHES
        ]
        pending = GaugeMetricFamily(*PENDING, labels=labels)
        for (model, version), stats, depth in self.batching.per_model():
            key = {"model": model, "version": version}
            for family, field, scale in batches:
                family.add_sample(family.name, key, _sum(stats, field) * scale)
            pending.add_metric([model, version], depth)
        yield from (success, failure, duration)
        yield from (family for family, _, _ in batches)
        yield pending
