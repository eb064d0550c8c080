"""Prometheus metrics, exposed at ``GET /metrics`` (docs/observability.md
lists every one).

    collector.py   batching metrics, read from each model's BatchStats at
                   scrape time (the hot path never calls the metrics library)
    requests.py    per-request outcome, rejection and latency metrics,
                   observed once per request by the HTTP layer
    ensemble.py    each ensemble step's calls, items, failures and seconds,
                   read from the ensembles' stats at scrape time
    processes.py   each server process's CPU seconds and event-loop lag,
                   labelled role and pid (own ones read, others reported)
    triton.py      Triton's names (nv_inference_*) for the same quantities,
                   read from the two above at scrape time

One ``CollectorRegistry`` per server, so many apps can live in one process;
it also carries the process, platform and GC collectors and the build info.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from tensorserve import __version__
from tensorserve.metrics.collector import BatchingCollector
from tensorserve.metrics.ensemble import EnsembleCollector
from tensorserve.metrics.processes import ProcessMetrics
from tensorserve.metrics.requests import RequestMetrics
from tensorserve.metrics.triton import TritonCollector

if TYPE_CHECKING:
    from tensorserve.serving.liveness import Liveness
    from tensorserve.serving.registry import ModelRegistry

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


class Metrics:
    """One Prometheus registry per server."""

    def __init__(
        self,
        registry: ModelRegistry,
        liveness: Liveness | None = None,
        loop_lag: Callable[[], float] | None = None,
        *,
        role: str = "server",
    ) -> None:
        """``loop_lag``: this process's event-loop lag (s), read at each scrape;
        ``role``: this process's (metrics/processes.py: ``server`` when the
        server is one process, ``scheduler`` in the one of ``--frontends N``)."""
        self.prometheus = CollectorRegistry()
        batching = BatchingCollector(registry, liveness)
        self.prometheus.register(batching)
        self.prometheus.register(EnsembleCollector(registry))
        self.requests = RequestMetrics(self.prometheus)
        self.prometheus.register(TritonCollector(batching, self.requests))
        ProcessCollector(registry=self.prometheus)
        PlatformCollector(registry=self.prometheus)
        GCCollector(registry=self.prometheus)
        # Other processes (front ends) report their figures into it.
        self.processes = ProcessMetrics(role, loop_lag)
        self.prometheus.register(self.processes)
        Info(
            "tensorserve_build", "The running tensorserve's version.", registry=self.prometheus
        ).info(
            {
                "version": __version__,
                "python": platform.python_version(),
                "torch": _version("torch"),  # from the package metadata: no torch import
            }
        )

    def exposition(self) -> bytes:
        return generate_latest(self.prometheus)
