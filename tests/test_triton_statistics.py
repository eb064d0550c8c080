"""Triton's statistics extension in Triton's units (``batching/stats.py``,
``wire/triton.py``): ``inference_stats`` counts requests, each charged the
whole pad, run and un-pad time of the batches it ran in; queue and the three
compute counts are the successful requests (perf_analyzer aborts unless the
compute counts agree); ``inference_count`` counts items, ``execution_count``
and ``batch_stats`` batches; ``last_inference`` is ms since the epoch.

First the counters alone with made-up batches, then a real server answering
a known number of concurrent requests over HTTP and gRPC, its statistics
read through both protocols with tritonclient.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from tensorserve.batching.stats import BatchStats, RequestTally
from tests.conftest import ServerProcess
from tests.helpers import ECHO, write_toy_model

MS = 1_000_000  # ns


@dataclass
class Item:
    """An answered item, as ``BatchStats`` reads one (``admission.Pending``)."""

    enqueued: float
    request: RequestTally | None = None


def answered(*items: Item, failed: tuple[int, ...] = ()) -> list[tuple[Item, Any, bool]]:
    return [(item, None, i in failed) for i, item in enumerate(items)]


def batch(
    stats: BatchStats, items: list[tuple[Item, Any, bool]], *, dispatched: float,
    pad: float = 0.001, run: float = 0.010, unpad: float = 0.002,
) -> None:
    stats.record_batch(
        run, 1, 1, enqueued=[item.enqueued for item, _, _ in items], dispatched=dispatched,
        pad_seconds=pad, unpad_seconds=unpad, answered=items,
    )


def test_each_request_of_a_batch_is_charged_the_whole_batch() -> None:
    stats = BatchStats()
    now = time.monotonic()
    before_ms = time.time_ns() // MS
    items = [Item(now - 0.5), Item(now - 0.3), Item(now - 0.1)]
    batch(stats, answered(*items), dispatched=now - 0.05)
    counts = stats.triton_counts()
    assert (counts.success, counts.fail, counts.inferences, counts.executions) == (3, 0, 3, 1)
    assert counts.queue_ns == pytest.approx(1e9 * (0.45 + 0.25 + 0.05), abs=1000)
    assert (counts.compute_input_ns, counts.compute_infer_ns, counts.compute_output_ns) == (
        3 * 1 * MS, 3 * 10 * MS, 3 * 2 * MS,
    )
    assert counts.batch_sizes == {3: (1, 1 * MS, 10 * MS, 2 * MS)}
    # From submit until the batch was recorded: at least the queue and the batch.
    assert counts.success_ns >= counts.queue_ns + counts.compute_input_ns
    assert before_ms <= counts.last_inference_ms <= time.time_ns() // MS


def test_a_request_of_several_items_counts_once_when_its_last_item_is_answered() -> None:
    stats = BatchStats()
    now = time.monotonic()
    tally = RequestTally(3)
    first, second, third = (Item(now - 1.0, tally) for _ in range(3))
    lone = Item(now - 0.8)
    # Two of its items and a one-item request in the first batch...
    batch(stats, answered(first, lone, second), dispatched=now - 0.6)
    counts = stats.triton_counts()
    assert (counts.success, counts.inferences) == (1, 1)  # the lone request only
    # ...its last item in the second: counted now, charged each batch once.
    batch(stats, answered(third), dispatched=now - 0.3, pad=0.004, run=0.020, unpad=0.003)
    counts = stats.triton_counts()
    assert (counts.success, counts.inferences, counts.executions) == (2, 4, 2)
    assert counts.compute_infer_ns == 10 * MS + (10 + 20) * MS  # lone + the request's two
    assert counts.compute_input_ns == 1 * MS + (1 + 4) * MS
    assert counts.compute_output_ns == 2 * MS + (2 + 3) * MS
    # Its queue: until its last item left the queue (0.7 s), not each item's summed.
    assert counts.queue_ns == pytest.approx(1e9 * (0.7 + 0.2), abs=1000)
    assert counts.batch_sizes == {3: (1, 1 * MS, 10 * MS, 2 * MS), 1: (1, 4 * MS, 20 * MS, 3 * MS)}


def test_a_failed_item_fails_its_request_and_is_left_out_of_queue_and_compute() -> None:
    stats = BatchStats()
    now = time.monotonic()
    tally = RequestTally(2)
    items = [Item(now - 0.1), Item(now - 0.1, tally), Item(now - 0.1, tally), Item(now - 0.1)]
    batch(stats, answered(*items, failed=(2, 3)), dispatched=now)
    counts = stats.triton_counts()
    assert (counts.success, counts.fail, counts.inferences) == (1, 2, 1)
    assert counts.fail_ns >= 2 * 100 * MS
    assert counts.compute_infer_ns == 10 * MS  # the one successful request's
    assert counts.batch_sizes == {4: (1, 1 * MS, 10 * MS, 2 * MS)}


def test_a_batch_that_runs_again_counts_as_an_execution_but_answers_no_request() -> None:
    stats = BatchStats()
    now = time.monotonic()
    item = Item(now - 0.1)
    # A failed batch whose items run again (batching.recovery): nothing answered yet.
    stats.record_batch(0.005, 1, 1, enqueued=[item.enqueued], dispatched=now, pad_seconds=0.001)
    batch(stats, answered(item), dispatched=now)
    counts = stats.triton_counts()
    assert (counts.success, counts.executions) == (1, 2)
    assert counts.batch_sizes == {1: (2, 2 * MS, 15 * MS, 2 * MS)}
    stats.reset()
    assert stats.triton_counts().batch_sizes == {} and stats.triton_counts().success == 0


# ---------------------------------------------------------------------- a real server
CUMSUM_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return x.cumsum(dim=1)
"""
ONE_ITEM, MULTI, ROWS = 30, 6, 3  # requests of one item, of ROWS items


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("stats_repo")
    write_toy_model(repo, "cumsum", CUMSUM_MODEL, **ECHO)
    server = ServerProcess(repo)
    yield server
    server.stop()


def _infer_http(url: str, rows: int, length: int) -> None:
    with triton_http.InferenceServerClient(url.removeprefix("http://")) as client:
        x = np.ones((rows, length, 4), np.float32)
        inputs = [triton_http.InferInput("x", list(x.shape), "FP32")]
        inputs[0].set_data_from_numpy(x)
        client.infer("cumsum", inputs)


def _infer_grpc(address: str, rows: int, length: int) -> None:
    with triton_grpc.InferenceServerClient(address) as client:
        x = np.ones((rows, length, 4), np.float32)
        inputs = [triton_grpc.InferInput("x", list(x.shape), "FP32")]
        inputs[0].set_data_from_numpy(x)
        client.infer("cumsum", inputs)


def test_statistics_count_known_concurrent_requests_alike_on_both_protocols(
    served: ServerProcess,
) -> None:
    before_ms = time.time_ns() // MS
    with ThreadPoolExecutor(8) as pool:
        calls = [
            pool.submit(_infer_http if i % 2 else _infer_grpc,
                        served.url if i % 2 else served.grpc_address, 1, 1 + i % 7)
            for i in range(ONE_ITEM)
        ] + [
            pool.submit(_infer_http if i % 2 else _infer_grpc,
                        served.url if i % 2 else served.grpc_address, ROWS, 2 + i)
            for i in range(MULTI)
        ]  # fmt: skip
        for call in calls:
            call.result()
    after_ms = time.time_ns() // MS

    with triton_http.InferenceServerClient(served.url.removeprefix("http://")) as client:
        [http] = client.get_inference_statistics("cumsum")["model_stats"]
    with triton_grpc.InferenceServerClient(served.grpc_address) as client:
        [grpc] = client.get_inference_statistics("cumsum").model_stats

    requests, items = ONE_ITEM + MULTI, ONE_ITEM + MULTI * ROWS
    stats = http["inference_stats"]
    assert stats["success"]["count"] == requests and stats["fail"]["count"] == 0
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert stats[key]["count"] == requests, key
        assert stats[key]["ns"] > 0, key
    assert stats["success"]["ns"] > stats["queue"]["ns"]
    assert http["inference_count"] == items
    batches = http["batch_stats"]
    assert sum(b["compute_infer"]["count"] for b in batches) == http["execution_count"] > 0
    assert sum(b["batch_size"] * b["compute_input"]["count"] for b in batches) == items
    for b in batches:
        assert b["compute_input"]["count"] == b["compute_infer"]["count"] == b["compute_output"]["count"]
    assert before_ms <= http["last_inference"] <= after_ms

    # gRPC's ModelStatistics says the same.
    assert (grpc.last_inference, grpc.inference_count, grpc.execution_count) == (
        http["last_inference"], http["inference_count"], http["execution_count"],
    )
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        duration = getattr(grpc.inference_stats, key)
        assert {"count": duration.count, "ns": duration.ns} == stats[key], key
    assert [
        (b.batch_size, b.compute_input.count, b.compute_infer.ns, b.compute_output.ns)
        for b in grpc.batch_stats
    ] == [
        (b["batch_size"], b["compute_input"]["count"], b["compute_infer"]["ns"],
         b["compute_output"]["ns"])
        for b in batches
    ]  # fmt: skip
