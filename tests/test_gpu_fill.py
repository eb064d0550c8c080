"""benchmarks/gpu_fill.py: the pure parts (length-sorted batches, the long
tail, the issue's targets, the busiest threads), and one real run with
``--device cpu --models tagger``: perf_analyzer against a real server on
loopback over HTTP and gRPC, its JSON read back with a fill figure for every
point. CI also runs the whole CPU version (.ci/run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FILL = ROOT / "benchmarks" / "gpu_fill.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_fill import LONG_TAIL, UNIFORM, draw_lengths, fill_rows, targets
from gpu_fill_ceiling import sorted_batches
from gpu_fill_served import busiest_threads, thread_cpu


def test_sorted_batches_are_full_padded_to_their_own_longest_item() -> None:
    ids = [np.arange(1, n + 1) for n in (5, 1, 9, 3, 7)]
    batches, padded_share = sorted_batches(ids, 2)
    assert [b.shape for b in batches] == [(2, 3), (2, 7), (1, 9)]
    assert batches[0].tolist() == [[1, 0, 0], [1, 2, 3]]
    assert padded_share == pytest.approx((2 + 2 + 0) / (6 + 14 + 9))


def test_lengths_uniform_and_long_tail_stay_in_bounds() -> None:
    rng = np.random.default_rng(0)
    uniform, tail = draw_lengths(UNIFORM, rng), draw_lengths(LONG_TAIL, rng)
    assert uniform.min() >= 8 and uniform.max() <= 128
    assert tail.min() >= 8 and tail.max() <= 512 and tail.max() > 256
    assert np.median(tail) < np.mean(tail)  # a long tail: most are short


def test_targets_are_judged_against_the_issues_thresholds() -> None:
    points = [
        {"model": "tagger", "protocol": "http", "concurrency": 256, "lengths": UNIFORM,
         "workload": "t", "items_per_s": 900.0},
        {"model": "tagger", "protocol": "grpc", "concurrency": 256, "lengths": UNIFORM,
         "workload": "t", "items_per_s": 700.0},
        {"model": "tagger", "protocol": "http", "concurrency": 1, "lengths": UNIFORM,
         "workload": "t", "items_per_s": 50.0, "p50_us": 1600},
    ]  # fmt: skip
    fill_rows(points, {"t": {"items_per_s": 1000.0}})
    assert [p["fill"] for p in points] == [0.9, 0.7, 0.05]
    judged = {t["target"]: t["met"] for t in targets(points)}
    assert judged["tagger fill at c=256 over http >= 0.8"] is True
    assert judged["tagger fill at c=256 over grpc >= 0.8"] is False
    assert judged["tagger p50 at c=1 over http <= 1.5 ms"] is False
    assert judged["embedder fill at c=256 over http >= 0.8"] is None  # not measured


def test_busiest_threads_ranks_cpu_per_request() -> None:
    before = {(1, 1): ("main", 1.0), (1, 2): ("loop", 2.0)}
    after = {(1, 1): ("main", 1.5), (1, 2): ("loop", 2.1), (2, 3): ("worker", 0.2)}
    rows = busiest_threads(before, after, 100, {1: "scheduler", 2: "worker"})
    assert [(r["thread"], r["cpu_us_per_request"]) for r in rows] == [
        ("main", 5000.0), ("worker", 2000.0), ("loop", 1000.0)]
    mine = thread_cpu([os.getpid()])
    assert (os.getpid(), os.getpid()) in mine  # the main thread's tid is the pid


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_fill_on_cpu_measures_fill_over_http_and_grpc(tmp_path: Path) -> None:
    out = tmp_path / "gpu_fill_cpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(FILL), "--device", "cpu", "--models", "tagger", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False,
    )
    assert out.is_file(), f"no JSON (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    result = json.loads(out.read_text())
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert {"device", "driver", "cuda", "torch", "commit", "date"} <= set(result)
    assert result["partial"] is False and result["device"].startswith("cpu")
    ceiling = result["ceilings"]["tagger (uniform 8..128)"]
    assert ceiling["items_per_s"] > 0 and ceiling["timer"] == "wall clock"
    points = {(p["protocol"], p["concurrency"]): p for p in result["points"]}
    assert set(points) == {("http", 16), ("grpc", 16), ("http", 1), ("grpc", 1)}
    for p in points.values():
        assert "error" not in p, p
        assert p["items_per_s"] > 0 and p["requests"] > 0
        assert p["fill"] == pytest.approx(p["items_per_s"] / ceiling["items_per_s"], rel=1e-2)
        assert p["p50_us"] <= p["p99_us"]
        cpu = p["cpu_us_per_request"]
        assert cpu["scheduler"] > 0 and cpu["workers"] > 0  # the tagger runs in a worker
        assert cpu["total"] == pytest.approx(cpu["scheduler"] + cpu["frontend"] + cpu["workers"],
                                             abs=0.5)  # fmt: skip
    assert points[("http", 1)]["busiest_threads"]
    for p in points.values():  # how the server batched each point, from its own counters
        batching = p["batching"]
        assert batching["mean_batch"] >= 1 and 0 < batching["padding_efficiency"] <= 1
        assert batching["batch_items_per_s"] > 0
    assert points[("http", 1)]["batching"]["mean_batch"] == 1.0  # one caller, one item
    assert points[("http", 16)]["batching"]["mean_batch"] > 1
    assert result["targets"] == []  # judged on CUDA only
    # At the image's log level: the startup line says how many front ends, and why.
    assert any("frontends=default → 1 (no GPU visible)" in n for n in result["server_notes"])
    assert "fill" in run.stdout and "items/s" in run.stdout  # the table
