"""The forward thread an event loop hands padded batches to (runtime/runner.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tensorserve.runtime.runner import InstanceRunner, reply_on_loop


def _double(features: dict[str, torch.Tensor], parameters: Any) -> torch.Tensor:
    if (features["x"] < 0).any():
        raise ValueError("negative input")
    return features["x"] * 2


def test_batches_run_in_order_and_a_failure_is_that_batch_only() -> None:
    runner = InstanceRunner("test-forward", lambda: None, _double)
    try:
        good = runner.submit({"x": torch.ones(2)}, None)
        bad = runner.submit({"x": -torch.ones(2)}, None)
        after = runner.submit({"x": torch.full((2,), 3.0)}, None)
        assert good.result(10).tolist() == [2.0, 2.0]
        with pytest.raises(ValueError, match="negative input"):
            bad.result(10)
        assert after.result(10).tolist() == [6.0, 6.0]
    finally:
        runner.close()


def test_a_thread_that_cannot_start_fails_every_batch_instead_of_hanging() -> None:
    def enter() -> None:
        raise RuntimeError("no such device")

    runner = InstanceRunner("test-forward", enter, _double)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="no such device"):
                runner.submit({"x": torch.ones(1)}, None).result(10)
    finally:
        runner.close()


async def test_the_reply_comes_on_the_loop_once_even_when_finish_now_races_it() -> None:
    runner = InstanceRunner("test-forward", lambda: None, _double)
    loop = asyncio.get_running_loop()
    got: list[tuple[Any, BaseException | None]] = []
    arrived = asyncio.Event()

    def done(result: Any, error: BaseException | None) -> None:
        got.append((result, error))
        arrived.set()

    try:
        finish_now = reply_on_loop(runner.submit({"x": torch.ones(1)}, None), loop, done)
        finish_now()  # on the loop's thread, as close() does: waits and delivers here
        await asyncio.wait_for(arrived.wait(), 10)
        # The runner has invoked the first batch's callbacks once it runs the
        # next: a second delivery, if any, is then queued on this loop.
        runner.submit({"x": torch.ones(1)}, None).result(10)
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(got) == 1 and got[0][0].tolist() == [2.0] and got[0][1] is None
    finally:
        runner.close()
