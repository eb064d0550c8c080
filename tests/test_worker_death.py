"""A worker process's death, seen from the server (``isolation = "process"``):
every caller of its batch is answered whatever the report of its death does,
an old worker's death never touches its replacement, and the event loop
never waits on a dead worker or on the template that forked it."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from tensorserve import ServedModel
from tensorserve.errors import WorkerCrashed
from tensorserve.runtime import template as template_module
from tensorserve.runtime import worker_process
from tensorserve.runtime.worker_process import Lost, WorkerProcess
from tests.helpers import ECHO, answers_of_a_dead_worker, wait_until_async, write_toy_model

pytestmark = pytest.mark.timeout(180)

SIGRT1 = int(signal.SIGRTMIN) + 1  # no member of signal.Signals names it


def _x(value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((3, 4), value, np.float32)}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class LoopLag:
    """The loop's longest stall: a callback every 10 ms records the gaps."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.longest, self._last = loop, 0.0, time.perf_counter()
        self._handle = loop.call_later(0.01, self._tick)

    def _tick(self) -> None:
        now = time.perf_counter()
        self.longest = max(self.longest, now - self._last)
        self._last = now
        self._handle = self.loop.call_later(0.01, self._tick)

    def stop(self) -> float:
        self._handle.cancel()
        return self.longest


# ---------------------------------------------------------------------- naming
def test_a_real_time_signal_is_named_by_number() -> None:
    assert worker_process._died(-SIGRT1) == f"killed by signal {SIGRT1} (SIGRTMIN+1)"
    signal_name = worker_process.signal_name
    assert signal_name(SIGRT1) == f"signal {SIGRT1} (SIGRTMIN+1)"
    assert signal_name(int(signal.SIGKILL)) == "signal SIGKILL"


# ------------------------------------------------------- the report cannot lose a reply
@pytest.mark.parametrize("report", ["raises", "returns None"])
def test_every_waiting_batch_is_answered_once_when_the_report_fails(
    report: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_report(self: Lost) -> Any:
        if self.sock is not None:
            self.sock.close()
        if report == "raises":
            raise RuntimeError("the report broke")
        return None

    monkeypatch.setattr(Lost, "report", broken_report)

    with caplog.at_level(logging.ERROR, logger="tensorserve.runtime.isolated"):
        answers = answers_of_a_dead_worker({})
    assert [len(a) for a in answers] == [1, 1, 1]
    first, *behind = (a[0] for a in answers)
    assert isinstance(first, WorkerCrashed) and first.ran
    assert "died while running this batch (how is unknown)" in str(first)
    assert all(isinstance(e, WorkerCrashed) and not e.ran for e in behind)
    assert "reporting a dead worker process failed" in caplog.text


# ------------------------------------------------ a real worker, a real-time signal
@pytest.fixture
def blocker(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A model that, while ``hold`` exists, writes its pid and waits: a kill
    is surely mid-batch."""
    hold, pid = tmp_path / "hold", tmp_path / "pid"
    write_toy_model(
        tmp_path,
        "blocker",
        f"""
        import os, pathlib, time, torch

        HOLD, PID = pathlib.Path({str(hold)!r}), pathlib.Path({str(pid)!r})

        class Model(torch.nn.Module):
            def forward(self, x):
                if HOLD.exists():
                    PID.write_text(str(os.getpid()))
                    while HOLD.exists():
                        time.sleep(0.01)
                return x * 2
    """,
        **{
            **ECHO,
            "isolation": "process",
            "dynamic_batching": {"max_queue_delay_ms": 1000.0, "dispatch": "timer"},
        },
    )
    return tmp_path, hold, pid


def test_a_worker_killed_by_a_real_time_signal_mid_batch_answers_all_eight_callers(
    blocker: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    repo, hold, pid_file = blocker

    async def run() -> None:
        async with ServedModel.from_repository(repo, "blocker") as model:
            scheduler = model.batcher.scheduler
            hold.touch()
            calls = [asyncio.ensure_future(model.infer(_x(v))) for v in range(1, 9)]
            # exists() alone can see the file before its pid is written (a load seen once)
            running = lambda: pid_file.exists() and pid_file.read_text().strip() != ""
            await wait_until_async(running, "the batch of 8 running", 30)
            assert [len(b.entries) for b in scheduler.running[0]] == [8]
            worker = int(pid_file.read_text())
            os.kill(worker, SIGRT1)
            await wait_until_async(lambda: not _alive(worker), "the worker dead")
            hold.unlink()  # the retries run through
            done, _ = await asyncio.wait(calls, timeout=30)
            assert len(done) == 8, "every caller answered"
            for value, call in zip(range(1, 9), calls, strict=True):
                error = call.exception()
                if error is None:
                    assert call.result()["y"].tolist() == [[2.0 * value] * 4] * 3
                else:  # an error is fine, if it names the crash
                    assert "worker process died" in str(error), error
            await wait_until_async(lambda: model.health() is None, "the model ready again", 30)
            assert not any(scheduler.running)
            assert (await model.infer(_x(5)))["y"].tolist() == [[10.0] * 4] * 3
            assert model.executor.workers[0].pid != worker  # type: ignore[attr-defined]

    with caplog.at_level(logging.ERROR, logger="tensorserve.runtime.isolated"):
        asyncio.run(run())
    assert f"killed by signal {SIGRT1} (SIGRTMIN+1)" in caplog.text


# -------------------------------------------------------------- the loop never waits
def test_the_loop_never_waits_for_a_slow_template_to_report_a_dead_worker(
    blocker: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The template answers each status question after 2 s: readiness asked
    on the loop, a batch to the dead worker and its replacement all go on
    meanwhile, and the loop never stalls."""
    repo, _, _ = blocker
    answered = threading.Event()
    returncode = template_module.Template.returncode

    def slow(self: template_module.Template, pid: int) -> int | None:
        time.sleep(2.0)
        try:
            return returncode(self, pid)
        finally:
            answered.set()

    async def run() -> None:
        async with ServedModel.from_repository(repo, "blocker") as model:
            # Before its first batch nothing watches the worker's socket: only
            # asking its process (the template) could tell it is dead.
            executor: Any = model.executor
            worker = executor.workers[0].pid
            monkeypatch.setattr(template_module.Template, "returncode", slow)
            lag = LoopLag(asyncio.get_running_loop())
            os.kill(worker, signal.SIGKILL)
            await wait_until_async(lambda: not _alive(worker), "the worker dead")
            for _ in range(20):  # readiness, as an HTTP handler asks it
                model.health()
                await asyncio.sleep(0.01)
            assert (await model.infer(_x(3)))["y"][0, 0] == 6.0
            await asyncio.to_thread(answered.wait, 30)  # the slow answer, while the loop ran
            assert lag.stop() < 1.0, f"the loop stalled {lag.longest:.2f} s"
            assert executor.workers[0].pid != worker

    asyncio.run(run())


# ------------------------------------------------------- an old death, a new worker
def test_an_old_workers_death_never_touches_the_worker_that_replaced_it(
    blocker: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repair started a new worker on the handle before the loop saw the
    old one's socket close: the old one's death is reported alone."""
    repo, _, _ = blocker
    reported = threading.Event()
    report = Lost.report

    def recorded(self: Lost) -> WorkerCrashed:
        try:
            return report(self)
        finally:
            reported.set()

    monkeypatch.setattr(Lost, "report", recorded)

    async def run() -> None:
        async with ServedModel.from_repository(repo, "blocker") as model:
            assert (await model.infer(_x(1)))["y"][0, 0] == 2.0  # the socket is watched
            executor: Any = model.executor
            handle: WorkerProcess = executor.workers[0]
            # The replacement, as a repair on another thread makes it.
            old = handle._take()
            await asyncio.to_thread(handle.start)
            new = handle.pid
            assert old.process is not None and new is not None and new != old.process.pid
            old.process.kill()  # the loop sees the old socket close now
            await asyncio.to_thread(reported.wait, 30)
            await asyncio.sleep(0.2)  # anything the report set off has run
            assert handle.alive and handle.pid == new and _alive(new)
            assert (await model.infer(_x(4)))["y"][0, 0] == 8.0
            assert handle.pid == new and executor.restarts == 0
            assert old.sock is not None
            old.sock.close()
            old.process.wait(10)

    asyncio.run(run())


class _SlowTemplate:
    """A template that takes 2 s to say how a worker died."""

    asked = 0

    def returncode(self, pid: int) -> int | None:
        self.asked += 1
        time.sleep(2.0)
        return -9


def test_the_watchdogs_kill_and_readiness_never_ask_the_template() -> None:
    """On the loop, ``kill`` (the watchdog's abort) and ``alive`` (dispatch,
    readiness) of a forked worker that has exited return at once."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        slow = _SlowTemplate()
        forked = template_module.ForkedProcess(child.pid, slow)  # type: ignore[arg-type]
        handle = WorkerProcess({}, "model 'm' instance 0")
        ours, theirs = socket.socketpair()
        handle.process, handle.sock, handle.generation = forked, ours, 1
        os.kill(child.pid, signal.SIGKILL)
        select.select([forked._pidfd], [], [], 10)  # it has exited: the pidfd says so
        started = time.perf_counter()
        assert handle.alive  # the loop has not seen its socket close yet
        handle.kill("the batch ran longer than 1 s", ticket=1)
        assert time.perf_counter() - started < 0.5 and slow.asked == 0
        assert handle.killed_because == "the batch ran longer than 1 s"
        assert forked.wait(10) == -9 and slow.asked == 1  # off the loop, it may ask
        ours.close()
        theirs.close()
    finally:
        child.kill()
        child.wait()


def test_a_worker_that_dies_idle_is_replaced_before_any_batch_comes(tmp_path: Path) -> None:
    """Its socket's EOF starts the repair (``LoopExecutor.attach``'s ``lost``):
    the next caller finds a worker up, not a dead one to replace first."""
    write_toy_model(
        tmp_path, "idle", "import torch\nclass Model(torch.nn.Module):\n"
        "    def forward(self, x):\n        return x * 2\n",
        **{**ECHO, "isolation": "process", "faults": {"standby_worker": False}},
    )  # fmt: skip

    async def run() -> None:
        async with ServedModel.from_repository(tmp_path, "idle") as model:
            executor: Any = model.executor
            assert (await model.infer(_x(1)))["y"].tolist() == [[2.0] * 4] * 3
            first = executor.workers[0].pid
            os.kill(first, signal.SIGKILL)  # idle: no batch will find it dead
            await wait_until_async(lambda: executor.restarts == 1, "the worker replaced", 30)
            assert executor.workers[0].pid not in (None, first)
            assert executor.workers[0].alive
            assert (await model.infer(_x(3)))["y"].tolist() == [[6.0] * 4] * 3

    asyncio.run(run())
