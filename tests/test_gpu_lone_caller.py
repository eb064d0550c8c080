"""benchmarks/gpu_lone_caller.py: its step timer, and one real run on the CPU
(the tagger and a reduced encoder, each in a child process, served by
``ServedModel.from_repository`` in a thread): every step of a batch is timed
once a request, and the instance's own thread carries the forward's CPU."""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import pytest
import torch
from gpu_lone_caller import Steps, blocking_sync, main, primitives


def test_steps_time_only_while_on_and_count_each_call() -> None:
    steps = Steps()
    slow = steps.timed("slow", lambda: time.sleep(0.01))
    slow()  # off: not counted
    steps.on = True
    slow()
    slow()
    summary = steps.summary(requests=2)
    assert summary["slow"]["calls_per_request"] == 1.0
    assert summary["slow"]["wall_us"] >= 10_000
    assert summary["slow"]["cpu_us"] < summary["slow"]["wall_us"] / 2  # a sleep costs no CPU


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_driver_loads(), reason="a CUDA driver is here: the flag would be set")
def test_blocking_sync_says_why_without_a_driver() -> None:
    why = blocking_sync(0)  # this machine has no libcuda.so.1
    assert why is not None and ("libcuda" in why or "returned" in why)


def test_a_cpu_run_times_every_step_on_the_instance_thread(tmp_path: Path) -> None:
    out = tmp_path / "lone.json"
    assert main(["--device", "cpu", "--requests", "30", "--out", str(out), "--commit", "test"]) == 0
    result = json.loads(out.read_text())
    assert result["partial"] is False and result["commit"] == "test"
    assert [(r["model"], r["variant"]) for r in result["runs"]] == [
        ("tagger", "shipped"),
        ("bert_encoder", "shipped"),
    ]
    for run in result["runs"]:
        assert run["forward"] == "eager"
        for pacing in run["pacing"].values():
            steps = pacing["steps"]
            for name in ("pad (loop)", "unpad (loop)", "launch", "collect",
                         "launch: forward (module)", "launch: outputs to the host"):  # fmt: skip
                assert steps[name]["calls_per_request"] == 1.0, name
            assert steps["launch"]["wall_us"] >= steps["launch: forward (module)"]["wall_us"]
            # The forward's thread is named for the model (ticks of 10 ms: among the busy ones).
            assert f"{run['model']}/0" in [t["thread"] for t in pacing["threads"]]
            assert pacing["p50_us"] > 0 and pacing["process_cpu_us_per_request"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_primitives_are_timed_and_an_events_wait_sleeps() -> None:
    calls = primitives("cuda:0", repeats=5)
    assert len(calls) == 10 and all(c["wall_us"] > 0 for c in calls.values())
    waited = calls["wait 1 ms of GPU: blocking event"]
    assert waited["wall_us"] >= 900  # it waited for the GPU's 1 ms
    assert waited["cpu_us"] < waited["wall_us"] / 2  # asleep, not spinning
