"""The warm-up grid reaches every instance that needs its own warm-up
(serving/warmup.py): each GPU instance runs it, pinned to it in turn, so no
instance pays its CUDA start-up and graph captures on live traffic."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

import pytest
import torch

from tensorserve import ServedModel
from tensorserve.serving import model as served_model
from tensorserve.serving import warmup as warmup_module
from tensorserve.serving.warmup import instance_devices, turn_on, warmed_instances

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


def test_warm_ups_take_turns_on_a_gpu_and_never_wait_on_a_cpu() -> None:
    gpu, other, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    entered = threading.Event()
    with turn_on(gpu, "first"):
        waiter = threading.Thread(target=lambda: _enter(gpu, entered))
        waiter.start()
        assert not entered.wait(0.2)  # the same GPU: it waits for the first warm-up
        with turn_on(other, "other"), turn_on(cpu, "cpu"), turn_on(cpu, "cpu too"):
            pass  # another GPU and the CPU: no wait
    assert entered.wait(10)  # its turn came when the first one ended
    waiter.join(10)


def test_a_turn_held_too_long_is_logged_and_the_warm_up_goes_ahead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(warmup_module, "TURN_WAIT_S", 0.05)
    gpu = torch.device("cuda", 3)
    with (
        turn_on(gpu, "hung"),
        caplog.at_level(logging.WARNING, warmup_module.log.name),
        turn_on(gpu, "next"),
    ):
        pass
    assert [r.getMessage() for r in caplog.records] == [
        "model 'next': another model's warm-up has held cuda:3 for 0 s; warming up alongside it"
    ]
    with turn_on(gpu, "after"):  # the turn was given back once, not twice
        pass


def test_a_model_warms_up_inside_its_gpus_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # The model's CPU instance stands for a GPU one: its grid runs while the turn is held.
    gpu = torch.device("cuda", 7)
    monkeypatch.setattr(served_model, "instance_devices", lambda executor: [gpu])
    model, _ = _recording(instances=1)
    held = []
    model.warm = lambda batch: held.append(warmup_module._turns[gpu].locked())  # type: ignore[method-assign]
    with model:
        model.warmup()
    assert held and all(held)
    assert not warmup_module._turns[gpu].locked()


def _enter(device: torch.device, entered: threading.Event) -> None:
    with turn_on(device, "second"):
        entered.set()
