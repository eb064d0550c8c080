"""A worker process has one owner at a time (runtime/ownership.py,
runtime/worker_process.py): the event loop while it drives a batch, else
the instance's model thread. Another thread that reaches for its socket is
refused at once; with both paths and crashes going at the same time, every
caller gets its own row, once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorserve import ServedModel
from tensorserve.errors import ModelFailure
from tensorserve.runtime import ownership
from tensorserve.runtime.ownership import NotOwner, Owner
from tests.helpers import ECHO, wait_until, write_toy_model

pytestmark = pytest.mark.timeout(120)


def _in_thread(call: Any) -> BaseException | None:
    """What ``call()`` raised on another thread (None: nothing)."""
    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            raised[0] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    return raised[0]


def test_an_owner_refuses_a_second_thread_until_the_last_hold_is_given_back() -> None:
    owner = Owner("the socket")
    owner.acquire()
    owner.acquire()  # holds nest: a model thread that sends a batch ahead
    assert isinstance(_in_thread(owner.acquire), NotOwner)
    assert isinstance(_in_thread(owner.check), NotOwner)
    owner.release()
    assert isinstance(_in_thread(owner.acquire), NotOwner)  # still held once
    owner.release()
    assert owner.thread is None
    assert _in_thread(owner.acquire) is None  # free: the other thread takes it
    with pytest.raises(NotOwner, match="the socket is held by thread"):
        owner.check()


@pytest.fixture
def refusals(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every refusal of any ``Owner``, even one a loop callback swallowed."""
    seen: list[str] = []
    refuse = Owner._refused

    def recording(self: Owner, me: int) -> NotOwner:
        error = refuse(self, me)
        seen.append(str(error))
        return error

    monkeypatch.setattr(ownership.Owner, "_refused", recording)
    yield seen


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    process = {**ECHO, "isolation": "process"}
    write_toy_model(tmp_path, "mortal", """
        import os, time, torch

        class Model(torch.nn.Module):
            def forward(self, x):
                if (x == 7).any():
                    os._exit(7)
                if (x == 5).any():
                    time.sleep(0.3)  # long enough to reach for the socket meanwhile
                return x * 2
    """, **process)
    return tmp_path


def _x(value: float, length: int = 3) -> dict[str, np.ndarray]:
    return {"x": np.full((length, 4), value, np.float32)}


def test_a_thread_that_does_not_hold_the_worker_is_refused_its_socket(
    repo: Path, refusals: list[str]
) -> None:
    async def run() -> None:
        async with ServedModel.from_repository(repo, "mortal") as model:
            worker: Any = model.executor.workers[0]  # type: ignore[attr-defined]
            assert await asyncio.to_thread(model.batcher.wait_idle, 10)
            pending = asyncio.ensure_future(model.infer(_x(5.0)))
            await asyncio.sleep(0)  # the task runs up to its await: the loop sent the batch
            assert worker.owner.thread == threading.get_ident()
            # Another thread may ask and kill, never send or read.
            raised = _in_thread(lambda: worker.submit(_x(1.0)))
            assert isinstance(raised, NotOwner) and "held by thread" in str(raised)
            assert isinstance(_in_thread(lambda: worker.receive(worker.generation)), NotOwner)
            assert _in_thread(lambda: worker.alive) is None
            assert (await pending)["y"].tolist() == [[10.0] * 4] * 3  # the stream is intact
            assert worker.owner.thread is None  # the reply gave it back

    asyncio.run(run())
    assert len(refusals) == 2


def test_the_loop_and_the_model_threads_share_one_worker_without_losing_a_reply(
    repo: Path, refusals: list[str]
) -> None:
    """Callers on the loop (the direct path) and callers on threads (the model
    thread's path) at once against one worker, which dies twice on the way:
    every caller gets its own rows exactly, and no thread ever touched the
    worker while another held it."""
    senders: list[str] = []  # which path sent each batch

    async def run() -> None:
        async with ServedModel.from_repository(repo, "mortal") as model:
            executor: Any = model.executor
            for name in ("launch", "try_launch_direct"):
                send = getattr(executor, name)

                def recording(*args: Any, send: Any = send, name: str = name) -> Any:
                    senders.append(name)
                    return send(*args)

                setattr(executor, name, recording)

            async def on_loop(first: int) -> list[Any]:
                return [await model.infer(_x(float(v))) for v in range(first, first + 40)]

            def on_thread(first: int) -> list[Any]:
                return [model.infer_sync(_x(float(v)), timeout=30) for v in range(first, first + 40)]

            async def crash() -> BaseException:
                with pytest.raises(ModelFailure) as raised:
                    await model.infer(_x(7.0), timeout=20)  # a lost reply fails fast
                return raised.value

            # Alone, a crash is read on the loop (the direct path) ...
            assert await asyncio.to_thread(model.batcher.wait_idle, 10)
            lone = await crash()
            assert senders[0] == "try_launch_direct"
            # ... and in a crowd, on either path.
            with ThreadPoolExecutor(3) as pool:
                threaded = [asyncio.wrap_future(pool.submit(on_thread, 1000 * (i + 1)))
                            for i in range(3)]
                looped = [on_loop(100_000 * (i + 1)) for i in range(3)]
                results = await asyncio.gather(*looped, *threaded, crash(), crash())
            for first, rows in zip([100_000, 200_000, 300_000, 1000, 2000, 3000], results):
                for v, got in zip(range(first, first + 40), rows, strict=True):
                    assert got["y"].tolist() == [[2.0 * v] * 4] * 3
            for crashed in [lone, *results[6:]]:
                assert "this item crashed the model's worker process" in str(crashed)
                assert "(exit code 7)" in str(crashed)
            # A new worker serves again, restored by the model thread.
            wait_until(lambda: executor.workers[0].alive, "a worker up again", 30)
            assert (await model.infer(_x(3.0)))["y"].tolist() == [[6.0] * 4] * 3

    asyncio.run(run())
    assert set(senders) == {"launch", "try_launch_direct"}  # both paths ran
    assert refusals == []
