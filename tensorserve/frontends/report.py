"""A front end's request metrics, on their way to the scheduler process.

The scheduler process is the server's one Prometheus exporter: ``/metrics``
on any front end shows the whole server. A front end therefore observes
each call here (``DataPlane.observe_infer`` calls ``observe``, as it calls
the Prometheus metrics in one process), grouped by outcome, and sends what
it gathered with its next message to the scheduler process (and at least
every ``REPORT_S``, with its CPU seconds, loop lag and calls in flight).
"""

from __future__ import annotations

from typing import Any

from tensorserve.metrics.requests import LATENCY_BUCKETS, latency_bucket

REPORT_S = 0.5
# Counts per latency bucket, the +Inf one last (``add_observations``).
BUCKETS = len(LATENCY_BUCKETS) + 1


class Count:
    """The calls in flight, as ``prometheus_client.Gauge`` counts them."""

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount


class RequestReport:
    def __init__(self) -> None:
        self.in_flight = Count()
        # (protocol, model, version, code, status) -> [calls, items, bucket counts, seconds]:
        # the latencies as the histogram counts them, so the scheduler process
        # adds each bucket once per report, not each request's value.
        self._outcomes: dict[tuple[str, str, str, str, int], list[Any]] = {}
        self._encode: dict[str, list[Any]] = {}  # model -> [bucket counts, seconds]
        self._refused: dict[str, int] = {}  # model -> refusals on its latency target

    @property
    def pending(self) -> bool:
        return bool(self._outcomes or self._encode or self._refused)

    def refused(self, model: str) -> None:
        """A request refused here on the model's latency target: its
        statistics count it, as they count the scheduler process's own."""
        self._refused[model] = self._refused.get(model, 0) + 1

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
        key = (protocol, model, version, code, status)
        outcome = self._outcomes.get(key)
        if outcome is None:
            outcome = self._outcomes[key] = [0, 0, [0] * BUCKETS, 0.0]
        outcome[0] += 1
        outcome[1] += items
        outcome[2][latency_bucket(seconds)] += 1
        outcome[3] += seconds

    def observe_encode(self, model: str, seconds: float) -> None:
        encode = self._encode.get(model)
        if encode is None:
            encode = self._encode[model] = [[0] * BUCKETS, 0.0]
        encode[0][latency_bucket(seconds)] += 1
        encode[1] += seconds

    def take(self) -> dict[str, Any]:
        """What was observed since the last ``take``, as the "report"
        section (``frontends/protocol.py``), and the calls in flight now."""
        report: dict[str, Any] = {"in_flight": self.in_flight.value}
        if self._outcomes:
            report["requests"] = [[*key, *outcome] for key, outcome in self._outcomes.items()]
            self._outcomes = {}
        if self._encode:
            report["encode"] = [[model, *encode] for model, encode in self._encode.items()]
            self._encode = {}
        if self._refused:
            report["refused"] = list(self._refused.items())
            self._refused = {}
        return report


class FrontEndMetrics:
    """The data plane's ``metrics`` in a front-end process."""

    def __init__(self) -> None:
        self.requests = RequestReport()
