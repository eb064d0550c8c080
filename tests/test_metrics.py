"""``/metrics`` of a real app after known traffic: every outcome (good, bad
input, model failure, unknown model, not ready, too large, queue full,
deadline, disconnect) counted exactly, the histograms' counts, the stats
endpoint agreeing with them, and counters that survive a reload."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tensorserve.batching.stats import BatchStats
from tensorserve.http.app import create_app
from tensorserve.http.keys import METRICS, REGISTRY
from tensorserve.metrics.requests import RequestMetrics
from tensorserve.metrics.triton import TritonCollector
from tensorserve.settings import Settings
from tests.helpers import ECHO, MSGPACK, body, wait_until_async, write_toy_model

# Doubles x. A batch holding 7 waits for the test's release (the model is
# then busy and the queue fills); a batch holding 13 raises.
GATED_MODEL = """
    import threading
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.entered = threading.Event()
            self.release = threading.Event()

        def forward(self, x):
            if (x == 7).any():
                self.entered.set()
                self.release.wait(30)
            if (x == 13).any():
                raise RuntimeError("poison value 13 in batch")
            return x * 2
"""
GATED = {**ECHO, "max_batch_size": 1, "dynamic_batching": {"max_queue_size": 2}}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def item(fill: float, rows: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 4), fill, np.float32)}


@pytest.fixture
async def app_client(aiohttp_client: Any, tmp_path: Path) -> Any:
    write_toy_model(tmp_path, "gated", GATED_MODEL, **GATED)
    write_toy_model(tmp_path, "broken", "raise ImportError('no such thing')\n", **ECHO)
    app = create_app(
        Settings(model_repository=tmp_path, max_request_bytes=2048, model_control_mode="explicit"),
        wait_for_models=True,
    )
    # As `tensorserve serve` runs it: a caller that disconnects cancels its handler.
    return await aiohttp_client(app, server_kwargs={"handler_cancellation": True})


async def post(client: Any, model: str, items: list[dict[str, Any]], **extra: Any) -> int:
    response = await client.post(f"/v2/models/{model}/infer", data=body(items, **extra),
                                 headers=MSGPACK)
    await response.read()
    return int(response.status)


async def known_traffic(client: Any) -> None:
    """Exactly: 8 ok requests (11 items), and one of each failure."""
    app = client.server.app
    served = app[REGISTRY].entries["gated"].served
    gate = served.fn
    assert [await post(client, "gated", [item(1.0), item(2.0)]) for _ in range(3)] == [200] * 3
    assert await post(client, "gated", [{"x": np.ones((2, 3), np.float32)}]) == 400
    assert await post(client, "gated", [item(13.0)]) == 500
    assert await post(client, "nope", [item(1.0)]) == 404
    assert await post(client, "broken", [item(1.0)]) == 503
    assert await post(client, "gated", [item(1.0, rows=200)]) == 413

    # Queue full: the model is busy on a 7, two items wait, the next is refused.
    running = asyncio.create_task(post(client, "gated", [item(7.0)]))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    waiting = [asyncio.create_task(post(client, "gated", [item(1.0)])) for _ in range(2)]
    await wait_until_async(lambda: served.batcher.queue_depth == 2, "two items queued")
    assert await post(client, "gated", [item(1.0)]) == 503
    gate.release.set()
    assert await asyncio.gather(running, *waiting) == [200] * 3
    assert await asyncio.to_thread(served.batcher.wait_idle, 10)

    # A deadline passes in the queue behind a busy model.
    gate.entered.clear(), gate.release.clear()
    running = asyncio.create_task(post(client, "gated", [item(7.0)]))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    assert await post(client, "gated", [item(1.0)], parameters={"timeout_ms": 50}) == 504
    gate.release.set()
    assert await running == 200
    assert await asyncio.to_thread(served.batcher.wait_idle, 10)

    # A caller that disconnects while its item waits.
    gate.entered.clear(), gate.release.clear()
    running = asyncio.create_task(post(client, "gated", [item(7.0)]))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    leaving = asyncio.create_task(post(client, "gated", [item(1.0)]))
    await wait_until_async(lambda: served.batcher.queue_depth == 1, "the leaving caller's item queued")
    leaving.cancel()
    rejections = app[METRICS].requests.rejections
    await wait_until_async(lambda: rejections.labels("gated", "disconnect")._value.get() == 1,
                   "the disconnect counted")
    gate.release.set()
    assert await running == 200
    assert await asyncio.to_thread(served.batcher.wait_idle, 10)


async def test_metrics_count_every_outcome_exactly(app_client: Any) -> None:
    await known_traffic(app_client)
    samples = parse(await (await app_client.get("/metrics")).text())
    gated = {"model": "gated", "version": "1"}

    codes = {"ok": 8, "invalid_input": 1, "model_failure": 1, "server_busy": 1,
             "deadline_exceeded": 1, "disconnect": 1, "http_error": 1}
    for code, count in codes.items():
        assert value(samples, "tensorserve_requests_total", **gated, code=code, protocol="http") == count, code
        assert value(samples, "tensorserve_request_duration_seconds_count", **gated,
                     code=code, protocol="http") == count, code
    assert value(samples, "tensorserve_requests_total", model="_unknown", version="",
                 code="model_not_found", protocol="http") == 1
    assert value(samples, "tensorserve_requests_total", model="broken", version="",
                 code="model_not_ready", protocol="http") == 1
    assert value(samples, "tensorserve_items_total", **gated, code="ok", protocol="http") == 11
    assert value(samples, "tensorserve_items_total", **gated, code="invalid_input", protocol="http") == 1
    assert value(samples, "tensorserve_response_encode_seconds_count", model="gated") == 8

    reasons = {("gated", "invalid_input"): 1, ("gated", "queue_full"): 1, ("gated", "deadline"): 1,
               ("gated", "disconnect"): 1, ("gated", "too_large"): 1,
               ("_unknown", "unknown_model"): 1, ("broken", "not_ready"): 1}
    for (model, reason), count in reasons.items():
        assert value(samples, "tensorserve_rejections_total", model=model, reason=reason) == count
    # A model failure is an error, not a rejection.
    assert sum(v for (n, _), v in samples.items() if n == "tensorserve_rejections_total") == 7
    assert value(samples, "tensorserve_requests_in_flight") == 0

    # Admitted: everything but the 400, the 503s, the 404 and the 413 (11
    # requests, 14 items); executed: all but the expired and the abandoned item.
    assert value(samples, "tensorserve_admitted_requests_total", **gated) == 11
    assert value(samples, "tensorserve_admitted_items_total", **gated) == 14
    assert value(samples, "tensorserve_batch_items_total", **gated) == 12
    batches = value(samples, "tensorserve_batches_total", **gated)
    assert batches == 12  # max_batch_size 1
    assert value(samples, "tensorserve_model_failed_items_total", **gated) == 1
    for histogram in ("batch_size", "batch_padded_length", "batch_pad_seconds",
                      "batch_compute_seconds"):
        assert value(samples, f"tensorserve_{histogram}_count", **gated) == batches, histogram
    assert value(samples, "tensorserve_batch_size_bucket", **gated, le="1.0") == batches
    assert value(samples, "tensorserve_batch_padded_length_bucket", **gated, le="1.0") == 0
    assert value(samples, "tensorserve_batch_padded_length_sum", **gated) == 2 * batches
    assert value(samples, "tensorserve_queue_wait_seconds_count", **gated) == 12
    assert value(samples, "tensorserve_batch_unpad_seconds_count", **gated) == 11  # not the failed
    assert value(samples, "tensorserve_real_elements_total", **gated) == 12 * 8
    assert value(samples, "tensorserve_padded_elements_total", **gated) == 12 * 8
    assert value(samples, "tensorserve_queue_depth", **gated) == 0

    assert value(samples, "tensorserve_model_ready", model="gated") == 1
    assert value(samples, "tensorserve_model_state", model="broken", state="FAILED") == 1
    assert value(samples, "tensorserve_model_state", model="broken", state="READY") == 0
    assert value(samples, "tensorserve_model_load_seconds", model="gated") > 0
    assert any(n == "tensorserve_build_info" and ("version", "0.1.0") in labels
               for n, labels in samples)
    assert value(samples, "process_cpu_seconds_total") > 0
    assert any(n == "python_info" for n, _ in samples)

    # The stats endpoint agrees with /metrics.
    stats = (await (await app_client.get("/v2/models/gated/stats")).json())["batching"]
    assert stats["total_batches"] == batches
    assert stats["total_requests"] == value(samples, "tensorserve_admitted_requests_total", **gated)
    assert stats["total_items"] == value(samples, "tensorserve_admitted_items_total", **gated)
    assert stats["failed_items"] == value(samples, "tensorserve_model_failed_items_total", **gated)
    assert stats["avg_batch_size"] == pytest.approx(
        value(samples, "tensorserve_batch_size_sum", **gated) / batches)
    assert stats["avg_batch_duration_ms"] == pytest.approx(
        1000 * value(samples, "tensorserve_batch_compute_seconds_sum", **gated) / batches)
    assert stats["queue_depth"] == value(samples, "tensorserve_queue_depth", **gated)
    assert stats["padding_efficiency"] == pytest.approx(
        value(samples, "tensorserve_real_elements_total", **gated)
        / value(samples, "tensorserve_padded_elements_total", **gated))
    recent = stats["recent"]
    assert recent["items"] == 12 and recent["batches"] == batches
    assert 0 < recent["p50_ms"] <= recent["p99_ms"]
    assert recent["padding_efficiency"] == 1.0

    # Triton's names for the same quantities (metrics/triton.py), from the same counts.
    assert value(samples, "nv_inference_request_success", **gated) == 8
    assert value(samples, "nv_inference_request_failure", **gated) == 6  # every other outcome
    assert value(samples, "nv_inference_request_failure", model="broken", version="") == 1
    assert not any(n.startswith("nv_") and ("model", "_unknown") in labels
                   for n, labels in samples)  # no model, nothing counted, as in Triton
    assert value(samples, "nv_inference_count", **gated) == 12
    assert value(samples, "nv_inference_exec_count", **gated) == batches
    microseconds = {
        # Triton's have no protocol label: every protocol's sum (only HTTP calls here).
        "nv_inference_request_duration_us": ("tensorserve_request_duration_seconds_sum",
                                             {"code": "ok", "protocol": "http"}),
        "nv_inference_queue_duration_us": ("tensorserve_queue_wait_seconds_sum", {}),
        # Batches of one item: each item's share of its batch is the whole batch.
        "nv_inference_compute_input_duration_us": ("tensorserve_batch_pad_seconds_sum", {}),
        "nv_inference_compute_infer_duration_us": ("tensorserve_batch_compute_seconds_sum", {}),
        "nv_inference_compute_output_duration_us": ("tensorserve_batch_unpad_seconds_sum", {}),
    }
    for triton, (ours, extra) in microseconds.items():
        seconds = value(samples, ours, **gated, **extra)
        assert seconds > 0 and value(samples, triton, **gated) == pytest.approx(1e6 * seconds), triton
    assert value(samples, "nv_inference_pending_request_count", **gated) == 0


def test_triton_request_counts_sum_every_protocol() -> None:
    # Triton's names have no protocol label: an HTTP and a gRPC call count alike.
    requests = RequestMetrics(CollectorRegistry())
    requests.observe("http", "m", "1", "ok", 200, 1, 0.5)
    requests.observe("grpc", "m", "1", "ok", 200, 2, 0.25)
    requests.observe("grpc", "m", "1", "server_busy", 503, 1, 0.1)

    class NoBatches:
        def per_model(self) -> Iterator[Any]:
            return iter(())

    collector = TritonCollector(NoBatches(), requests)  # type: ignore[arg-type]
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in collector.collect() for s in family.samples}
    m = {"model": "m", "version": "1"}
    assert value(samples, "nv_inference_request_success", **m) == 2
    assert value(samples, "nv_inference_request_failure", **m) == 1
    assert value(samples, "nv_inference_request_duration_us", **m) == pytest.approx(750_000)


def test_each_item_is_charged_its_whole_batchs_compute_time_as_triton_charges_requests() -> None:
    stats = BatchStats()
    stats.record_batch(0.5, 3, 3, enqueued=[0.0, 0.0, 1.0], dispatched=1.5,
                       pad_seconds=0.1, unpad_seconds=0.2)
    assert stats.item_compute_seconds == pytest.approx(1.5)
    assert stats.item_pad_seconds == pytest.approx(0.3)
    assert stats.item_unpad_seconds == pytest.approx(0.6)
    assert stats.queue_seconds == pytest.approx(3.5)


async def test_counters_do_not_go_backwards_across_a_reload(app_client: Any) -> None:
    assert [await post(app_client, "gated", [item(1.0)]) for _ in range(3)] == [200] * 3
    before = parse(await (await app_client.get("/metrics")).text())
    gated = {"model": "gated", "version": "1"}
    assert value(before, "tensorserve_batches_total", **gated) == 3
    old = app_client.server.app[REGISTRY].entries["gated"].served
    reply = await app_client.post("/v2/repository/models/gated/load")
    assert reply.status == 200
    assert app_client.server.app[REGISTRY].entries["gated"].served is not old
    assert await post(app_client, "gated", [item(1.0)]) == 200
    after = parse(await (await app_client.get("/metrics")).text())
    for name in ("tensorserve_batches_total", "tensorserve_admitted_items_total",
                 "tensorserve_batch_size_count", "tensorserve_queue_wait_seconds_count"):
        assert value(after, name, **gated) == value(before, name, **gated) + 1, name
    assert value(after, "tensorserve_requests_total", **gated, code="ok", protocol="http") == 4
    assert value(after, "tensorserve_request_duration_seconds_count", **gated, code="ok", protocol="http") == 4


async def test_a_killed_worker_counts_as_a_restart(aiohttp_client: Any, tmp_path: Path) -> None:
    write_toy_model(tmp_path, "isolated", GATED_MODEL, **{**ECHO, "isolation": "process"})
    app = create_app(Settings(model_repository=tmp_path), wait_for_models=True)
    client = await aiohttp_client(app)
    assert await post(client, "isolated", [item(1.0)]) == 200
    executor = app[REGISTRY].entries["isolated"].served.executor
    worker = executor.workers[0].pid
    os.kill(worker, signal.SIGKILL)
    await wait_until_async(lambda: _dead(worker), "the worker dead")
    # The next batch finds the worker dead and replaces it (the request may
    # fail or succeed, depending on when the death is seen); then all is well.
    await post(client, "isolated", [item(1.0)])
    await wait_until_async(lambda: executor.workers[0].alive and executor.workers[0].pid != worker,
                   "the worker replaced")
    assert await post(client, "isolated", [item(1.0)]) == 200
    samples = parse(await (await client.get("/metrics")).text())
    assert value(samples, "tensorserve_worker_restarts_total", model="isolated", version="1") == 1


def _dead(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped (we leave that to the runtime)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_observing_many_values_at_once_counts_as_observing_each() -> None:
    from tensorserve.histograms import Buckets

    values = [0.0, 0.001, 0.0049, 0.005, 0.2, 7.0, 1e9]
    each, many = Buckets((0.001, 0.005, 0.1, 10.0)), Buckets((0.001, 0.005, 0.1, 10.0))
    for value in values:
        each.observe(value)
    many.observe_many(values)
    assert many.cumulative() == each.cumulative() == [
        ("0.001", 2), ("0.005", 4), ("0.1", 4), ("10.0", 6), ("+Inf", 7)
    ]
    assert (many.count, many.total) == (each.count, each.total)
