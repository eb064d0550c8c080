"""The warm-up grid reaches every instance that needs its own warm-up
(serving/warmup.py): each GPU instance runs it, pinned to it in turn, so no
instance pays its CUDA start-up and graph captures on live traffic."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorserve import ServedModel
from tensorserve.serving import model as served_model
from tensorserve.serving import registry as registry_module
from tensorserve.serving import warmup as warmup_module
from tensorserve.serving.entries import ModelState
from tensorserve.serving.registry import ModelRegistry
from tensorserve.serving.warmup import instance_devices, turns_on, warmed_instances
from tests.helpers import ECHO, POISON_MODEL, write_toy_model

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


def test_models_take_turns_on_a_gpu_and_never_wait_on_a_cpu() -> None:
    gpu, other, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    entered = threading.Event()
    with turns_on([gpu, gpu, cpu], "first"):
        waiter = threading.Thread(target=lambda: _enter([gpu], entered))
        waiter.start()
        assert not entered.wait(0.2)  # the same GPU: it waits for the first model
        with turns_on([other, cpu], "other"), turns_on([cpu], "cpu"), turns_on([cpu], "too"):
            pass  # another GPU and the CPU: no wait
    assert entered.wait(10)  # its turn came when the first one ended
    waiter.join(10)


def test_a_turn_held_too_long_is_logged_and_the_next_model_goes_ahead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(warmup_module, "TURN_WAIT_S", 0.3)
    gpu = torch.device("cuda", 3)
    with (
        turns_on([gpu], "hung"),
        caplog.at_level(logging.WARNING, warmup_module.log.name),
        turns_on([gpu], "next"),
    ):
        assert warmup_module._turns[gpu].holder == "hung"  # "next" went ahead without it
    assert [r.getMessage() for r in caplog.records] == [
        "model 'next': model 'hung' has been starting on cuda:3 for 0 s; starting alongside it"
    ]
    with turns_on([gpu], "after"):  # given back once: free at once
        assert warmup_module._turns[gpu].holder == "after"


def test_the_wait_is_for_one_holder_not_the_whole_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two models ahead, each holding the turn for less than the limit: the third
    # waits for both in turn (the limit restarts with each holder) and never goes alongside.
    monkeypatch.setattr(warmup_module, "TURN_WAIT_S", 0.6)
    gpu, order = torch.device("cuda", 4), []
    first_in, second_waits = threading.Event(), threading.Event()

    def hold(name: str, seconds: float, started: threading.Event | None = None) -> None:
        with turns_on([gpu], name):
            order.append(name)
            if started is not None:
                started.set()
            time.sleep(seconds)  # a model's start and warm-up, held this long

    first = threading.Thread(target=hold, args=("a", 0.4, first_in))
    first.start()
    assert first_in.wait(10)
    second = threading.Thread(target=hold, args=("b", 0.4, second_waits))
    second.start()
    with turns_on([gpu], "c"):  # 0.8 s behind two holders of 0.4 s each: its turn
        order.append("c")
    first.join(10)
    second.join(10)
    assert order in (["a", "b", "c"], ["a", "c", "b"])  # c never ran alongside another
    assert warmup_module._turns[gpu].holder is None


def test_the_registry_starts_and_warms_a_model_inside_its_gpus_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The model's CPU instance stands for a GPU one: its start and its warm-up
    # both run while the registry holds that GPU's turn.
    gpu = torch.device("cuda", 7)
    monkeypatch.setattr(registry_module, "instance_devices", lambda executor: [gpu])
    write_toy_model(tmp_path, "toy", POISON_MODEL, **ECHO, warmup={"lengths": [3]})
    held: list[str | None] = []
    for method in ("start", "warmup"):
        original = getattr(ServedModel, method)

        def spy(self: ServedModel, *args: Any, _original: Any = original) -> Any:
            held.append(warmup_module._turns[gpu].holder)
            return _original(self, *args)

        monkeypatch.setattr(ServedModel, method, spy)
    registry = ModelRegistry(tmp_path)
    asyncio.run(registry.load_all())
    try:
        assert registry.entries["toy"].state is ModelState.READY
        assert held == ["toy", "toy"]  # start, then warm-up, both in the turn
        assert warmup_module._turns[gpu].holder is None  # given back after
    finally:
        registry.entries["toy"].served.close()  # type: ignore[union-attr]


def _enter(devices: list[torch.device], entered: threading.Event) -> None:
    with turns_on(devices, "second"):
        entered.set()
