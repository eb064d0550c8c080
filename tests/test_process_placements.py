"""``isolation = "process"`` over several devices: one worker per instance,
each told its own placement's device, and a replacement (a restart or that
device's standby) keeps it. The mapping is checked with made-up GPUs on the
CPU, a real model with two CPU placements serves from two workers, and real
GPUs are checked where there are two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tensorserve import ServedModel
from tensorserve.repository.config import parse_config
from tensorserve.repository.loader import ModelSource
from tensorserve.runtime import isolated
from tensorserve.runtime.isolated import ProcessExecutor, instance_devices
from tensorserve.runtime.kinds import ExecutorRequest, build_executor
from tensorserve.runtime.placement import Placement
from tests.helpers import toy_config, write_model, write_toy_model

SPEC = {
    "inputs": {"x": {"dtype": "float32", "shape": [-1]}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1]}},
}
DOUBLE = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return x * 2
"""
THREE = [Placement("cuda:0", 2), Placement("cuda:1", 1)]


def _config(**fields: Any) -> Any:
    return parse_config(
        {
            "input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
            "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
            "isolation": "process",
            **fields,
        },
        "m",
    )


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device names resolve without CUDA (nothing here starts a worker)."""
    monkeypatch.setattr(isolated, "resolve_device", torch.device)


def _executor(tmp_path: Path, placements: list[Placement], **faults: Any) -> ProcessExecutor:
    write_toy_model(tmp_path, "m", DOUBLE, isolation="process", **SPEC)
    source = ModelSource("m", tmp_path / "m", (1,))
    groups = [{"kind": "KIND_GPU", "gpus": [0, 1]}]
    return ProcessExecutor(source, 1, _config(instance_group=groups, faults=faults),
                           placements=placements)  # fmt: skip


def test_instance_i_is_the_i_th_of_the_placements_instances() -> None:
    assert instance_devices(_config(), THREE) == ["cuda:0", "cuda:0", "cuda:1"]
    assert instance_devices(_config(device="cpu", instance_count=2), None) == ["cpu", "cpu"]


def test_each_worker_is_told_its_own_device(tmp_path: Path, fake_gpus: None) -> None:
    executor = _executor(tmp_path, THREE)
    assert executor.instance_count == 3
    told = [worker.hello["config"] for worker in executor.workers]
    assert [c["device"] for c in told] == ["cuda:0", "cuda:0", "cuda:1"]
    assert all(c["instance_group"] == [] for c in told)  # each worker: one device
    assert [c["instance_count"] for c in told] == [2, 2, 1]
    assert executor.workers[2].label == "model 'm' instance 2 on cuda:1"
    assert {w.hello["key"] for w in executor.workers} == {executor.key}  # one model
    assert executor.standbys == {}  # on a GPU no spare by default


class Spare(isolated.WorkerProcess):
    pid = 4242  # a loaded spare's, for the log line  # type: ignore[assignment]


class FakeStandby:
    def __init__(self, spare: object) -> None:
        self.spare = spare
        self.taken = 0

    def take(self) -> object:
        self.taken += 1
        return self.spare


def test_a_replacement_keeps_the_dead_workers_device(
    tmp_path: Path, fake_gpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = _executor(tmp_path, THREE, standby_worker=True)
    assert [s.hello["config"]["device"] for s in executor.standbys.values()] == [
        "cuda:0",
        "cuda:1",
    ]  # one spare per device, each loaded for its device
    spare_for = {device: Spare(executor.hellos[device], "spare")
                 for device in executor.hellos}  # fmt: skip
    fakes = {device: FakeStandby(spare) for device, spare in spare_for.items()}
    monkeypatch.setattr(executor, "standbys", fakes)
    executor.repair(2)  # never started: a dead worker
    assert executor.workers[2] is spare_for["cuda:1"]
    assert (fakes["cuda:0"].taken, fakes["cuda:1"].taken) == (0, 1)
    assert executor.workers[2].label == "model 'm' instance 2 on cuda:1"
    # Without a spare the worker starts again with its own hello.
    started: list[str] = []
    monkeypatch.setattr(executor, "standbys", {})
    monkeypatch.setattr(
        isolated.WorkerProcess, "start", lambda self: started.append(self.hello["config"]["device"])
    )
    executor.repair(1)
    assert started == ["cuda:0"]


def test_on_one_device_the_worker_gets_the_models_own_config(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "m", DOUBLE, isolation="process", **SPEC)
    source = ModelSource("m", tmp_path / "m", (1,))
    config = _config(device="cpu", instance_count=2)
    executor = ProcessExecutor(source, 1, config, placements=[Placement("cpu", 2)])
    assert executor.device_of == ["cpu", "cpu"]
    assert executor.hello["config"] == config.model_dump(mode="json")
    assert list(executor.standbys) == ["cpu"]  # on the CPU a spare by default, as before


def test_two_placements_serve_from_a_worker_each(tmp_path: Path) -> None:
    """Two "devices" that happen to be the CPU: the path two GPUs take."""
    write_toy_model(tmp_path, "m", DOUBLE, isolation="process", max_batch_size=4,
                    warmup={"enabled": False}, **SPEC)  # fmt: skip
    source = ModelSource("m", tmp_path / "m", (1,))
    config = _config(device="cpu", max_batch_size=4, warmup={"enabled": False},
                     faults={"standby_worker": False})  # fmt: skip
    placements = [Placement("cpu", 1), Placement("cpu", 1)]
    built = build_executor("process", ExecutorRequest("m", config, placements, 1, source=source))
    executor = built.executor
    assert isinstance(executor, ProcessExecutor)
    with ServedModel("m", config, None, executor=executor) as model:
        pids = [worker.pid for worker in executor.workers]
        assert len(set(pids)) == 2 and None not in pids
        rows = [model.infer_sync({"x": np.full(3, v, np.float32)}, timeout=60) for v in (1, 2)]
    assert [r["y"].tolist() for r in rows] == [[2, 2, 2], [4, 4, 4]]


DEVICE_INDEX = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return torch.full_like(x, float(x.device.index))
"""


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_worker_processes_on_two_gpus(tmp_path: Path) -> None:  # pragma: no cover - GPUs only
    text = toy_config(SPEC["inputs"], SPEC["outputs"], isolation="process", max_batch_size=1,
                      weights="init", warmup={"enabled": False})  # fmt: skip
    text += '[[instance_group]]\ncount = 1\nkind = "KIND_GPU"\ngpus = [0, 1]\n'
    write_model(tmp_path, "where", text, DEVICE_INDEX)
    with ServedModel.from_repository(tmp_path, "where") as model:
        assert model.executor.device_of == ["cuda:0", "cuda:1"]  # type: ignore[union-attr]
        assert model.devices == ["cuda:0", "cuda:1"]
        seen = _gpus_answering(model)
    assert seen == {0.0, 1.0}  # each worker ran on its own GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_auto_in_processes_puts_a_worker_on_every_gpu(
    tmp_path: Path,
) -> None:  # pragma: no cover
    write_toy_model(tmp_path, "where", DEVICE_INDEX, isolation="process", device="auto",
                    max_batch_size=1, weights="init", warmup={"enabled": False},
                    **SPEC)  # fmt: skip
    with ServedModel.from_repository(tmp_path, "where") as model:
        gpus = torch.cuda.device_count()
        expected = [f"cuda:{g}" for g in range(gpus)]
        assert getattr(model.executor, "device_of", None) == expected
        assert model.infer_sync({"x": np.ones(2, np.float32)})["y"][0].item() in range(gpus)


def test_a_worker_selects_its_gpu_before_model_py_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor model.py creates on a bare "cuda" lands on the worker's GPU."""
    from tensorserve.runtime import worker_main

    order: list[str] = []

    class Loaded(Exception):
        pass

    def load_model(*args: Any) -> Any:
        order.append("load_model")
        raise Loaded

    monkeypatch.setattr(worker_main, "resolve_device", torch.device)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: order.append(f"set {device}"))
    monkeypatch.setattr(worker_main, "load_model", load_model)
    for device, expected in (("cuda:1", ["set cuda:1", "load_model"]), ("cpu", ["load_model"])):
        order.clear()
        hello = {"name": "m", "path": str(tmp_path / "m"), "version": 1, "intra_op_threads": 1,
                 "config": _config(device=device).model_dump(mode="json")}  # fmt: skip
        with pytest.raises(Loaded):
            worker_main._load(hello)
        assert order == expected


MADE_ON = """
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.made_on = float(torch.zeros(1, device="cuda").device.index)

        def forward(self, x):
            return torch.full_like(x, self.made_on)
"""


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_model_py_on_a_bare_cuda_runs_on_each_workers_gpu(
    tmp_path: Path,
) -> None:  # pragma: no cover - GPUs only
    text = toy_config(SPEC["inputs"], SPEC["outputs"], isolation="process", max_batch_size=1,
                      weights="init", warmup={"enabled": False})  # fmt: skip
    text += '[[instance_group]]\ncount = 1\nkind = "KIND_GPU"\ngpus = [0, 1]\n'
    write_model(tmp_path, "made_on", text, MADE_ON)
    with ServedModel.from_repository(tmp_path, "made_on") as model:
        seen = _gpus_answering(model)
    assert seen == {0.0, 1.0}  # not both on GPU 0


def _gpus_answering(model: Any) -> set[float]:
    """The GPU indices the model's answers came from (each worker answers with
    its own), over up to 20 rounds of 8 callers, until both GPUs answered."""
    seen: set[float] = set()
    for _ in range(20):
        futures = model.submit_many([{"x": np.ones(2, np.float32)} for _ in range(8)])
        seen |= {f.result(60)["y"][0].item() for f in futures}
        if seen == {0.0, 1.0}:
            break
    return seen
