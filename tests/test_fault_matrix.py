"""The fault matrix: every way in x every executor kind x every fault.

For each cell it asserts that every caller is answered exactly once within a
bound, with its own row or the error its fault deserves; that nothing
answered runs again (each forward logs the rows it ran, with the time); the
model's state right afterwards (ready again, or closed); and the scheduler
loop's longest stall (under a generous 1 s; ``benchmarks/fault_matrix.py``
measures it against the 100 ms goal).

Ways in: ``infer_many`` on an event loop, ``submit_many`` without and with a
timeout (a thread's caller: concurrent futures, no timer of their own), and
a front end's request (``submit_into``: a real server with ``--frontends 2``
and callers over HTTP, for the faults a caller can bring there).

Executors: a forward in a thread, a fake of CUDA's two batches in flight (a
thread executor that ``overlaps``: a second batch is handed over behind a
running one), and a worker process (``isolation = "process"``).

Every cell that cannot apply is in ``SKIPPED`` with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import torch

from tensorserve import ServedModel
from tensorserve.batching import delivery
from tensorserve.errors import (
    DeadlineExceeded,
    ModelFailure,
    ModelNotReady,
    OutOfMemory,
    ServerBusy,
    TensorServeError,
)
from tensorserve.repository.config import parse_config
from tensorserve.runtime.executor import ThreadExecutor
from tests.conftest import ServerProcess
from tests.helpers import MSGPACK, body, wait_until, write_toy_model

pytestmark = pytest.mark.timeout(120)

# The model: y = 2x, but a row holding one of these values misbehaves. Every
# forward first logs (monotonic time, the rows' values) to FAULT_LOG; a hang
# lasts while the file FAULT_GATE exists. One source for the thread kinds
# (exec'd here) and the worker (its model.py).
MODEL_PY = """
import os, signal, time, torch

def _log(x):
    values = sorted({float(v) for v in x[:, 0, 0].tolist()})
    with open(os.environ["FAULT_LOG"], "a") as log:
        log.write(f"{time.monotonic()!r} {' '.join(map(repr, values))}\\n")

class Model(torch.nn.Module):
    def forward(self, x):
        _log(x)
        if (x == 13).any():
            raise RuntimeError("poison value 13 in batch")
        if (x == 21).any():
            raise torch.OutOfMemoryError("tried to allocate a lot")
        if (x == 7).any():
            os.kill(os.getpid(), signal.SIGKILL)
        if (x == 35).any():
            os.kill(os.getpid(), signal.SIGRTMIN + 1)
        if (x == 98).any() or (x == 99).any():
            while os.path.exists(os.environ["FAULT_GATE"]):
                time.sleep(0.005)
            if (x == 98).any():
                raise RuntimeError("a failure after the watchdog gave up")
        return x * 2
"""
CONFIG: dict[str, Any] = {
    "max_batch_size": 8,
    "inputs": {"x": {"dtype": "float32", "shape": [-1, 4]}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1, 4]}},
}
BATCHING = {"max_queue_delay_ms": 60.0, "dispatch": "timer"}  # submitted together: one batch
WATCHDOG_MS = 400  # for the hangs; the other faults run under a limit they never reach
ANSWER_WITHIN_S = 30.0
STALL_BOUND_S = 1.0

WAYS = ("infer_many", "submit_many", "submit_many_timeout")
EXECUTORS = ("thread", "two_in_flight", "process")
FAULTS = (
    "raise", "raise_after_watchdog", "hang", "oom", "sigkill", "sigrtmin1",
    "deadline", "full_queue", "cancel", "unload", "close",
)  # fmt: skip

SIGNAL = "a signal kills a whole process: a forward in a thread has no worker of its own"
SKIPPED: dict[tuple[str, str], str] = {
    **{("thread", fault): SIGNAL for fault in ("sigkill", "sigrtmin1")},
    **{("two_in_flight", fault): SIGNAL for fault in ("sigkill", "sigrtmin1")},
    ("process", "raise_after_watchdog"): (
        "the watchdog kills a worker at its limit: its forward never returns late "
        "(the 'hang' cell covers the kill)"
    ),
    ("submit_many", "deadline"): "no deadline without a timeout",
    ("submit_many", "full_queue"): "no item expires without a timeout (the busy refusal "
    "is covered with one)",
}


def _cells() -> Iterator[Any]:
    for executor in EXECUTORS:
        for fault in FAULTS:
            for way in WAYS:
                reason = SKIPPED.get((executor, fault)) or SKIPPED.get((way, fault))
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                yield pytest.param(
                    executor, fault, way, id=f"{executor}-{fault}-{way}", marks=marks
                )


def _row(value: float) -> dict[str, np.ndarray]:
    """One caller's item: 3 rows; the out-of-memory row (21) is longer than
    any batch of the others, so alone it is too large (413), not memory that
    is briefly tight (503, batching/recovery.py)."""
    return {"x": np.full((40 if value == 21.0 else 3, 4), value, np.float32)}


# ---------------------------------------------------------------------- the harness
@dataclass
class Answer:
    value: float
    result: Any = None  # the row's first value, or the exception
    at: float = 0.0  # time.monotonic() when answered


@dataclass
class Harness:
    model: ServedModel
    log: Path
    gate: Path
    way: str
    answers: list[Answer] = field(default_factory=list)
    delivered: dict[int, int] = field(default_factory=dict)  # id(future) -> deliveries
    stall_s: float = 0.0
    _probe: threading.Event = field(default_factory=threading.Event)
    _loop: asyncio.AbstractEventLoop | None = None  # the callers' loop (infer_many)
    _thread: threading.Thread | None = None

    # -- callers
    def send(self, values: list[float], timeout: float | None = None) -> list[Answer]:
        """One request of these rows (one item each), by this cell's way in."""
        if self.way == "submit_many_timeout" and timeout is None:
            timeout = ANSWER_WITHIN_S
        if self.way == "submit_many":
            timeout = None
        items = [_row(v) for v in values]
        answers = [Answer(v) for v in values]
        self.answers += answers
        if self.way == "infer_many":
            assert self._loop is not None
            for item, answer in zip(items, answers):  # each its own request and task
                asyncio.run_coroutine_threadsafe(self._infer(item, answer, timeout), self._loop)
            return answers
        try:
            futures = self.model.submit_many(items, timeout=timeout)
        except TensorServeError as refused:  # refused at admission: answered at once
            for answer in answers:
                answer.result, answer.at = refused, time.monotonic()
            return answers
        for future, answer in zip(futures, answers):
            future.add_done_callback(lambda f, a=answer: self._answered(f, a))
        return answers

    def cancel_one(self, value: float) -> None:
        """A caller that queues ``value`` and leaves before it runs."""
        item = {"x": np.full((3, 4), value, np.float32)}
        depth = self.model.batcher.queue_depth
        if self.way == "infer_many":
            assert self._loop is not None
            leaving = asyncio.run_coroutine_threadsafe(self.model.infer_many([item]), self._loop)
        else:
            leaving = self.model.submit_many([item])[0]
        queue = self.model.batcher
        wait_until(lambda: queue.queue_depth > depth, "the leaving caller queued", ANSWER_WITHIN_S)
        assert leaving.cancel()

    async def _infer(self, item: Any, answer: Answer, timeout: float | None) -> None:
        try:
            rows = await self.model.infer_many([item], timeout=timeout)
            answer.result = float(rows[0]["y"][0, 0])
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            answer.result = exc
        answer.at = time.monotonic()

    @staticmethod
    def _answered(future: Any, answer: Answer) -> None:
        answer.at = time.monotonic()
        if future.cancelled():
            answer.result = asyncio.CancelledError()
            return
        error = future.exception()
        answer.result = error if error is not None else float(future.result()["y"][0, 0])

    def wait_answered(self, answers: list[Answer] | None = None) -> None:
        waiting = answers or self.answers
        wait_until(lambda: all(a.at for a in waiting), "every row answered", ANSWER_WITHIN_S)

    # -- what the model saw
    def forwards(self) -> list[tuple[float, list[float]]]:
        if not self.log.exists():
            return []
        runs = []
        for line in self.log.read_text().splitlines():
            at, *values = line.split()
            runs.append((float(at), [float(v) for v in values]))
        return runs

    def wait_running(self, value: float) -> None:
        wait_until(
            lambda: any(value in values for _, values in self.forwards()),
            f"row {value} reaching the model",
            ANSWER_WITHIN_S,
        )

    def wait_queued(self, items: int) -> None:
        queue = self.model.batcher
        wait_until(lambda: queue.queue_depth >= items, f"{items} rows queued", ANSWER_WITHIN_S)

    def release(self) -> None:
        self.gate.unlink(missing_ok=True)

    # -- the loop's stalls
    def start_probe(self) -> None:
        home = self.model.batcher.scheduler.home
        assert home is not None
        loop = home.loop
        last = [time.monotonic()]

        def tick() -> None:
            now = time.monotonic()
            self.stall_s = max(self.stall_s, now - last[0] - 0.01)
            last[0] = now
            if not self._probe.is_set():
                loop.call_later(0.01, tick)

        loop.call_soon_threadsafe(tick)

    def start_callers_loop(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._probe.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            assert self._thread is not None
            self._thread.join(10)
            self._loop.close()


def _build(executor: str, tmp_path: Path, **overrides: Any) -> ServedModel:
    faults = {"watchdog_ms": overrides.pop("watchdog_ms", 20_000)}
    batching = {**BATCHING, **overrides.pop("batching", {})}
    if executor == "process":
        write_toy_model(tmp_path, "faulty", MODEL_PY, **CONFIG, isolation="process",
                        dynamic_batching=batching)  # fmt: skip
        return ServedModel.from_repository(tmp_path, "faulty", faults=faults)
    namespace: dict[str, Any] = {}
    exec(MODEL_PY, namespace)  # noqa: S102 - the test's own model source
    data = {
        "input": [{"name": "x", "dtype": "float32", "shape": [-1, 4]}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1, 4]}],
        "max_batch_size": 8, "device": "cpu", "dynamic_batching": batching, "faults": faults,
    }  # fmt: skip
    config = parse_config(data, "faulty")
    fn = namespace["Model"]()
    if executor == "thread":
        return ServedModel("faulty", config, fn)
    # CUDA's shape on a CPU: the instance holds two batches, one behind the other.
    two = ThreadExecutor(fn, config, torch.device("cpu"), intra_op_threads=1, name="faulty")
    two.overlaps = True
    return ServedModel("faulty", config, fn, executor=two)


@pytest.fixture
def harness_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []
    log, gate = tmp_path / "forwards.log", tmp_path / "gate"
    monkeypatch.setenv("FAULT_LOG", str(log))
    monkeypatch.setenv("FAULT_GATE", str(gate))
    real_deliver = delivery._deliver

    def make(executor: str, way: str, **overrides: Any) -> Harness:
        model = _build(executor, tmp_path, **overrides).start()
        harness = Harness(model, log, gate, way)
        made.append(harness)

        def counting(outcomes: Any) -> None:  # every delivery of every caller, counted
            for entry, _, _ in outcomes:
                harness.delivered[id(entry.future)] = harness.delivered.get(id(entry.future), 0) + 1
            real_deliver(outcomes)

        monkeypatch.setattr(delivery, "_deliver", counting)
        harness.start_probe()
        if way == "infer_many":
            harness.start_callers_loop()
        return harness

    yield make
    for harness in made:
        harness.release()
        harness.stop()
        with contextlib.suppress(Exception):  # a cell that closed it already
            harness.model.close()


# ---------------------------------------------------------------------- the cells
GOOD = [1.0, 2.0, 3.0]


def _expect_rows(answers: list[Answer]) -> None:
    for answer in answers:
        assert answer.result == 2 * answer.value, (answer.value, answer.result)


def _expect_error(answers: list[Answer], kind: type[BaseException], match: str) -> None:
    for answer in answers:
        assert isinstance(answer.result, kind), (answer.value, answer.result)
        assert match in str(answer.result), (match, str(answer.result))


@pytest.mark.parametrize(("executor", "fault", "way"), list(_cells()))
def test_every_caller_is_answered_exactly_once(
    executor: str, fault: str, way: str, harness_for: Callable[..., Harness]
) -> None:
    hangs = fault in ("hang", "raise_after_watchdog")
    queue = {"batching": {"max_queue_size": 2}} if fault == "full_queue" else {}
    h = harness_for(executor, way, watchdog_ms=WATCHDOG_MS if hangs else 20_000, **queue)
    ready_after = True
    if fault in ("raise", "oom"):
        bad_value = 13.0 if fault == "raise" else 21.0
        good, bad = h.send(GOOD[:2]), h.send([bad_value])
        good += h.send(GOOD[2:])
        h.wait_answered()
        _expect_rows(good)
        if fault == "raise":
            _expect_error(bad, ModelFailure, "poison value 13 in batch")
        else:
            _expect_error(bad, OutOfMemory, "does not fit in memory even alone")
    elif hangs:
        hang_value = 98.0 if fault == "raise_after_watchdog" else 99.0
        h.gate.touch()
        first = h.send([hang_value, *GOOD])
        h.wait_running(hang_value)
        behind = h.send([101.0 + i for i in range(8)])  # a full batch: behind it, or queued
        if executor == "process":
            # The worker is killed at the limit and the search finds the row
            # that hangs: it fails alone, every other row is answered with its own.
            h.wait_answered()
            _expect_error(first[:1], ModelFailure, "alone ran longer than the watchdog allows")
            _expect_rows(first[1:] + behind)
        else:
            h.wait_answered()
            _expect_error(first, ModelFailure, "ran longer than the watchdog's 0.4 s")
            for answer in behind:  # behind it on the instance, or in the stranded queue
                assert isinstance(answer.result, ModelFailure | ModelNotReady), answer.result
            h.release()  # the forward comes back: late, its outcome dropped
    elif fault in ("sigkill", "sigrtmin1"):
        bad_value = 7.0 if fault == "sigkill" else 35.0
        good, bad = h.send(GOOD[:2]), h.send([bad_value])
        good += h.send(GOOD[2:])
        h.wait_answered()
        _expect_rows(good)
        _expect_error(bad, ModelFailure, "crashed the model's worker process")
    elif fault == "deadline":
        h.gate.touch()
        slow = h.send([99.0])
        h.wait_running(99.0)
        late = h.send([4.0, 5.0], timeout=0.05)
        time.sleep(0.1)  # their deadline passes in the queue
        h.release()
        h.wait_answered()
        _expect_rows(slow)
        _expect_error(late, DeadlineExceeded, "")
    elif fault == "full_queue":
        h.gate.touch()
        slow = h.send([99.0])
        h.wait_running(99.0)
        stale = h.send([4.0, 5.0], timeout=0.05)  # fills the queue, then expires in it
        time.sleep(0.1)  # their deadline passes while the slow batch runs
        if way == "submit_many_timeout":
            # No timer of their own: the next admission that needs their room
            # answers them (it dropped them unanswered before).
            fresh = h.send([6.0, 8.0])
            h.wait_answered(stale)
            _expect_error(stale, DeadlineExceeded, "waited past its deadline")
            with pytest.raises(ServerBusy, match="queue is full"):
                h.model.submit_many([{"x": np.ones((3, 4), np.float32)}] * 2, timeout=5)
        else:  # infer_many: the caller's own timer answered and withdrew them
            h.wait_answered(stale)
            _expect_error(stale, DeadlineExceeded, "no result within")
            fresh = h.send([6.0, 8.0], timeout=ANSWER_WITHIN_S)
        h.release()
        h.wait_answered()
        _expect_rows(slow + fresh)
    elif fault == "cancel":
        h.gate.touch()
        slow = h.send([99.0])
        h.wait_running(99.0)
        kept = h.send([4.0])
        h.cancel_one(5.0)
        h.release()
        h.wait_answered()
        _expect_rows(slow + kept)
        assert not any(5.0 in values for _, values in h.forwards()), "a cancelled row ran"
    elif fault == "unload":
        h.gate.touch()
        first = h.send([99.0, *GOOD])
        h.wait_running(99.0)
        queued = h.send([4.0, 5.0])
        closer = threading.Thread(target=h.model.batcher.close, args=(0.3,))
        closer.start()
        h.wait_answered()
        closer.join(ANSWER_WITHIN_S)
        for answer in first + queued:
            assert isinstance(answer.result, ModelNotReady | ModelFailure), answer.result
        ready_after = False
    elif fault == "close":
        h.gate.touch()
        slow = h.send([99.0])
        h.wait_running(99.0)
        queued = h.send([4.0, 5.0])
        h.wait_queued(2)
        closer = threading.Thread(target=h.model.batcher.close)  # what is queued still runs
        closer.start()
        scheduler = h.model.batcher.scheduler
        wait_until(lambda: not scheduler.accepting, "the close beginning", ANSWER_WITHIN_S)
        with pytest.raises(ModelNotReady, match="not accepting requests"):
            h.model.submit_many([{"x": np.ones((3, 4), np.float32)}])
        h.release()
        h.wait_answered()
        closer.join(ANSWER_WITHIN_S)
        _expect_rows(slow + queued)
        ready_after = False

    # Exactly once: one delivery per caller (a caller answered by its own timer
    # has none, or one the scheduler skips as answered).
    assert all(count == 1 for count in h.delivered.values()), h.delivered
    assert all(answer.at for answer in h.answers)
    # Nothing answered runs again: no forward that started after a row's
    # answer holds that row (the hung forward that started before may end later).
    runs = h.forwards()
    for answer in h.answers:
        again = [at for at, values in runs if answer.value in values and at > answer.at]
        assert not again, f"row {answer.value} ran {len(again)} more times after its answer"
    if ready_after:
        h.release()
        wait_until(lambda: h.model.health() is None, "the model ready again", ANSWER_WITHIN_S)
        assert (
            float(h.model.infer_sync({"x": np.full((2, 4), 42.0, np.float32)})["y"][0, 0]) == 84.0
        )
    if record := os.environ.get("FAULT_MATRIX_STALLS"):  # benchmarks/fault_matrix.py reads it
        with open(record, "a") as out:
            out.write(json.dumps({"executor": executor, "fault": fault, "way": way,
                                  "stall_ms": round(1000 * h.stall_s, 2)}) + "\n")  # fmt: skip
    assert h.stall_s < STALL_BOUND_S, f"the scheduler's loop stalled {h.stall_s:.3f} s"


# ---------------------------------------------------------------------- a front end's callers
FRONT_END_FAULTS = ("raise", "oom", "hang", "sigkill", "sigrtmin1", "deadline")


@pytest.fixture(scope="module")
def front_end_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """A real server, ``--frontends 2``, serving the faulty model in worker
    processes with a 400 ms watchdog: callers over HTTP reach it through a
    front end's ``submit_into``."""
    repo = tmp_path_factory.mktemp("matrix")
    write_toy_model(repo, "faulty", MODEL_PY, **CONFIG, isolation="process",
                    dynamic_batching=BATCHING, faults={"watchdog_ms": WATCHDOG_MS})  # fmt: skip
    env = {**os.environ, "FAULT_LOG": str(repo / "forwards.log"), "FAULT_GATE": str(repo / "gate")}
    server = ServerProcess(repo, "--frontends", "2", env=env, log=repo / "server.log")
    yield server, repo
    server.stop()


def _post(url: str, value: float, answers: list[Answer], timeout_ms: float | None = None) -> None:
    extra = {"parameters": {"timeout_ms": timeout_ms}} if timeout_ms else {}
    answer = Answer(value)
    answers.append(answer)
    reply = httpx.post(f"{url}/v2/models/faulty/infer", headers=MSGPACK, timeout=60,
                       content=body([_row(value)], **extra))  # fmt: skip
    decoded = msgpack.unpackb(reply.content)
    if reply.status_code == 200:
        data = decoded["outputs"][0]["y"]
        answer.result = float(np.frombuffer(data["data"], data["dtype"])[0])
    else:
        answer.result = (reply.status_code, decoded["code"], decoded["error"])
    answer.at = time.monotonic()


@pytest.mark.parametrize("fault", FRONT_END_FAULTS)
def test_a_front_ends_callers_are_answered_exactly_once(
    fault: str, front_end_server: tuple[Any, Path]
) -> None:
    server, repo = front_end_server
    log, gate = repo / "forwards.log", repo / "gate"
    answers: list[Answer] = []
    bad = {"raise": 13.0, "oom": 21.0, "hang": 99.0, "sigkill": 7.0, "sigrtmin1": 35.0}
    callers = []
    if fault == "deadline":
        gate.touch()
        callers.append(threading.Thread(target=_post, args=(server.url, 99.0, answers)))
        callers[0].start()
        harness = Harness(None, log, gate, "front end")  # type: ignore[arg-type]
        harness.wait_running(99.0)
        late = threading.Thread(target=_post, args=(server.url, 4.0, answers, 50.0))
        late.start()
        late.join(ANSWER_WITHIN_S)  # its own deadline answers it while the instance is busy
        gate.unlink()
        callers[0].join(ANSWER_WITHIN_S)
        by_value = {a.value: a.result for a in answers}
        assert by_value[99.0] == 198.0
        assert by_value[4.0][:2] == (504, "deadline_exceeded")
        assert not any(4.0 in values for _, values in harness.forwards()), "a late row ran"
        return
    if fault == "hang":
        gate.touch()
    for value in [bad[fault], *GOOD]:
        callers.append(threading.Thread(target=_post, args=(server.url, value, answers)))
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(ANSWER_WITHIN_S)
    gate.unlink(missing_ok=True)
    assert len(answers) == 4 and all(answer.at for answer in answers)
    by_value = {a.value: a.result for a in answers}
    for value in GOOD:
        assert by_value[value] == 2 * value, (value, by_value[value])
    status, code, message = by_value[bad[fault]]
    expected = {
        "raise": (500, "model_failure", "poison value 13 in batch"),
        "oom": (413, "out_of_memory", "does not fit in memory even alone"),
        "hang": (500, "model_failure", "alone ran longer than the watchdog allows"),
        "sigkill": (500, "model_failure", "crashed the model's worker process"),
        "sigrtmin1": (500, "model_failure", "crashed the model's worker process"),
    }[fault]
    assert (status, code) == expected[:2] and expected[2] in message, (status, code, message)
    runs = Harness(None, log, gate, "front end").forwards()  # type: ignore[arg-type]
    for answer in answers:
        again = [at for at, values in runs if answer.value in values and at > answer.at]
        assert not again, f"row {answer.value} ran again after its answer"
    ready = f"{server.url}/v2/models/faulty/ready"
    wait_until(
        lambda: httpx.get(ready).status_code == 200, "the model ready again", ANSWER_WITHIN_S
    )
    log.unlink(missing_ok=True)  # the next cell's rows reuse the same values
