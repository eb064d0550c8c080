"""Request metrics, observed once per inference call by the data plane
(``tensorserve/dataplane``), for either front end: outcome counters, rejections by reason, the end-to-end latency histogram and
the in-flight gauge.

Every outcome is counted, labelled by its stable error code (``ok`` for a
success, ``disconnect`` for a caller that left) and by ``protocol`` (``http``
or ``grpc``). Rejections (the request never
got a model's answer, through no fault of the model) are also counted by
reason. Model names come from the route: a name the registry does not know
is counted as ``_unknown``, so a scan of random names cannot add series.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tensorserve import errors
from tensorserve.histograms import SECONDS_BUCKETS

OK = "ok"
DISCONNECT = "disconnect"  # the caller closed the connection before the answer
UNKNOWN_MODEL = "_unknown"

# Error code -> rejection reason, from the one table (errors.CODES). A code
# missing here (model_failure, internal) is an error of the server or the
# model, not a rejection.
REJECTION_REASONS = {
    code: cls.rejection for code, cls in errors.CODES.items() if cls.rejection is not None
} | {DISCONNECT: "disconnect"}

# A request's end-to-end seconds: the stages' buckets from 0.5 ms up.
LATENCY_BUCKETS = SECONDS_BUCKETS[SECONDS_BUCKETS.index(0.0005) :]


def latency_bucket(seconds: float) -> int:
    """The bucket of ``LATENCY_BUCKETS`` (or the last, +Inf) that a Prometheus
    histogram counts ``seconds`` in: the first upper bound >= it."""
    return bisect.bisect_left(LATENCY_BUCKETS, seconds)


def add_observations(child: Any, counts: Sequence[int], total: float) -> None:
    """Many observations at once into a histogram's child, as bucket counts
    (``latency_bucket``) and their sum: what a front-end process reports.
    One ``inc`` per non-empty bucket, where ``observe`` scans the bounds in
    Python for each value (~2 us each in the scheduler process, for every
    request). prometheus_client keeps each bucket's own count and the sum
    as values (``_buckets``, ``_sum``) that ``observe`` increments;
    tests/test_process_metrics.py checks the text matches ``observe``'s."""
    child._sum.inc(total)
    for bucket, count in zip(child._buckets, counts):
        if count:
            bucket.inc(count)


def rejection_reason(code: str, status: int) -> str | None:
    """The rejection reason of an outcome, or None if it is not a rejection."""
    if status == 413:
        return "too_large"  # a body over max_request_bytes (aiohttp's own 413)
    return REJECTION_REASONS.get(code)


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "version", "code", "protocol"]
        self.requests = Counter(
            "tensorserve_requests",
            "Inference requests by outcome code.",
            labels,
            registry=registry,
        )
        self.items = Counter(
            "tensorserve_items",
            "Items of inference requests by outcome code (0 for a body that did not decode).",
            labels,
            registry=registry,
        )
        self.rejections = Counter(
            "tensorserve_rejections",
            "Inference requests refused or abandoned before a model answered, by reason.",
            ["model", "reason"],
            registry=registry,
        )
        self.latency = Histogram(
            "tensorserve_request_duration_seconds",
            "Inference request latency, handler entry to response ready, by outcome code.",
            labels,
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.encode = Histogram(
            "tensorserve_response_encode_seconds",
            "Encoding a successful response (after un-padding), per request.",
            ["model"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.in_flight = Gauge(
            "tensorserve_requests_in_flight",
            "Inference requests being handled now.",
            registry=registry,
        )

        # (protocol, model, version, code, status) -> the labelled children: one dict
        # look-up per request instead of three or four ``labels()`` calls (~5 us each).
        self._children: dict[tuple[str, str, str, str, int], tuple[Any, Any, Any, Any]] = {}
        self._encode_children: dict[str, Any] = {}

    def _labelled(
        self, protocol: str, model: str, version: str, code: str, status: int
    ) -> tuple[Any, Any, Any, Any]:
        key = (protocol, model, version, code, status)
        children = self._children.get(key)
        if children is None:
            reason = rejection_reason(code, status)
            children = self._children[key] = (
                self.requests.labels(model, version, code, protocol),
                self.items.labels(model, version, code, protocol),
                self.latency.labels(model, version, code, protocol),
                self.rejections.labels(model, reason) if reason is not None else None,
            )
        return children

    def observe(
        self,
        protocol: str,
        model: str,
        version: str,
        code: str,
        status: int,
        items: int,
        seconds: float,
    ) -> None:
        requests, counted_items, latency, rejections = self._labelled(
            protocol, model, version, code, status
        )
        requests.inc()
        if items:
            counted_items.inc(items)
        latency.observe(seconds)
        if rejections is not None:
            rejections.inc()

    def observe_many(
        self,
        protocol: str,
        model: str,
        version: str,
        code: str,
        status: int,
        count: int,
        items: int,
        latency_counts: Sequence[int],
        latency_sum: float,
    ) -> None:
        """``count`` requests of one outcome, which a front-end process
        observed (``frontends/report.py``): their latencies as bucket counts."""
        requests, counted_items, latency, rejections = self._labelled(
            protocol, model, version, code, status
        )
        requests.inc(count)
        if items:
            counted_items.inc(items)
        add_observations(latency, latency_counts, latency_sum)
        if rejections is not None:
            rejections.inc(count)

    def observe_encode(self, model: str, seconds: float) -> None:
        self._encode_child(model).observe(seconds)

    def observe_encode_many(self, model: str, counts: Sequence[int], total: float) -> None:
        add_observations(self._encode_child(model), counts, total)

    def _encode_child(self, model: str) -> Any:
        child = self._encode_children.get(model)
        if child is None:
            child = self._encode_children[model] = self.encode.labels(model)
        return child
