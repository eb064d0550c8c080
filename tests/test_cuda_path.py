"""The CUDA path's logic, checked on this CPU machine wherever it can be
reached without a GPU (each test here fails without its fix), and the real
thing under ``@pytest.mark.cuda`` where a GPU exists.

    an index-less cuda device       resolve_device gives cuda:N; set_device gets it
    a sticky CUDA error             thread: the batch fails, the model is not ready,
                                    the server not live; worker: it exits, is
                                    replaced, and only the culprit fails
    reads of a batch's results      wait for the batch's event first
    a batch's time                  the forward's own (CUDA events; on a CPU the host
                                    clock around launch), not launch-to-collect
    a torch.export program          its graph rewritten for the device
    a traced TorchScript file       refused when its code pins another device
    an ONNX session                 its own providers checked, not the package's
    the memory ceiling              grows only into memory free on the device
    a standby worker                none on a GPU by default
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tensorserve import ServedModel
from tensorserve.batching.recovery import MemoryCeiling
from tensorserve.errors import ConfigError, DeviceLost, ModelFailure
from tensorserve.repository.config import parse_config
from tensorserve.repository.onnx_model import provider_problem
from tensorserve.repository.torchscript_model import FileModel, load_torchscript, pinned_devices
from tensorserve.runtime import device as device_module
from tensorserve.runtime.device import (
    CONTEXT_LOSS,
    DeviceContext,
    resolve_device,
    sticky_cuda_error,
)
from tensorserve.runtime.executor import Launched, ThreadExecutor
from tensorserve.serving.liveness import Liveness
from tensorserve.tensors.results import RowResult
from tests.conftest import ServerProcess
from tests.helpers import MSGPACK, body, wait_until, write_toy_model

pytestmark = pytest.mark.timeout(180)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

DEVICE_ASSERT = (
    "CUDA error: device-side assert triggered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect."
)


@pytest.fixture(autouse=True)
def working_context() -> Iterator[None]:
    """Each test starts, as a new process would, with a working CUDA context."""
    CONTEXT_LOSS.clear()
    yield
    CONTEXT_LOSS.clear()


# ---------------------------------------------------------------------- device choice
class FakeCuda:
    """torch.cuda as a 2-GPU machine shows it, recording set_device; like
    torch, set_device refuses a device without an index."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered: list[torch.device] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "current_device", self.initialises_cuda)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: ("stream", device))

    @staticmethod
    def initialises_cuda() -> int:
        raise AssertionError("current_device() initialises CUDA in the server process")

    def set_device(self, device: torch.device) -> None:
        if device.index is None:  # torch 2.13's own check
            raise ValueError(
                f"Expected a torch.device with a specified index or an integer, but got:{device}"
            )
        self.entered.append(device)


def test_auto_and_a_bare_cuda_resolve_to_an_indexed_device(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"device 'cuda:2' requested but only 2 GPU\(s\) exist"):
        resolve_device("cuda:2")


def test_a_model_thread_enters_the_device_that_auto_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch)
    for name in ("auto", "cuda"):
        context = DeviceContext(resolve_device(name))
        context.enter_thread()  # raised ValueError for every model at "auto" before
    assert cuda.entered == [torch.device("cuda", 0)] * 2


# ---------------------------------------------------------------------- sticky CUDA errors
@pytest.mark.parametrize(("error", "sticky"), [
    (RuntimeError(DEVICE_ASSERT), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    (torch.AcceleratorError("CUDA error: unspecified launch failure"), True),
    (RuntimeError("CUDA error: out of memory"), False),  # a batch's own problem
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("index out of range in self"), False),  # the CPU's clean error
    (ValueError("device-side assert triggered"), False),  # not torch's
])  # fmt: skip
def test_which_errors_lose_the_cuda_context(error: BaseException, sticky: bool) -> None:
    reason = sticky_cuda_error(error)
    assert (reason is not None) == sticky
    if sticky:
        assert reason is not None and "\n" not in reason and "CUDA error" in reason


X_IN = [{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": 0.0}]
Y_OUT = [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}]
ONE_BATCH = {"max_batch_size": 8, "max_queue_delay_ms": 300, "dispatch": "timer"}


def _asserting(calls: list[int]) -> Any:
    """y = 2x; a batch holding 66 fails as a device-side assert does on CUDA."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if (x == 66).any():
            raise RuntimeError(DEVICE_ASSERT)
        return x * 2

    return fn


def _outcomes(model: ServedModel, values: Sequence[float]) -> list[object]:
    results: list[object] = []
    for future in model.submit_many([{"x": np.full(3, v, np.float32)} for v in values]):
        try:
            results.append(float(future.result(60)["y"][0]))
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            results.append(exc)
    return results


def test_a_sticky_error_in_a_thread_fails_its_batch_and_then_the_model_for_good(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []
    model = ServedModel.from_function(_asserting(calls), inputs=X_IN, outputs=Y_OUT, **ONE_BATCH)
    with model, caplog.at_level(logging.ERROR, logger="tensorserve.runtime.device"):
        assert model.health() is None
        results = _outcomes(model, [1.0, 66.0, 3.0, 4.0])
        # Nothing is split and run again: every run would fail the same way.
        assert calls == [4]
        for result in results:
            assert isinstance(result, DeviceLost)
            assert result.message.startswith(
                "model 'function': the CUDA context of this server process is lost "
                "(model 'function' met RuntimeError: CUDA error: device-side assert triggered); "
                "only a restart recovers it, so readiness and liveness fail"
            )
        assert "CUDA context of this server process is lost" in (model.health() or "")
        assert Liveness.context_lost() is not None
        # A later batch fails at once, without running on the broken context.
        [later] = _outcomes(model, [5.0])
        assert isinstance(later, DeviceLost) and calls == [4]
    logged = [r.getMessage() for r in caplog.records if "CUDA context" in r.getMessage()]
    assert len(logged) == 1  # once, not per batch
    assert "readiness and liveness fail" in logged[0]


ASSERTING_MODEL = f"""
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            if (x == 66).any():
                raise RuntimeError({DEVICE_ASSERT!r})
            return x * 2
"""
ECHO_1D = {
    "inputs": {"x": {"dtype": "float32", "shape": [-1]}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1]}},
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_ms": 300.0, "dispatch": "timer"},
    "warmup": {"enabled": False},
}


def test_a_sticky_error_in_a_worker_replaces_it_and_fails_only_the_culprit(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "asserting", ASSERTING_MODEL, isolation="process", **ECHO_1D)
    with ServedModel.from_repository(tmp_path, "asserting") as model:
        first = model.executor.workers[0].pid  # type: ignore[attr-defined]
        results = _outcomes(model, [1.0, 2.0, 66.0, 4.0])
        assert model.executor.workers[0].pid != first  # type: ignore[attr-defined]
        assert model.health() is None  # the replacement has a fresh context
        assert model.infer_sync({"x": np.full(3, 7.0, np.float32)})["y"].tolist() == [14.0] * 3
    assert [results[i] for i in (0, 1, 3)] == [2.0, 4.0, 8.0]
    failed = results[2]
    assert isinstance(failed, ModelFailure) and not isinstance(failed, DeviceLost)
    assert "(exit code 70: a sticky CUDA error lost its CUDA context)" in failed.message
    assert CONTEXT_LOSS.reason is None  # the server's own context was never touched


def test_a_lost_context_makes_a_real_server_not_ready_and_not_live(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "asserting", ASSERTING_MODEL, **ECHO_1D)
    log = tmp_path / "server.log"
    server = ServerProcess(tmp_path, "--shutdown-grace-s", "1", log=log)
    try:
        assert httpx.get(f"{server.url}/v2/health/live").json() == {"live": True}
        assert "tensorserve_cuda_context_lost 0.0" in httpx.get(f"{server.url}/metrics").text
        item = {"x": np.full(3, 66.0, np.float32)}
        reply = httpx.post(
            f"{server.url}/v2/models/asserting/infer",
            content=body([item]),
            headers=MSGPACK,
            timeout=60,
        )
        assert reply.status_code == 500
        live = httpx.get(f"{server.url}/v2/health/live")
        assert live.status_code == 503
        assert live.json()["reason"].startswith(
            "the CUDA context of this process is lost (model 'asserting' met RuntimeError: CUDA "
            "error: device-side assert triggered); only a restart recovers it"
        )
        assert httpx.get(f"{server.url}/v2/health/ready").status_code == 503
        assert "tensorserve_cuda_context_lost 1.0" in httpx.get(f"{server.url}/metrics").text
        lines = [line for line in log.read_text().splitlines() if "CUDA context" in line]
        assert any("the CUDA context of this process is lost" in line for line in lines)
    finally:
        server.stop(grace=5)


# ---------------------------------------------------------------------- stream-ordered reads
class RecordedEvent:
    """A CUDA event as collect sees it: synchronize and elapsed_time, logged."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def elapsed_time(self, end: RecordedEvent) -> float:
        return 12.5  # ms


class ReadLogged(Sequence[float]):
    """Per-row values whose every read is logged (as .tolist() would read)."""

    def __init__(self, values: list[float], log: list[str]) -> None:
        self.values, self.log = values, log

    def __len__(self) -> int:
        self.log.append("read")
        return len(self.values)

    def __getitem__(self, index: Any) -> Any:
        self.log.append("read")
        return self.values[index]


def _executor() -> ThreadExecutor:
    config = parse_config({"max_batch_size": 8, "input": X_IN, "output": Y_OUT}, "m")
    return ThreadExecutor(lambda x: x, config, torch.device("cpu"))


def test_output_parameters_and_per_item_results_are_read_after_the_batch_event() -> None:
    log: list[str] = []
    norms = ReadLogged([1.0, 2.0], log)
    launched = Launched(
        None,
        RecordedEvent(log),
        [{"y": torch.ones(3)}, {"y": torch.ones(2)}],  # type: ignore[arg-type]
        {"norm": norms},
        started=RecordedEvent(log),
    )  # type: ignore[arg-type]
    executed = _executor().collect(launched)
    assert log[0] == "synchronize" and "read" in log[1:]
    assert executed.parameters == {"norm": [1.0, 2.0]}
    assert executed.seconds == pytest.approx(0.0125)  # from the two events


def test_a_batch_time_is_the_forward_not_the_wait_before_collect() -> None:
    def slow(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x * 2

    config = parse_config({"max_batch_size": 8, "input": X_IN, "output": Y_OUT}, "m")
    executor = ThreadExecutor(slow, config, torch.device("cpu"))
    launched = executor.launch({"x": torch.ones(2, 3)}, 0)
    time.sleep(0.3)  # a batch launched ahead, collected later
    seconds = executor.collect(launched).seconds
    assert seconds is not None and 0.05 <= seconds < 0.3


class TimingRuleEvent:
    """torch.cuda.Event as CUDA builds of torch 2.13 behave: ``elapsed_time``
    raises unless both events were created with ``enable_timing=True``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.enable_timing, self.blocking = enable_timing, blocking
        self.stream: object = None

    def record(self, stream: object = None) -> None:
        self.stream = stream

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: TimingRuleEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        return 3.0  # ms


def test_a_batch_time_can_be_read_off_the_instance_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CUDA batch failed in collect before: its events were not timing."""
    monkeypatch.setattr(torch.cuda, "Event", TimingRuleEvent)
    context = DeviceContext(torch.device("cpu"))
    context.stream = "the instance's stream"  # type: ignore[assignment]
    started, done = context.record(), context.record()
    executed = _executor().collect(Launched(None, done, [], started=started))
    assert executed.seconds == pytest.approx(0.003)
    assert started.blocking and done.blocking  # waiting sleeps, it does not spin
    assert done.stream == "the instance's stream"


def test_output_parameters_on_the_device_are_queued_for_the_host_before_the_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA a ``.tolist()`` in collect made one more blocking copy into
    pageable memory per output parameter; now each is queued into pinned
    memory with the outputs, before the batch's event (the meta device stands
    in for the GPU: no pinned memory exists on a CPU build)."""
    from tensorserve import WithParameters

    log: list[str] = []

    class LoggedEvent(TimingRuleEvent):
        def record(self, stream: object = None) -> None:
            log.append("event")

    def pinned_copy(self: DeviceContext, t: torch.Tensor) -> torch.Tensor:
        log.append(f"copy {list(t.shape)}")
        return torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape)

    monkeypatch.setattr(torch.cuda, "Event", LoggedEvent)
    monkeypatch.setattr(DeviceContext, "_pinned_copy", pinned_copy)
    config = parse_config({"max_batch_size": 8, "input": X_IN, "output": Y_OUT}, "m")
    executor = ThreadExecutor(
        lambda x: WithParameters({"y": x * 2}, {"first": x[:, 0], "tag": ["a", "b"]}),
        config, torch.device("meta"))  # fmt: skip
    executor._contexts[0].stream = "the instance's stream"  # type: ignore[assignment]
    launched = executor.launch({"x": torch.ones(2, 3)}, 0)
    assert log == ["event", "copy [2]", "copy [2, 3]", "event"]  # started, parameter, output, done
    executed = executor.collect(launched)
    assert executed.parameters == {"first": [0.0, 1.0], "tag": ["a", "b"]}


# ---------------------------------------------------------------------- model files
class Positions(torch.nn.Module):
    """docs/export-a-model.md's pattern: positions made inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1])
        return self.embed(input_ids) + positions[None, :, None]


FILE_CONFIG = {
    "platform": "pytorch_libtorch", "max_batch_size": 8,
    "input": [{"name": "input_ids", "dtype": "int64", "shape": [-1]}],
    "output": [{"name": "out", "dtype": "float32", "shape": [-1, 4]}],
}  # fmt: skip


def _graph_devices(module: torch.nn.Module) -> set[str]:
    graph = getattr(module, "graph", None)
    assert isinstance(graph, torch.fx.Graph)
    return {
        str(node.kwargs["device"])
        for node in graph.nodes
        if node.op == "call_function" and "device" in node.kwargs
    }


def _exported_positions() -> torch.export.ExportedProgram:
    """``Positions`` exported with a dynamic batch and length, as a model.pt2 is."""
    ids = torch.randint(0, 16, (2, 5))
    batch = torch.export.Dim("batch", min=1, max=8)
    length = torch.export.Dim("length", min=2, max=64)
    return torch.export.export(Positions(), (ids,), dynamic_shapes=({0: batch, 1: length},))


def test_an_exported_program_is_rewritten_for_its_device(tmp_path: Path) -> None:
    program = _exported_positions()
    torch.export.save(program, tmp_path / "model.pt2")
    config = parse_config(FILE_CONFIG, "positions")
    model = load_torchscript(tmp_path / "model.pt2", config, "positions/1/model.pt2")
    assert "cpu" in _graph_devices(model.program)  # what torch.export recorded
    moved = model.to(torch.device("meta"))
    assert _graph_devices(moved.program) == {"meta"}  # nn.Module.to left it on cpu


def test_an_exported_program_loads_where_warnings_are_errors(tmp_path: Path, monkeypatch) -> None:
    """torch 2.11 (the GPU image's) warns while it loads a .pt2 that its weights'
    buffer is not writable; under pytest's filterwarnings = error, as under
    ``python -W error``, that warning refused a good model (seen on an H100)."""
    torch.export.save(_exported_positions(), tmp_path / "model.pt2")
    real_load = torch.export.load

    def load_as_torch_2_11_does(path: str) -> torch.export.ExportedProgram:
        warnings.warn(
            "The given buffer is not writable, and PyTorch does not support non-writable tensors.",
            UserWarning,
            stacklevel=2,
        )
        return real_load(path)

    monkeypatch.setattr(torch.export, "load", load_as_torch_2_11_does)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_torchscript(
            tmp_path / "model.pt2", parse_config(FILE_CONFIG, "positions"), "p"
        )
    assert isinstance(model, FileModel)
    with warnings.catch_warnings(), pytest.raises(UserWarning, match="not writable"):
        warnings.simplefilter("error")
        load_as_torch_2_11_does(str(tmp_path / "model.pt2"))  # the stand-in does warn


def test_a_traced_file_that_pins_a_device_is_refused_off_that_device(tmp_path: Path) -> None:
    traced = torch.jit.trace(Positions(), (torch.randint(0, 16, (2, 5)),))
    assert pinned_devices(traced) == {"cpu"}
    traced.save(str(tmp_path / "model.pt"))
    config = parse_config(FILE_CONFIG, "positions")
    model = load_torchscript(tmp_path / "model.pt", config, "positions/1/model.pt")
    assert isinstance(model, FileModel)
    assert model.to(torch.device("cpu")) is model  # where it was traced: fine
    with pytest.raises(
        ConfigError,
        match=r"^positions/1/model.pt: the TorchScript program "
        r"hard-codes device cpu in its code",
    ):
        model.to(torch.device("meta"))


def test_an_onnx_session_on_cuda_is_judged_by_its_own_providers() -> None:
    assert provider_problem(["CUDAExecutionProvider", "CPUExecutionProvider"], "cuda") is None
    problem = provider_problem(["CPUExecutionProvider"], "cuda")
    assert problem is not None and problem.startswith(
        "device = 'cuda': ONNX Runtime could not start its CUDA execution provider for this "
        "session (it runs on CPUExecutionProvider)"
    )


# ---------------------------------------------------------------------- memory
def test_the_memory_ceiling_grows_only_into_memory_freed_since_it_ran_out() -> None:
    free = [1_000]
    ceiling = MemoryCeiling(lambda: free[0])
    ceiling.ran_out(4_000)
    assert ceiling.limit == 2_000
    for _ in range(MemoryCeiling.GROW_AFTER):
        grown = ceiling.fitted()
    assert not grown and ceiling.limit == 2_000  # no more free than when it ran out
    free[0] = 2_000  # another process let go of memory
    for _ in range(MemoryCeiling.GROW_AFTER):
        grown = ceiling.fitted()
    assert grown and ceiling.limit == 2_501
    blind = MemoryCeiling()  # a CPU: nothing to ask, it grows as before
    blind.ran_out(4_000)
    assert any(blind.fitted() for _ in range(MemoryCeiling.GROW_AFTER))


def test_no_standby_worker_holds_a_second_cuda_context_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorserve.repository.loader import ModelSource
    from tensorserve.runtime import isolated

    write_toy_model(tmp_path, "m", ASSERTING_MODEL, isolation="process", **ECHO_1D)
    source = ModelSource("m", tmp_path / "m", (1,))

    def executor(device: str, **faults: object) -> isolated.ProcessExecutor:
        config = parse_config(
            {
                **FILE_CONFIG,
                "platform": "pytorch_tensorserve",
                "input": X_IN,
                "output": Y_OUT,
                "faults": faults,
            },
            "m",
        )
        monkeypatch.setattr(isolated, "resolve_device", lambda name: torch.device(device))
        return isolated.ProcessExecutor(source, 1, config)

    assert executor("cpu").standby is not None
    assert executor("cuda:0").standby is None
    assert executor("cuda:0", standby_worker=True).standby is not None


# ---------------------------------------------------------------------- on a real GPU
EMBED_IDS_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 4)

        def forward(self, x):
            return self.embed(x.long()).sum(-1)
"""
# weights = "init": the embedding's own random values (no weights file to write).
IDS_ON_CUDA = {**ECHO_1D, "inputs": {"x": {"dtype": "int64", "shape": [-1]}}, "device": "cuda",
               "weights": "init"}


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_a_device_side_assert_in_a_worker_fails_only_its_culprit(tmp_path: Path) -> None:
    """An id past the embedding on CUDA, without the host range check."""
    write_toy_model(tmp_path, "ids", EMBED_IDS_MODEL, isolation="process", **IDS_ON_CUDA)
    with ServedModel.from_repository(tmp_path, "ids") as model:
        futures = model.submit_many(
            [{"x": np.array([1, 2, 3])}, {"x": np.array([99, 1, 1])}, {"x": np.array([4, 5, 6])}]
        )
        outcomes: list[object] = []
        for future in futures:
            try:
                outcomes.append(future.result(120)["y"].shape)
            except ModelFailure as exc:
                outcomes.append(exc)
        assert outcomes[0] == (3,) and outcomes[2] == (3,)
        assert isinstance(outcomes[1], ModelFailure)
        wait_until(lambda: model.health() is None, "the worker replaced", 60)


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_a_device_side_assert_in_a_thread_takes_its_server_down(tmp_path: Path) -> None:
    """The same in a model thread, in a server process of its own: the assert
    ruins its process's CUDA context for good, which in this test process
    would fail every CUDA test after it."""
    write_toy_model(tmp_path, "ids", EMBED_IDS_MODEL, isolation="thread", **IDS_ON_CUDA)
    server = ServerProcess(tmp_path, "--shutdown-grace-s", "1", log=tmp_path / "server.log")
    try:
        items = [{"x": np.array([1, 2, 3])}, {"x": np.array([99, 1, 1])}]
        reply = httpx.post(
            f"{server.url}/v2/models/ids/infer", content=body(items), headers=MSGPACK, timeout=120
        )
        assert reply.status_code == 500
        live = httpx.get(f"{server.url}/v2/health/live")
        assert live.status_code == 503
        assert "device-side assert triggered" in live.json()["reason"]
        assert httpx.get(f"{server.url}/v2/health/ready").status_code == 503
    finally:
        server.stop(grace=5)


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_output_parameters_are_never_stale() -> None:
    from tensorserve import WithParameters

    def fn(x: torch.Tensor) -> Any:
        y = x * 2
        for _ in range(20):  # enough queued work that a read on another stream races it
            y = torch.sin(y) + y - torch.sin(y)
        return WithParameters({"y": y}, {"first": y[:, 0]})

    model = ServedModel.from_function(
        fn, inputs=X_IN, outputs=Y_OUT, device="cuda", max_batch_size=8
    )
    busy = torch.cuda.Stream()
    stop = threading.Event()

    def keep_busy() -> None:
        a = torch.randn(2048, 2048, device="cuda")
        with torch.cuda.stream(busy):
            while not stop.is_set():
                a = a @ a / 2048

    worker = threading.Thread(target=keep_busy, daemon=True)
    with model:
        worker.start()
        try:
            for round_ in range(200):
                value = float(round_ % 17 + 1)
                row = model.infer_sync({"x": np.full(4, value, np.float32)})
                assert isinstance(row, RowResult)
                assert row.parameters["first"] == pytest.approx(2 * value)
                assert row["y"].tolist() == pytest.approx([2 * value] * 4)
        finally:
            stop.set()
            worker.join()


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_an_exported_program_with_positions_runs(tmp_path: Path) -> None:
    ids = torch.randint(0, 16, (2, 5))
    torch.export.save(_exported_positions(), tmp_path / "model.pt2")
    config = parse_config(FILE_CONFIG, "positions")
    model = load_torchscript(tmp_path / "model.pt2", config, "p").to(torch.device("cuda", 0))
    out = model(input_ids=ids.cuda())["out"]
    assert out.device.type == "cuda"
    assert device_module.CONTEXT_LOSS.reason is None


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_a_batch_runs_and_its_time_is_the_gpu_time() -> None:
    config = parse_config({"max_batch_size": 8, "input": X_IN, "output": Y_OUT}, "m")
    executor = ThreadExecutor(lambda x: x * 2, config, resolve_device("cuda"))
    executor.start_instance(0)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).pin_memory()
    executed = executor.collect(executor.launch({"x": x}, 0))
    assert executed.batched is not None
    assert executed.batched["y"].tolist() == (x * 2).tolist()
    assert executed.seconds is not None and 0 < executed.seconds < 5


def test_exported_programs_load_on_parallel_threads(tmp_path: Path) -> None:
    """The registry loads models on parallel threads; torch.export.load alone
    fails there ("_CURRENT_DESERIALIZER is already set")."""
    program = _exported_positions()
    config = parse_config(FILE_CONFIG, "positions")
    paths = []
    for i in range(6):
        paths.append(tmp_path / f"{i}" / "model.pt2")
        paths[-1].parent.mkdir()
        torch.export.save(program, paths[-1])
    start, errors = threading.Barrier(len(paths)), []

    def load(path: Path) -> None:
        start.wait()
        try:
            load_torchscript(path, config, str(path))
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(path,)) for path in paths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
