"""A worker-killing item among 15 good ones, against a real server with a
flat-cost (GPU-like) model in a worker process: recovery searches the batch
in halves, every good caller gets its own rows, the killer gets its 500, and
the workers killed on the way stay within the bound of a search in halves
(docs/reliability.md, "Finding the item that crashed a worker")."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess
from tests.helpers import ECHO, MSGPACK, body, from_wire, write_toy_model

pytestmark = pytest.mark.timeout(180)

# 200 ms a forward whatever the batch, as a GPU's; an item holding 7 kills
# its worker before the forward starts.
FLAT_CRASHY = """
    import os, time, torch

    class Model(torch.nn.Module):
        def forward(self, x):
            if (x == 7).any():
                os._exit(7)
            time.sleep(0.2)
            return x * 2
"""
BATCH = 16
# Everything sent at once forms one batch: the timer waits 1 s for company.
CONFIG: dict[str, Any] = {
    **ECHO, "max_batch_size": BATCH, "isolation": "process",
    "dynamic_batching": {"max_queue_delay_ms": 1000.0, "dispatch": "timer"},
}
KILLER = 7.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    repo: Path = tmp_path_factory.mktemp("flat_crashy")
    write_toy_model(repo, "flat", FLAT_CRASHY, **CONFIG)
    process = ServerProcess(repo)
    yield process
    process.stop()


def _x(value: float) -> np.ndarray:
    # Lengths 1-5 rows, so a row from another caller or a wrong slice shows.
    return np.full((1 + int(value) % 5, 4), value, np.float32)


def _infer(url: str, value: float) -> tuple[int, Any]:
    reply = httpx.post(f"{url}/v2/models/flat/infer", content=body([{"x": _x(value)}]),
                       headers=MSGPACK, timeout=60)
    decoded = msgpack.unpackb(reply.content)
    if reply.status_code != 200:
        return reply.status_code, decoded  # {"error": message, "code": ...}
    return 200, from_wire(decoded["outputs"][0]["y"]).tolist()


def _together(url: str, values: list[float]) -> list[tuple[int, Any]]:
    with ThreadPoolExecutor(len(values)) as pool:
        return list(pool.map(lambda v: _infer(url, v), values))


def _restarts(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        sample.value for family in text_string_to_metric_families(text)
        for sample in family.samples if sample.name == "tensorserve_worker_restarts_total"
    )


def _batching(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v2/models/flat/stats").json()["batching"]


def test_a_worker_killer_among_good_items_is_found_in_halves_and_only_it_fails(
    server: ServerProcess,
) -> None:
    url = server.url
    # Teach the cost model batches of several sizes (each group is one batch).
    for size in (1, 2, 4, 8, 16):
        values = [float(v) for v in range(20, 20 + size)]
        assert _together(url, values) == [(200, (2 * _x(v)).tolist()) for v in values]
    # A killer alone: it kills two workers (it may not be the cause the first
    # time) and is then refused; the restarts' time is measured.
    code, error = _infer(url, KILLER)
    assert code == 500 and error["code"] == "model_failure"
    assert error["error"].startswith("model 'flat': this item crashed the model's worker process")
    before, stats_before = _restarts(url), _batching(url)

    good = [float(v) for v in range(40, 40 + BATCH - 1)]
    results = _together(url, [*good[:5], KILLER, *good[5:]])

    assert [r for i, r in enumerate(results) if i != 5] == [(200, (2 * _x(v)).tolist()) for v in good]
    code, error = results[5]
    assert code == 500 and error["code"] == "model_failure"
    assert error["error"].startswith("model 'flat': this item crashed the model's worker process")
    stats = _batching(url)
    recoveries = stats["recoveries"]
    assert recoveries.get("halves", 0) > stats_before["recoveries"].get("halves", 0)
    # Deaths: the batch, then at most one per level of halving (the culprit
    # alone being the last); one at a time would have cost two, but 16 forwards.
    killed = _restarts(url) - before
    assert 2 <= killed <= 1 + math.ceil(math.log2(BATCH))
    assert stats["total_batches"] - stats_before["total_batches"] < 1 + BATCH
    assert httpx.get(f"{url}/v2/models/flat/ready").status_code == 200
