"""The review of issue 50's CUDA graphs, on the CPU with the capture backend
injected: captures take turns across the process (and no cache is emptied
during one), a failed capture costs its bucket before it costs the model,
a sticky CUDA error in auto's timing is a lost context, graphs switched off
let their memory go, the graphs' pools are not counted as free memory, and
a bucket's first batch (its capture) teaches neither the cost model nor the
watchdog's slowest batch."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tensorserve
from tensorserve.batching.collate import pad
from tensorserve.errors import DeviceLost
from tensorserve.repository.config import ModelConfig, parse_config
from tensorserve.runtime import executor as executor_module
from tensorserve.runtime import graphs, worker_main
from tensorserve.runtime.device import CONTEXT_LOSS
from tensorserve.runtime.executor import Executed, Launched, ThreadExecutor, free_device_bytes
from tensorserve.runtime.graph_buckets import Bucket, ForwardTimings, graph_plan
from tensorserve.runtime.graphs import GraphedForward, GraphSwitch, Replay
from tensorserve.runtime.isolated import ProcessExecutor
from tests.test_scheduler import Clock, ScriptedInstance, scheduler, settle, submit

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)
LOGGER = "tensorserve.runtime.graphs"
STICKY = "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`"
CONFIG = parse_config({
    "max_batch_size": 8,
    "input": [{"name": "x", "dtype": "float32", "shape": [-1], "max_length": 64}],
    "output": [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}],
}, "toy")  # fmt: skip


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class Recording:
    """A backend whose capture takes a while and records how many run at once."""

    reserved_bytes = 0

    def __init__(self, shared: dict[str, int], lock: threading.Lock) -> None:
        self.shared, self.lock = shared, lock

    def capture(self, forward: Callable[[], Any]) -> Replay:
        with self.lock:
            self.shared["now"] += 1
            self.shared["most"] = max(self.shared["most"], self.shared["now"])
        time.sleep(0.05)
        forward()
        with self.lock:
            self.shared["now"] -= 1
        return forward


class Scripted:
    """Captures by calling the forward; fails at the buckets (batch sizes) told."""

    reserved_bytes = 0

    def __init__(self, fails: dict[int, BaseException]) -> None:
        self.fails = fails
        self.tries: list[int] = []

    def capture(self, forward: Callable[[], Any]) -> Replay:
        batch = int(forward().shape[0])  # the eager run before a capture
        self.tries.append(batch)
        if batch in self.fails:
            raise self.fails[batch]
        return forward


def graphed(backend: Any, config: ModelConfig = CONFIG, label: str = "toy") -> GraphedForward:
    switch = GraphSwitch(label, graph_plan(config), measure_first=False)
    return GraphedForward(double, switch, backend, CPU)


def x(batch: int, length: int = 5) -> torch.Tensor:
    return torch.arange(batch * length, dtype=torch.float32).reshape(batch, length)


def y(out: Any) -> torch.Tensor:
    """The output, replayed (sliced, by name) or eager (the model's tensor)."""
    return out["y"] if isinstance(out, dict) else out


@pytest.fixture
def context_loss() -> Iterator[None]:
    yield
    CONTEXT_LOSS.clear()


# ------------------------------------------------------------------ 1: one capture at a time
def test_two_instances_capturing_at_once_take_turns() -> None:
    shared, lock = {"now": 0, "most": 0}, threading.Lock()
    forwards = [graphed(Recording(shared, lock)) for _ in range(2)]  # two models' instances
    start = threading.Barrier(2)
    outputs: list[torch.Tensor] = []

    def run(forward: GraphedForward) -> None:
        start.wait()
        outputs.append(forward(x=x(3)))

    threads = [threading.Thread(target=run, args=(f,)) for f in forwards]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert shared["most"] == 1  # never two captures under way in the process
    assert len(outputs) == 2 and all(torch.equal(y(o), x(3) * 2) for o in outputs)


def test_a_cache_is_not_emptied_while_a_capture_is_under_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emptied = threading.Event()
    monkeypatch.setattr(torch.cuda, "empty_cache", emptied.set)
    with graphs.CAPTURE_LOCK:  # a capture under way
        thread = threading.Thread(target=graphs.empty_cache)
        thread.start()
        assert not emptied.wait(0.1)
    thread.join(5)
    assert emptied.is_set()


def test_the_server_empties_caches_only_through_the_capture_lock() -> None:
    """The out-of-memory path too (executor.py): only ``graphs.empty_cache``
    calls torch's."""
    package = Path(tensorserve.__file__).parent
    calls = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        for line in path.read_text().splitlines()
        if "torch.cuda.empty_cache(" in line.split("#")[0]
    ]
    assert calls == ["runtime/graphs.py"]


# ------------------------------------------------------------------ 2: a failed bucket
def test_a_capture_failure_of_its_own_costs_that_bucket_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    invalidated = RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture (cudaErrorStreamCaptureInvalidated)")  # fmt: skip
    backend = Scripted({4: invalidated, 8: invalidated})
    forward = graphed(backend)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):  # bucket (4, 8): failed once, then eager without a try
            assert torch.equal(y(forward(x=x(3))), x(3) * 2)
        assert backend.tries == [4]
        assert forward.switch.on and forward.switch.eager_buckets == {Bucket(4, (8,))}
        assert torch.equal(y(forward(x=x(2))), x(2) * 2)  # bucket (2, 8): captured, replayed
        assert Bucket(2, (8,)) in forward.graphs
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith("model 'toy': bucket at batch 4, lengths [8] runs eager from now")
        assert "cudaErrorStreamCaptureInvalidated" in line
        assert torch.equal(y(forward(x=x(7))), x(7) * 2)  # a second bucket fails: graphs off
    assert not forward.switch.on
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "'toy' runs eager from now on" in lines[1]
    assert "failed at 2 buckets, the last at batch 8, lengths [8]" in lines[1]
    assert torch.equal(y(forward(x=x(2))), x(2) * 2) and not forward.graphs  # eager, dropped
    assert backend.tries == [4, 2, 8] and len(caplog.records) == 2


def test_a_capture_every_bucket_would_fail_turns_graphs_off_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unsupported = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    backend = Scripted({4: unsupported})
    forward = graphed(backend)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert torch.equal(y(forward(x=x(3))), x(3) * 2)
        forward(x=x(2))
    assert not forward.switch.on and backend.tries == [4]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "runs eager from now on: capturing a CUDA graph at batch 4, lengths [8]" in line


# ------------------------------------------------------------------ 3: a sticky error timing
def test_a_sticky_cuda_error_while_timing_is_raised_not_an_eager_decision() -> None:
    switch = GraphSwitch("toy", graph_plan(CONFIG), measure_first=True)

    def lost() -> ForwardTimings:
        raise RuntimeError(STICKY)

    with pytest.raises(RuntimeError, match="device-side assert"):
        switch.decide(lost)
    assert not switch.on


def test_start_instance_reports_a_sticky_timing_error_as_a_lost_context(
    monkeypatch: pytest.MonkeyPatch, context_loss: None
) -> None:
    config = CONFIG.model_copy(update={"compile": "auto"})
    executor = ThreadExecutor(double, config, CPU, name="toy")
    executor._graphs = GraphSwitch("toy", graph_plan(config), measure_first=True)
    context = executor._contexts[0]
    monkeypatch.setattr(context, "enter_thread", lambda: setattr(context, "stream", object()))
    monkeypatch.setattr(context, "running", lambda: torch.inference_mode())
    monkeypatch.setattr(executor_module, "CudaGraphs", lambda stream: Scripted({}))

    def lost(self: GraphedForward, stream: Any) -> ForwardTimings:
        raise RuntimeError(STICKY)

    monkeypatch.setattr(GraphedForward, "time_eager", lost)
    with pytest.raises(DeviceLost, match="CUDA context of this server process is lost"):
        executor.start_instance(0)
    health = executor.health()
    assert health is not None and "device-side assert triggered" in health


# ------------------------------------------------------------------ 4: memory after off
def test_graphs_switched_off_are_dropped_at_the_next_batch() -> None:
    forward = graphed(Scripted({}))
    forward(x=x(3))
    assert forward.graphs
    forward.switch.turn_off("a replay of the wrong shape elsewhere")
    assert torch.equal(y(forward(x=x(3))), x(3) * 2)
    assert not forward.graphs  # their pool and static buffers can be freed


# ------------------------------------------------------------------ 5: the free estimate
def fake_cuda_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 80_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 900)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 300)


def test_the_free_estimate_leaves_out_the_graphs_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda_memory(monkeypatch)
    assert free_device_bytes(CUDA0) == 1600  # free + cached (reserved - allocated)
    assert free_device_bytes(CUDA0, graphs=250) == 1350
    assert free_device_bytes(CUDA0, graphs=5000) == 1000  # never below the device's free


def test_the_executor_subtracts_its_instances_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda_memory(monkeypatch)
    executor = ThreadExecutor(double, CONFIG, CPU, name="toy", instance_count=2)
    for context in executor._contexts:
        context.device = CUDA0
    backends = [Scripted({}), Scripted({})]
    for instance, backend in enumerate(backends):
        backend.reserved_bytes = 100 * (instance + 1)
        executor._forwards[instance] = graphed(backend)
    assert executor.free_memory_bytes() == 1600  # nothing captured yet: nothing held
    for forward in executor._forwards.values():
        forward(x=x(3))
    assert executor.free_memory_bytes() == 1600 - 300


# ------------------------------------------------------------------ 6: the capture's time
def test_the_batch_that_captured_is_marked_and_the_next_is_not() -> None:
    executor = ThreadExecutor(double, CONFIG, CPU, name="toy")
    executor._forwards[0] = graphed(Scripted({}))
    executor.start_instance(0)
    batch = pad([{"x": np.ones(4, np.float32)}] * 3, CONFIG.input)
    first = executor.collect(executor.launch(batch.features, 0))
    again = executor.collect(executor.launch(batch.features, 0))
    assert first.captured and not again.captured
    assert first.batched is not None and first.batched["y"].tolist() == [[2.0] * 4] * 3


def test_a_capturing_batch_teaches_neither_the_cost_model_nor_the_slowest_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.new_event_loop()
    try:
        instance, clock = ScriptedInstance(), Clock()
        batcher = scheduler(loop, instance, clock, max_batch_size=2)
        learnt: list[float | None] = []
        cost = batcher.scheduler.results.cost
        monkeypatch.setattr(cost, "observe", lambda n, longest, s: learnt.append(s))
        for seconds, captured in ((4.0, True), (0.01, False)):
            futures = submit(loop, batcher, 1.0, 2.0)
            settle(loop, batcher.scheduler.wake)
            sent = instance.sent[-1]
            outputs = Executed({"y": sent.x * 2}, None, seconds, captured=captured)
            settle(loop, lambda sent=sent, outputs=outputs: sent.done(outputs, None))
            assert [f.result()["y"][0] for f in futures] == [2.0, 4.0]
        assert learnt == [0.01]
        assert batcher.scheduler.slowest_s == pytest.approx(0.01, rel=0.01)
    finally:
        loop.close()


@pytest.mark.parametrize("captured", [True, False])
def test_a_workers_reply_carries_the_capture_mark_to_the_server(captured: bool) -> None:
    """isolation = "process": the worker's reply header (worker_main._finish)
    and the server's reading of it (ProcessExecutor._executed)."""
    executor = ThreadExecutor(double, CONFIG, CPU, name="toy")
    launched = Launched({"y": torch.ones(2, 3)}, None, None, seconds=0.5, captured=captured)
    started = worker_main.Started(launched, None, time.perf_counter())
    header, tensors = worker_main._finish(executor, started)
    reader = types.SimpleNamespace(outputs=CONFIG.output)
    executed = ProcessExecutor._executed(reader, (header, tensors))  # type: ignore[arg-type]
    assert executed.captured is captured and executed.seconds is not None
