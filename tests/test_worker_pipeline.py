"""A worker process's batches: on CUDA two in flight, inputs staged in pinned
memory; on a CPU one at a time (runtime/worker_pipeline.py, worker_main.py).

    the order             a waiting batch is launched before the one ahead
                          is collected; replies go out in order, each once;
                          never more than two in flight; a batch not yet
                          sent is never waited for
    a CPU                 one batch at a time; the socket is never polled
    errors                a model error, out of memory or row errors in one
                          of two batches in flight answer that batch only; a
                          lost CUDA context leaves the loop (the worker exits)
    the socket's end      with two in flight: the worker ends, no reply
    the server's count    a CUDA worker that dies: both batches it held may
                          have run (suspects), those behind them never ran
    on a GPU              real rows with two in flight; pinned input copies
"""

from __future__ import annotations

import socket
import threading
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tensorserve.errors import DeviceLost, RowErrors, WorkerCrashed
from tensorserve.ipc import messages as ipc
from tensorserve.repository.config import ModelConfig, parse_config
from tensorserve.runtime import worker_main
from tensorserve.runtime.device import resolve_device
from tensorserve.runtime.executor import ThreadExecutor
from tensorserve.runtime.worker_pipeline import CUDA_BATCHES_IN_FLIGHT, WorkerPorts, serve
from tensorserve.runtime.worker_process import SOCKET_BUFFER_BYTES, Lost
from tensorserve.tensors.results import WithParameters
from tests.helpers import ECHO, answers_of_a_dead_worker, write_toy_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CONFIG = {
    "max_batch_size": 8,
    "input": [{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": 0.0}],
    "output": [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}],
}


class ScriptedWorker:
    """A worker's ports over a made-up socket: ``arrived(i)`` says whether
    batch ``i`` has arrived by the time the worker asks; the log records
    every step, and ``held`` the batches launched and not yet collected."""

    def __init__(
        self, batches: int, arrived: Callable[[int], bool] = lambda i: True, *, hangs_up: int = -1
    ) -> None:
        self.batches = batches
        self.arrived = arrived
        # The server closes its end after this many replies (-1: after all).
        self.hangs_up = batches if hangs_up < 0 else hangs_up
        self.next = 0
        self.log: list[str] = []
        self.held = 0
        self.most_held = 0
        self.polls = 0
        self.sent: list[int] = []

    def ports(self) -> WorkerPorts[int]:
        return WorkerPorts(self.recv, self.waiting, self.launch, self.collect, self.send)

    def waiting(self) -> bool:
        self.polls += 1
        if self.next >= self.batches:  # the end is readable too
            return len(self.sent) >= self.hangs_up
        return self.arrived(self.next)

    def recv(self) -> ipc.Message:
        if self.next >= self.batches:
            raise EOFError("the other end closed the connection")
        self.next += 1
        return {}, {"i": np.array([self.next - 1])}

    def launch(self, message: ipc.Message) -> int:
        i = int(message[1]["i"][0])
        self.held += 1
        self.most_held = max(self.most_held, self.held)
        self.log.append(f"launch {i}")
        return i

    def collect(self, i: int) -> ipc.Message:
        self.held -= 1
        self.log.append(f"collect {i}")
        return {"i": i}, {}

    def send(self, reply: ipc.Message) -> None:
        self.sent.append(reply[0]["i"])


def test_a_waiting_batch_is_launched_before_the_one_ahead_is_collected() -> None:
    worker = ScriptedWorker(4)
    serve(worker.ports(), CUDA_BATCHES_IN_FLIGHT)
    assert worker.log == [
        "launch 0", "launch 1", "collect 0", "launch 2", "collect 1", "launch 3", "collect 2",
        "collect 3",
    ]  # fmt: skip
    assert worker.sent == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(5))
def test_replies_go_out_in_order_each_once_and_never_more_than_two_in_flight(seed: int) -> None:
    rng = np.random.default_rng(seed)
    worker = ScriptedWorker(60, lambda i: bool(rng.random() < 0.6))
    serve(worker.ports(), CUDA_BATCHES_IN_FLIGHT)
    assert worker.sent == list(range(60))
    assert worker.most_held == 2
    assert worker.held == 0


def test_a_batch_not_yet_sent_is_never_waited_for() -> None:
    worker = ScriptedWorker(3, lambda i: False)  # each comes only once the one before is answered
    serve(worker.ports(), CUDA_BATCHES_IN_FLIGHT)
    assert worker.log == ["launch 0", "collect 0", "launch 1", "collect 1", "launch 2", "collect 2"]
    assert worker.sent == [0, 1, 2]


def test_on_a_cpu_one_batch_at_a_time_and_the_socket_is_never_polled() -> None:
    worker = ScriptedWorker(3)  # all three waiting
    serve(worker.ports(), 1)
    assert worker.log == ["launch 0", "collect 0", "launch 1", "collect 1", "launch 2", "collect 2"]
    assert worker.polls == 0 and worker.most_held == 1


def test_the_socket_closing_with_two_in_flight_ends_the_worker_without_replies() -> None:
    worker = ScriptedWorker(2, hangs_up=1)  # then EOF, while batch 1 is still in flight
    serve(worker.ports(), CUDA_BATCHES_IN_FLIGHT)
    assert worker.sent == [0]  # batch 1's reply has no reader: the server is gone
    assert worker.log[-1] == "collect 0"


def test_a_stop_or_a_broken_pipe_with_two_in_flight_ends_the_worker() -> None:
    stopping = ScriptedWorker(2)
    recv = stopping.recv
    stopping.recv = lambda: ({"stop": True}, {}) if stopping.next == 1 else recv()  # type: ignore[method-assign]
    serve(stopping.ports(), CUDA_BATCHES_IN_FLIGHT)
    assert stopping.log == ["launch 0"] and stopping.sent == []

    broken = ScriptedWorker(5)

    def send(reply: ipc.Message) -> None:
        raise BrokenPipeError("the server has gone")

    broken.send = send  # type: ignore[method-assign]
    serve(broken.ports(), CUDA_BATCHES_IN_FLIGHT)
    assert broken.log == ["launch 0", "launch 1", "collect 0"]


def test_a_lost_cuda_context_leaves_the_loop_with_both_batches_unanswered() -> None:
    worker = ScriptedWorker(4)
    collect = worker.collect

    def lost(i: int) -> ipc.Message:
        if i == 1:
            raise DeviceLost("model 'm': a device-side assert")
        return collect(i)

    worker.collect = lost  # type: ignore[method-assign]
    with pytest.raises(DeviceLost):
        serve(worker.ports(), CUDA_BATCHES_IN_FLIGHT)
    assert worker.sent == [0]  # 1 and 2 were in flight: the server fails or reruns them
    assert worker.log[-1] == "launch 2"


# ------------------------------------------- worker_main's own steps, on this CPU
def _executor(fn: Callable[..., Any], *, overlaps: bool) -> tuple[ModelConfig, ThreadExecutor]:
    """A CPU executor; ``overlaps`` pretends its launch only queues the batch
    (as on CUDA), so worker_main takes two batches at once on this CPU."""
    config = parse_config(CONFIG, "m")
    executor = ThreadExecutor(fn, config, torch.device("cpu"), name="m")
    executor.overlaps = overlaps
    return config, executor


def _trouble(x: torch.Tensor) -> Any:
    """x * 2, unless the batch's first value asks for a failure."""
    first = float(x[0, 0])
    if first == -1:
        raise ValueError("a batch this model cannot take")
    if first == -2:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    if first == -3:
        raise RowErrors({1: "row one is bad"})
    if first == -4:  # output parameters that collect refuses
        return WithParameters(x * 2, "not one value per row")  # type: ignore[arg-type]
    return x * 2


def _messages(
    config: ModelConfig, executor: ThreadExecutor, firsts: list[float]
) -> tuple[list[dict[str, Any]], list[dict[str, np.ndarray]]]:
    """Each batch of ``firsts`` through ``serve`` at depth 2, all waiting at once."""
    batches: deque[ipc.Message] = deque(
        ({}, {"x": np.array([[first, 1.0], [2.0, 3.0]], np.float32)}) for first in firsts
    )
    replies: list[ipc.Message] = []

    def recv() -> ipc.Message:
        if not batches:
            raise EOFError("the other end closed the connection")
        return batches.popleft()

    ports = WorkerPorts(
        recv=recv,
        waiting=lambda: bool(batches) or len(replies) == len(firsts),  # then the end
        launch=lambda m: worker_main._start(config, executor, m[1], None),
        collect=lambda started: worker_main._finish(executor, started),
        send=replies.append,
    )
    serve(ports, CUDA_BATCHES_IN_FLIGHT)
    return [header for header, _ in replies], [tensors for _, tensors in replies]


def test_an_error_in_one_of_two_batches_in_flight_answers_that_batch_only() -> None:
    config, executor = _executor(_trouble, overlaps=True)
    headers, tensors = _messages(config, executor, [1, -1, 2, -2, 3, -3, 4, -4, 5])
    assert [h.get("kind", "error" if "error" in h else "ok") for h in headers] == [
        "ok", "error", "ok", "oom", "ok", "rows", "ok", "error", "ok",
    ]  # fmt: skip
    assert "a batch this model cannot take" in headers[1]["error"]
    assert headers[5]["rows"] == [(1, "row one is bad")]
    assert "WithParameters.parameters" in headers[7]["error"]
    for i, first in [(0, 1), (2, 2), (4, 3), (6, 4), (8, 5)]:
        assert tensors[i]["y"].tolist() == [[2 * first, 2.0], [4.0, 6.0]]
        assert headers[i]["seconds"] >= 0


def test_a_lost_context_in_a_batch_is_raised_for_the_worker_to_exit() -> None:
    def lost(x: torch.Tensor) -> torch.Tensor:
        raise DeviceLost("model 'm': the CUDA context is lost")

    config, executor = _executor(lost, overlaps=True)
    with pytest.raises(DeviceLost):
        _messages(config, executor, [1, 2])


def _through_a_socket(
    config: ModelConfig, executor: ThreadExecutor, batches: list[np.ndarray]
) -> tuple[list[ipc.Message], list[str]]:
    """``_load_and_run`` on a thread, over a real socketpair, with every batch
    sent before it starts: the replies, and the order of launches and collects."""
    order: list[str] = []
    launch, collect = executor.launch, executor.collect

    def launching(features: Any, *args: Any) -> Any:
        order.append("launch")
        return launch(features, *args)

    def collecting(launched: Any) -> Any:
        order.append("collect")
        return collect(launched)

    executor.launch = launching  # type: ignore[method-assign,assignment]
    executor.collect = collecting  # type: ignore[method-assign,assignment]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in (ours, theirs):  # every batch fits in before the worker reads one
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    for batch in batches:
        ipc.send(ours, {}, {"x": batch})
    hello = {"batches_in_flight": CUDA_BATCHES_IN_FLIGHT}
    returned: list[int] = []
    worker = threading.Thread(
        target=lambda: returned.append(worker_main._load_and_run(theirs, hello, (config, executor)))
    )
    worker.start()
    try:
        assert ipc.recv(ours)[0]["ready"]
        replies = [ipc.recv(ours) for _ in batches]
    finally:
        ours.close()
        worker.join(30)
        theirs.close()
    assert returned == [0]  # the socket's end: the worker returns, nothing raised
    return replies, order


def test_a_worker_whose_launch_only_queues_takes_a_waiting_batch_through_its_socket() -> None:
    config, executor = _executor(lambda x: x * 2, overlaps=True)
    batches = [np.full((2, 3), i, np.float32) for i in range(5)]
    replies, order = _through_a_socket(config, executor, batches)
    assert [r[1]["y"].tolist() for r in replies] == [(2 * b).tolist() for b in batches]
    assert order[:3] == ["launch", "launch", "collect"]


def test_a_cpu_worker_runs_one_batch_at_a_time_even_with_batches_waiting() -> None:
    config, executor = _executor(lambda x: x * 2, overlaps=False)  # a CPU ThreadExecutor's own
    batches = [np.full((2, 3), i, np.float32) for i in range(4)]
    replies, order = _through_a_socket(config, executor, batches)
    assert [r[1]["y"].tolist() for r in replies] == [(2 * b).tolist() for b in batches]
    assert order == ["launch", "collect"] * 4


# ------------------------------------------------------------ the server's count
@pytest.mark.parametrize(
    ("in_flight", "watchdog", "ran", "behind"),
    [
        (1, False, [True, False, False], [False, False, False]),
        # A crash: the batch launched behind the oldest may have caused it.
        (2, False, [True, True, False], [False, True, False]),
        # The watchdog killed it: the next may be the one that blocked the host.
        (2, True, [True, True, False], [False, True, False]),
    ],
)
def test_a_dead_cuda_worker_had_both_its_batches_running_and_none_behind_them(
    in_flight: int,
    watchdog: bool,
    ran: list[bool],
    behind: list[bool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def report(self: Lost) -> WorkerCrashed:
        if self.sock is not None:
            self.sock.close()
        return WorkerCrashed(
            "model 'm': the worker process died (exit code 70)", ran=True, watchdog=watchdog
        )

    monkeypatch.setattr(Lost, "report", report)

    answers = answers_of_a_dead_worker({"batches_in_flight": in_flight})
    assert [len(a) for a in answers] == [1, 1, 1]
    errors = [a[0] for a in answers]
    assert all(isinstance(e, WorkerCrashed) for e in errors)
    assert [e.ran for e in errors] == ran  # type: ignore[union-attr]
    assert [e.behind for e in errors] == behind  # type: ignore[union-attr]
    assert [e.watchdog for e in errors] == [watchdog, False, False]  # type: ignore[union-attr]
    assert len({id(e) for e in errors}) == 3  # each batch its own exception


@pytest.mark.parametrize(("device", "in_flight"), [("cpu", 1), ("cuda:0", 2)])
def test_the_server_tells_a_worker_how_many_batches_it_may_hold(
    device: str, in_flight: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorserve.repository.loader import ModelSource
    from tensorserve.runtime import isolated

    write_toy_model(tmp_path, "m", "import torch\nModel = torch.nn.Identity\n", **ECHO)
    config = parse_config({**CONFIG, "platform": "pytorch_tensorserve"}, "m")
    monkeypatch.setattr(isolated, "resolve_device", lambda name: torch.device(device))
    executor = isolated.ProcessExecutor(ModelSource("m", tmp_path / "m", (1,)), 1, config)
    # The worker reads it from its hello; the server counts with the same one.
    assert executor.hello["batches_in_flight"] == in_flight
    assert all(worker.hello is executor.hello for worker in executor.workers)


# ---------------------------------------------------------------------- on a real GPU
@pytest.mark.cuda
@needs_cuda
def test_on_cuda_a_worker_answers_equal_rows_with_two_batches_in_flight() -> None:
    config = parse_config(CONFIG, "m")
    executor = ThreadExecutor(lambda x: torch.cumsum(x, 1) * 2, config, resolve_device("cuda"))
    assert executor.overlaps and executor.pin_memory
    rng = np.random.default_rng(3)
    batches = [rng.normal(size=(8, 1024)).astype(np.float32) for _ in range(6)]
    replies, order = _through_a_socket(config, executor, batches)
    for batch, (header, tensors) in zip(batches, replies):
        want = np.cumsum(batch, 1) * 2
        np.testing.assert_allclose(tensors["y"], want, rtol=1e-4, atol=1e-3)
        assert 0 < header["seconds"] < 5  # the GPU's time between the batch's events
    assert order[:3] == ["launch", "launch", "collect"]


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_a_workers_input_copies_are_pinned() -> None:
    from torch.profiler import ProfilerActivity, profile

    config = parse_config(CONFIG, "m")
    executor = ThreadExecutor(lambda x: x * 2, config, resolve_device("cuda"))
    found: dict[str, Any] = {}

    def run() -> None:  # a thread of its own, as a worker's main thread runs it
        executor.start_instance(0)
        features = {"x": np.ones((8, 1024), np.float32)}  # as ipc.recv gives it: pageable
        for _ in range(2):  # lazy initialisation stays out
            worker_main._run_batch(config, executor, features, None)
        torch.cuda.synchronize()
        # The profiler warns that it clears its events each cycle: not this test's news.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                found["reply"] = worker_main._run_batch(config, executor, features, None)
        torch.cuda.synchronize()
        names = [e.name.lower() for e in prof.events()]
        found["names"] = [name for name in names if name.startswith("memcpy")]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert found["reply"][1]["y"].tolist() == (2 * np.ones((8, 1024))).tolist()
    # One copy per input, from pinned memory: "Memcpy HtoD (Pinned -> Device)".
    to_device = [n for n in found["names"] if "htod" in n]
    assert len(to_device) == 1 and "pinned -> device" in to_device[0], found["names"]
    to_host = [n for n in found["names"] if "dtoh" in n]
    assert len(to_host) == 1 and "device -> pinned" in to_host[0], found["names"]
    assert not [n for n in found["names"] if "pageable" in n], found["names"]


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_a_worker_process_serves_concurrent_callers_the_rows_of_a_thread() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tensorserve import ServedModel
    from tests.conftest import REPOSITORY
    from tests.helpers import token_item

    rng = np.random.default_rng(5)
    items = [token_item(int(n), rng) for n in rng.integers(8, 128, size=120)]
    with ServedModel.from_repository(REPOSITORY, "tagger", device="cpu") as here:
        expected = here.infer_many_sync(items)
    with (
        ServedModel.from_repository(
            REPOSITORY, "tagger", device="cuda", isolation="process", max_batch_tokens=512
        ) as isolated,
        ThreadPoolExecutor(32) as pool,
    ):
        got = list(pool.map(isolated.infer_sync, items))
        assert isolated.stats.snapshot(0)["total_batches"] > 5
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a["logits"], b["logits"], rtol=2e-3, atol=2e-3)
