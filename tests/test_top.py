"""``tensorserve top``: one frame (``--once``) against a real server process
after known traffic, and the rates from two reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tensorserve.top import Reading, cells, rows
from tests.conftest import ROOT, ServerProcess
from tests.helpers import ECHO, POISON_MODEL, write_toy_model


def oip(fill: float, width: int = 4) -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2, width],
                        "data": [fill] * 2 * width}]}


@pytest.mark.timeout(90)
def test_one_frame_shows_each_model_with_its_numbers(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO)
    server = ServerProcess(tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            infer = "/v2/models/echo/infer"
            assert [client.post(infer, json=oip(1.0)).status_code for _ in range(3)] == [200] * 3
            assert [client.post(infer, json=oip(1.0, 3)).status_code for _ in range(2)] == [400] * 2
            assert client.post(infer, json=oip(13.0)).status_code == 500
            assert client.post("/v2/models/nope/infer", json=oip(1.0)).status_code == 404
            stats = client.get("/v2/models/echo/stats").json()["batching"]
        frame = subprocess.run(
            [sys.executable, "-m", "tensorserve", "top", "--url", server.url, "--once",
             "--interval", "0.2"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )
    finally:
        server.stop()
    assert frame.returncode == 0, frame.stderr
    lines = {line.split()[1]: line for line in frame.stdout.splitlines() if line.startswith("│")}
    echo = [cell.strip() for cell in lines["echo"].strip("│").split("│")]
    recent = stats["recent"]
    assert echo == [
        "echo", "READY", "0.0", "0.0", f"{recent['p50_ms']:.2f}", f"{recent['p99_ms']:.2f}",
        f"{stats['avg_batch_size']:.2f}", f"{recent['padding_efficiency']:.3f}", "0",
        "-", "invalid_input 2, model_failure 1",
    ]
    assert "unknown_model 1" in lines["_unknown"]


def test_rates_come_from_two_reads() -> None:
    def reading(at: float, requests: float, items: float) -> Reading:
        samples = {
            "tensorserve_requests_total": [
                ({"model": "m", "version": "1", "code": "ok"}, requests),
                ({"model": "m", "version": "1", "code": "server_busy"}, 4.0),
            ],
            "tensorserve_batch_items_total": [({"model": "m", "version": "1"}, items)],
            "tensorserve_rejections_total": [({"model": "m", "reason": "queue_full"}, 4.0)],
        }
        stats = {"m": {"total_batches": 5, "avg_batch_size": 2.5, "queue_depth": 3,
                       "recent": {"items": 0}}}
        return Reading(at, samples, {"m": "READY"}, json.loads(json.dumps(stats)))

    (row,) = rows(reading(10.0, 100, 300), reading(12.0, 140, 400))
    assert cells(row) == ["m", "READY", "20.0", "50.0", "-", "-", "2.50", "-", "3", "-",
                          "queue_full 4"]
    (first,) = rows(None, reading(12.0, 140, 400))
    assert first.requests_per_s is None and cells(first)[2] == "-"


def test_a_model_with_a_latency_target_shows_what_it_achieves_against_it() -> None:
    stats = {"m": {"total_batches": 5, "avg_batch_size": 2.5, "queue_depth": 0,
                   "recent": {"items": 0},
                   "latency_target": {"target_p99_ms": 150.0, "achieved_p99_ms": 121.4,
                                      "batch_cap": 12}}}
    samples = {"tensorserve_rejections_total": [({"model": "m", "reason": "would_miss_target"}, 7.0)]}
    (row,) = rows(None, Reading(1.0, samples, {"m": "READY"}, stats))
    assert cells(row)[9:] == ["121/150 ms, cap 12", "would_miss_target 7"]
