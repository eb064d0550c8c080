"""The load part of benchmarks/gpu_check.py: a closed loop of ``c`` callers,
each sending one item per request and the next as soon as the answer
arrives, over aiohttp with the native protocol; the GPU's utilisation
sampled through NVML meanwhile (``nvidia-ml-py``; none without it), and
from the server's own statistics the mean batch and what the device could
take: items per second of the batches' own time (CUDA events on a GPU), beside
the server's CPU per request, which bounds what one server process can feed it.

Kept apart from the checks: it measures, it does not judge.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Self

SAMPLE_EVERY_S = 0.05


@dataclass(frozen=True)
class LoadPoint:
    model: str
    batch_size: int  # the model's max_batch_size in this server
    concurrency: int
    items_per_s: float
    p50_ms: float
    p99_ms: float
    gpu_util: float | None  # mean NVML utilisation (%), None without NVML or a GPU
    server_cpu_us_per_request: float
    failed: int  # requests answered with anything but 200
    mean_batch: float | None = None  # items per batch the server ran
    device_items_per_s: float | None = None  # items per second of the batches' own time

    def as_json(self) -> dict[str, Any]:
        return {"model": self.model, "batch_size": self.batch_size, "concurrency": self.concurrency,
                "items_per_s": round(self.items_per_s, 1), "p50_ms": round(self.p50_ms, 3),
                "p99_ms": round(self.p99_ms, 3),
                "gpu_util": None if self.gpu_util is None else round(self.gpu_util, 1),
                "server_cpu_us_per_request": round(self.server_cpu_us_per_request, 1),
                "failed": self.failed,
                "mean_batch": None if self.mean_batch is None else round(self.mean_batch, 1),
                "device_items_per_s": None if self.device_items_per_s is None
                else round(self.device_items_per_s, 1)}


class GpuSampler:
    """Samples one GPU's utilisation every 50 ms on a thread of its own while
    ``with`` is open; ``mean`` is None where NVML cannot be read."""

    def __init__(self, index: int | None) -> None:
        self.samples: list[float] = []
        self._handle: Any = None
        self._nvml: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if index is None:
            return
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML: no utilisation, the load still runs
            self._handle = None

    def __enter__(self) -> Self:
        if self._handle is not None:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            with contextlib.suppress(Exception):  # a failed read is a missing sample
                self.samples.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    @property
    def mean(self) -> float | None:
        return float(np.mean(self.samples)) if self.samples else None


async def closed_loop(session: Any, url: str, model: str, bodies: Sequence[bytes],
                      concurrency: int, seconds: float) -> tuple[list[float], int, int]:
    """``concurrency`` callers for ``seconds``: latencies (s) of the requests
    answered 200, how many were, and how many failed."""
    latencies: list[float] = []
    failed = 0
    stop_at = time.monotonic() + seconds
    endpoint = f"{url}/v2/models/{model}/infer"
    headers = {"Content-Type": "application/msgpack"}

    async def caller(offset: int) -> None:
        nonlocal failed
        n = offset
        while time.monotonic() < stop_at:
            body = bodies[n % len(bodies)]
            n += concurrency
            started = time.perf_counter()
            async with session.post(endpoint, data=body, headers=headers) as response:
                await response.read()
                ok = response.status == 200
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                failed += 1

    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    return latencies, len(latencies), failed


async def batching_counters(session: Any, url: str, model: str) -> tuple[int, int, float]:
    """(batches, items, seconds the batches ran) from the server's statistics."""
    async with session.get(f"{url}/v2/models/{model}/stats") as response:
        batching = (await response.json())["model_stats"][0]["batching"]
    return batching["total_batches"], batching["batch_items"], batching["batch_seconds"]


async def run_point(session: Any, server: Any, model: str, batch_size: int, bodies: Sequence[bytes],
                    concurrency: int, seconds: float, warmup: float, gpu_index: int | None) -> LoadPoint:
    """One point: a short warm-up at the same concurrency, then the measured
    run, with the server's CPU time and the GPU's utilisation around it."""
    await closed_loop(session, server.url, model, bodies, concurrency, warmup)
    counters_before = await batching_counters(session, server.url, model)
    cpu_before = server.cpu_seconds()
    started = time.perf_counter()
    with GpuSampler(gpu_index) as sampler:
        latencies, served, failed = await closed_loop(
            session, server.url, model, bodies, concurrency, seconds)
    elapsed = time.perf_counter() - started
    cpu = server.cpu_seconds() - cpu_before
    batches, items, batch_seconds = (after - before for after, before in zip(
        await batching_counters(session, server.url, model), counters_before, strict=True))
    ms = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return LoadPoint(model, batch_size, concurrency, served / elapsed,
                     float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), sampler.mean,
                     1e6 * cpu / max(1, served + failed), failed,
                     items / batches if batches else None,
                     items / batch_seconds if batch_seconds > 0 else None)
