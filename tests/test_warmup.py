"""The warm-up grid reaches every instance that needs its own warm-up
(serving/warmup.py): each GPU instance runs it, pinned to it in turn, so no
instance pays its CUDA start-up and graph captures on live traffic."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import torch

from tensorserve import ServedModel
from tensorserve.serving import model as served_model
from tensorserve.serving.warmup import instance_devices, warmed_instances

SPEC: dict[str, Any] = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [-1]}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": [-1]}],
}


def _recording(device: str = "cpu", instances: int = 2) -> tuple[ServedModel, Counter[str]]:
    """A model whose every batch counts the instance thread that ran it."""
    ran: Counter[str] = Counter()

    def fn(x: torch.Tensor) -> torch.Tensor:
        ran[threading.current_thread().name.rsplit("-", 1)[-1]] += 1
        return x * 2

    model = ServedModel.from_function(
        fn, **SPEC, max_batch_size=4, instance_count=instances, device=device,
        warmup={"lengths": [3, 7]},
    )  # fmt: skip
    return model, ran


def test_each_gpu_instance_runs_the_grid_and_the_first_cpu_one_alone() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert warmed_instances([cuda, torch.device("cuda", 1)]) == [0, 1]
    assert warmed_instances([cuda, cuda]) == [0, 1]  # a stream and graphs each
    assert warmed_instances([cpu, cpu]) == [0]
    assert warmed_instances([cpu, cuda]) == [0, 1]


def test_a_warm_up_pinned_to_each_instance_runs_the_whole_grid_on_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both CPU instances stand for GPU ones: each must run every grid batch.
    monkeypatch.setattr(served_model, "warmed_instances", lambda devices: [0, 1])
    model, ran = _recording()
    with model:
        assert len(instance_devices(model.executor)) == 2
        grid = len(model.warmup_items())
        model.warmup()
        assert ran == {"0": grid, "1": grid}
        assert model.batcher.scheduler.pinned is None  # unpinned after
        ran.clear()  # traffic still goes to any instance
        model.infer_many_sync([{"x": torch.ones(3).numpy()}] * 2, timeout=30)
        assert sum(ran.values()) >= 1


def test_on_the_cpu_only_the_first_instance_is_warmed() -> None:
    model, ran = _recording()
    with model:
        grid = len(model.warmup_items())
        model.warmup()
    assert ran == {"0": grid}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_every_instance_runs_the_grid() -> None:  # pragma: no cover - GPUs only
    model, ran = _recording("cuda", instances=2)
    with model:
        grid = len(model.warmup_items())
        model.warmup()
    assert ran == {"0": grid, "1": grid}
