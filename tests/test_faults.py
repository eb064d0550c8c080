"""Fault isolation through the in-process API: a poisoned item, rows the model
fails itself, an out-of-memory batch, a worker that crashes or hangs, a model
thread that hangs. Every other caller of the batch gets its correct row."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tensorserve import ModelFailure, ModelNotReady, OutOfMemory, RowErrors, ServedModel
from tensorserve.errors import MemoryTight
from tensorserve.batching.recovery import MemoryCeiling
from tensorserve.batching.watchdog import Watchdog
from tests.helpers import ECHO, HangOn, wait_until, write_toy_model

pytestmark = pytest.mark.timeout(120)

X_IN = [{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": 0.0}]
Y_OUT = [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}]
# One batch of everything submitted together: the timer waits 300 ms for company.
ONE_BATCH = {"max_batch_size": 8, "max_queue_delay_ms": 300, "dispatch": "timer"}


def _item(value: float, length: int = 3) -> dict[str, np.ndarray]:
    return {"x": np.full(length, value, np.float32)}


def _poisoned(poison: set[float], calls: list[int], **config: object) -> ServedModel:
    """y = 2x; raises for any batch holding a poison value."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        bad = sorted(v for v in poison if (x == v).any())
        if bad:
            raise RuntimeError(f"poison value {bad[0]:g} in batch")
        return x * 2

    return ServedModel.from_function(fn, inputs=X_IN, outputs=Y_OUT, **{**ONE_BATCH, **config})


def _outcomes(model: ServedModel, values: list[float]) -> list[object]:
    """Each caller's row (as a list) or its exception, in order."""
    futures = model.submit_many([_item(v) for v in values])
    results: list[object] = []
    for future in futures:
        try:
            results.append(future.result(30)["y"].tolist())
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            results.append(exc)
    return results


# ---------------------------------------------------------------------- a poisoned item
def test_a_poisoned_item_fails_alone_and_every_other_caller_gets_its_row() -> None:
    calls: list[int] = []
    values = [1.0, 2.0, 3.0, 13.0, 5.0, 6.0, 7.0, 8.0]
    with _poisoned({13.0}, calls) as model:
        results = _outcomes(model, values)
        stats = model.stats.snapshot(0)
    for value, result in zip(values, results):
        if value == 13.0:
            assert isinstance(result, ModelFailure)
            assert result.message == (
                "model 'function' failed: RuntimeError: poison value 13 in batch"
            )
        else:
            assert result == [2 * value] * 3
    # 8 -> 4 + 4 -> 2 + 2 -> 1 + 1: at most 2*log2(8) runs after the first.
    assert calls[0] == 8 and len(calls) - 1 <= 2 * math.log2(8)
    assert sorted(calls[1:]) == [1, 1, 2, 2, 4, 4]
    assert stats["recoveries"] == {"split": 3}
    assert stats["failed_items"] == 1


def test_a_poisoned_batch_of_callers_on_a_loop_is_split_and_every_caller_answered() -> None:
    """Callers on an event loop, the scheduler on its own: the parts of the
    failed batch run before anything new, and every caller gets its answer."""
    calls: list[int] = []
    values = [1.0, 2.0, 3.0, 13.0, 5.0, 6.0, 7.0, 8.0]

    async def run(model: ServedModel) -> list[object]:
        loop = asyncio.get_running_loop()
        futures = model.batcher.submit_many(model.validate([_item(v) for v in values]), loop=loop)
        done = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 20)
        return [r if isinstance(r, BaseException) else r["y"].tolist() for r in done]

    with _poisoned({13.0}, calls, dispatch="eager", max_queue_delay_ms=200.0) as model:
        results = asyncio.run(run(model))
    for value, result in zip(values, results):
        if value == 13.0:
            assert isinstance(result, ModelFailure)
        else:
            assert result == [2 * value] * 3
    assert calls[0] == 8 and sorted(calls[1:]) == [1, 1, 2, 2, 4, 4]


def test_two_poisons_in_one_batch_fail_only_their_own_callers() -> None:
    calls: list[int] = []
    values = [13.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 17.0]
    with _poisoned({13.0, 17.0}, calls) as model:
        results = _outcomes(model, values)
    assert isinstance(results[0], ModelFailure) and "poison value 13" in results[0].message
    assert isinstance(results[7], ModelFailure) and "poison value 17" in results[7].message
    assert results[1:7] == [[2 * v] * 3 for v in values[1:7]]


def test_with_splitting_off_the_whole_batch_fails_as_before() -> None:
    calls: list[int] = []
    with _poisoned({13.0}, calls, faults={"split_failed_batches": False}) as model:
        results = _outcomes(model, [1.0, 13.0, 3.0])
    assert calls == [3]
    assert all(isinstance(r, ModelFailure) and "poison value 13" in r.message for r in results)


def test_a_transient_failure_is_retried_and_nobody_fails() -> None:
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if len(calls) == 1:
            raise RuntimeError("the device hiccupped")
        return x * 2

    with ServedModel.from_function(fn, inputs=X_IN, outputs=Y_OUT, **ONE_BATCH) as model:
        results = _outcomes(model, [1.0, 2.0, 3.0, 4.0])
    assert results == [[2.0] * 3, [4.0] * 3, [6.0] * 3, [8.0] * 3]
    assert calls == [4, 2, 2]


# ---------------------------------------------------------------------- rows the model fails
def _vocabulary_model(**config: object) -> tuple[ServedModel, list[int]]:
    """Fails rows holding a negative id with RowErrors; y = x + 1 otherwise."""
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        bad = (x < 0).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise RowErrors({row: f"negative id {x[row].min().item():g}" for row in bad})
        return x + 1

    return ServedModel.from_function(fn, inputs=X_IN, outputs=Y_OUT, **{**ONE_BATCH, **config}), calls


def test_rows_a_model_fails_with_row_errors_fail_alone_and_the_rest_run_again() -> None:
    model, calls = _vocabulary_model()
    values = [1.0, -4.0, 3.0, 4.0, -2.0]
    with model:
        results = _outcomes(model, values)
        stats = model.stats.snapshot(0)
    assert isinstance(results[1], ModelFailure)
    assert results[1].message == "model 'function' failed this item: negative id -4"
    assert isinstance(results[4], ModelFailure)
    assert results[4].message == "model 'function' failed this item: negative id -2"
    assert [results[i] for i in (0, 2, 3)] == [[2.0] * 3, [4.0] * 3, [5.0] * 3]
    assert calls == [5, 3]  # one run more, without the failed rows
    assert stats["recoveries"] == {"rows": 1}


def test_row_errors_naming_rows_outside_the_batch_fail_the_batch_saying_so() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        raise RowErrors({x.shape[0] + 2: "no such row"})

    with ServedModel.from_function(fn, inputs=X_IN, outputs=Y_OUT, **ONE_BATCH) as model:
        results = _outcomes(model, [1.0, 2.0])
    for result in results:
        assert isinstance(result, ModelFailure)
        assert result.message == "model 'function' raised RowErrors for rows [4] of a batch of 2 rows"


def test_a_per_item_list_of_the_wrong_length_fails_the_batch_naming_both_counts() -> None:
    def fn(x: torch.Tensor) -> list:
        return [{"y": row} for row in x][:-1]

    with ServedModel.from_function(
        fn, inputs=X_IN, outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}], **ONE_BATCH
    ) as model:
        results = _outcomes(model, [1.0, 2.0, 3.0])
    for result in results:
        assert isinstance(result, ModelFailure)
        assert result.message == "batch function returned 2 results for a batch of 3 items"


# ---------------------------------------------------------------------- out of memory
def _memory_bound_model(limit: int) -> tuple[ServedModel, list[int]]:
    """Raises torch.OutOfMemoryError on a padded batch of more than ``limit``
    elements, as a device would; y = 2x."""
    sizes: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.numel())
        if x.numel() > limit:
            raise torch.OutOfMemoryError(f"tried to allocate {x.numel() * 4} bytes")
        return x * 2

    model = ServedModel.from_function(fn, inputs=X_IN, outputs=Y_OUT, **ONE_BATCH)
    return model, sizes


def test_an_out_of_memory_batch_is_split_and_later_batches_form_under_the_ceiling() -> None:
    model, sizes = _memory_bound_model(limit=40)
    values = [float(v) for v in range(1, 9)]
    with model:
        first = _outcomes(model, [v for v in values])  # 8 items x 10 = 80 elements
        assert sizes[0] == 8 * 3  # length 3: fits; now length 10
        sizes.clear()
        futures = model.submit_many([_item(v, 10) for v in values])
        second = [f.result(30)["y"].tolist() for f in futures]
        assert sizes[0] == 80 and all(s <= 40 for s in sizes[1:])
        sizes.clear()
        futures = model.submit_many([_item(v, 10) for v in values])
        third = [f.result(30)["y"].tolist() for f in futures]
        stats = model.stats.snapshot(0)
    assert first == [[2 * v] * 3 for v in values]
    assert second == third == [[2 * v] * 10 for v in values]
    # The ceiling learnt is half the failed batch: 4 items of 10, not 8.
    assert sizes == [40, 40], "later batches formed above (or far below) the learned ceiling"
    assert stats["recoveries"] == {"oom": 1}


def test_an_item_too_large_even_alone_fails_with_out_of_memory_and_the_others_succeed() -> None:
    model, _ = _memory_bound_model(limit=40)
    with model:
        futures = model.submit_many([_item(1.0, 5), _item(2.0, 50), _item(3.0, 5)])
        with pytest.raises(OutOfMemory) as caught:
            futures[1].result(30)
        assert futures[0].result(30)["y"].tolist() == [2.0] * 5
        assert futures[2].result(30)["y"].tolist() == [6.0] * 5
        assert model.infer_sync(_item(4.0, 5))["y"].tolist() == [8.0] * 5  # still serving
    assert caught.value.code == "out_of_memory"
    assert caught.value.message.startswith(
        "model 'function': this item does not fit in memory even alone: it pads to 50 elements, "
        "and batches now form under "
    )


def test_the_memory_ceiling_halves_below_a_failure_and_grows_back_slowly() -> None:
    ceiling = MemoryCeiling()
    assert ceiling.limit is None and not ceiling.fitted()
    ceiling.ran_out(1000)
    assert ceiling.limit == 500
    ceiling.ran_out(800)  # a smaller failure lowers it further
    assert ceiling.limit == 400
    grown = [ceiling.fitted() for _ in range(MemoryCeiling.GROW_AFTER)]
    assert grown == [False] * (MemoryCeiling.GROW_AFTER - 1) + [True]
    assert ceiling.limit == 501
    ceiling.ran_out(600)
    assert ceiling.limit == 300


def test_a_lone_item_that_fit_before_is_a_503_when_memory_is_only_briefly_tight() -> None:
    """413 says "this item never fits": only when nothing as large has fit
    since memory last ran out. An item no larger than a batch that fit is
    the device's moment (another process, fragmentation): 503 memory_tight,
    retried later. The evidence is spent on it: the same item running out
    again before anything as large fits is a 413."""
    limit = [1000]

    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.numel() > limit[0]:
            raise torch.OutOfMemoryError(f"tried to allocate {x.numel() * 4} bytes")
        return x * 2

    model = ServedModel.from_function(fn, inputs=X_IN, outputs=Y_OUT, **ONE_BATCH)
    with model:
        assert model.infer_sync(_item(1.0, 30))["y"].tolist() == [2.0] * 30  # 30 elements fit
        limit[0] = 10  # memory gets tight
        with pytest.raises(MemoryTight) as tight:
            model.infer_sync(_item(2.0, 20))
        with pytest.raises(OutOfMemory):  # no new evidence: too large for now
            model.infer_sync(_item(3.0, 20))
        limit[0] = 1000  # memory back
        assert model.infer_sync(_item(4.0, 20))["y"].tolist() == [8.0] * 20
    assert tight.value.code == "memory_tight"
    assert tight.value.message == (
        "model 'function': the device's memory was too tight for this item just now: it pads to "
        "20 elements, and a batch at least as large fit since memory last ran out "
        "(OutOfMemoryError: tried to allocate 80 bytes); retry"
    )


# ---------------------------------------------------------------------- a hung model thread
def test_the_watchdog_answers_the_callers_of_a_hung_thread_and_readiness_tells() -> None:
    fn = HangOn(99.0)
    entered, release = fn.entered, fn.release
    model = ServedModel.from_function(
        fn, inputs=X_IN, outputs=Y_OUT, max_batch_size=8, faults={"watchdog_ms": 300}
    )
    with model:
        assert model.health() is None
        hung = model.submit_many([_item(99.0)])[0]
        assert entered.wait(10)
        with pytest.raises(ModelFailure, match="ran longer than the watchdog's 0.3 s"):
            hung.result(10)
        assert "every instance is stuck" in (model.health() or "")
        with pytest.raises(ModelNotReady, match="every instance is stuck"):
            model.submit_many([_item(1.0)])
        release.set()
        wait_until(lambda: model.health() is None, "the model ready again")
        assert model.infer_sync(_item(1.0))["y"].tolist() == [2.0] * 3


# ---------------------------------------------------------------------- worker processes
CRASHY = """
    import os, signal, time, torch

    class Model(torch.nn.Module):
        def forward(self, x):
            if (x == 7).any():
                os._exit(7)
            if (x == 13).any():
                raise RuntimeError("poison value 13 in batch")
            if (x == 21).any():
                raise torch.OutOfMemoryError("tried to allocate a lot")
            if (x == 55).any():
                time.sleep(0.5)
            bad = (x < 0).any(dim=2).any(dim=1).nonzero().flatten().tolist()
            if bad:
                from tensorserve import RowErrors
                raise RowErrors({row: "negative" for row in bad})
            return x * 2
"""


@pytest.fixture
def crashy(tmp_path: Path) -> Path:
    dynamic = {"max_queue_delay_ms": 300.0, "dispatch": "timer"}
    write_toy_model(tmp_path, "crashy", CRASHY, **{**ECHO, "isolation": "process",
                                                   "dynamic_batching": dynamic})
    return tmp_path


def _x(value: float, length: int = 3) -> dict[str, np.ndarray]:
    return {"x": np.full((length, 4), value, np.float32)}


def _worker_outcomes(model: ServedModel, values: list[float]) -> list[object]:
    futures = model.submit_many([_x(v) for v in values])
    results: list[object] = []
    for future in futures:
        try:
            results.append(future.result(60)["y"][0, 0].item())
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            results.append(exc)
    return results


def _standby_ready(model: ServedModel) -> bool:
    standby = model.executor.standby  # type: ignore[attr-defined]
    return standby.ready is not None


def test_an_item_that_kills_its_worker_fails_alone_and_the_standby_takes_over(crashy: Path) -> None:
    with ServedModel.from_repository(crashy, "crashy") as model:
        wait_until(lambda: _standby_ready(model), "the standby worker loaded", 60)
        first = model.executor.workers[0].pid  # type: ignore[attr-defined]
        values = [1.0, 2.0, 7.0, 4.0]
        results = _worker_outcomes(model, values)
        assert model.health() is None
        assert model.executor.workers[0].pid != first  # type: ignore[attr-defined]
    assert [results[i] for i in (0, 1, 3)] == [2.0, 4.0, 8.0]
    assert isinstance(results[2], ModelFailure)
    assert results[2].message.startswith(
        "model 'crashy': this item crashed the model's worker process (model 'crashy' instance 0: "
        "the worker process died while running this batch (exit code 7)); it is not retried"
    )


def test_poison_rows_and_out_of_memory_cross_the_process_boundary(crashy: Path) -> None:
    with ServedModel.from_repository(crashy, "crashy") as model:
        results = _worker_outcomes(model, [1.0, 13.0, -1.0, 4.0, 21.0, 6.0])
        assert model.infer_sync(_x(3.0))["y"][0, 0] == 6.0
    assert [results[i] for i in (0, 3, 5)] == [2.0, 8.0, 12.0]
    assert isinstance(results[1], ModelFailure) and "poison value 13" in results[1].message
    assert isinstance(results[2], ModelFailure)
    assert results[2].message == "model 'crashy' failed this item: negative"
    assert isinstance(results[4], OutOfMemory)
    assert "OutOfMemoryError: tried to allocate a lot" in results[4].message


def test_a_frozen_worker_makes_the_model_not_ready_and_the_watchdog_replaces_it(
    crashy: Path,
) -> None:
    with ServedModel.from_repository(crashy, "crashy", faults={"watchdog_ms": 2500}) as model:
        wait_until(lambda: _standby_ready(model), "the standby worker loaded", 60)
        model.infer_sync(_x(1.0))  # a quick batch: the slowest so far is milliseconds
        frozen = model.executor.workers[0].pid  # type: ignore[attr-defined]
        future = model.submit_many([_x(55.0)])[0]  # 0.5 s in the worker
        os.kill(frozen, signal.SIGSTOP)
        try:
            wait_until(lambda: model.health() is not None, "the model not ready", 10)
            assert "has been running one batch for" in (model.health() or "")
            # The watchdog kills the frozen worker; the batch runs on the standby.
            assert future.result(30)["y"][0, 0] == 110.0
        finally:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert model.health() is None
        assert model.executor.workers[0].pid != frozen  # type: ignore[attr-defined]
        # A lone item whose worker died (here: was killed) runs once more.
        assert model.stats.snapshot(0)["recoveries"] == {"rerun": 1}


def test_workers_are_forked_from_the_template_and_close_stops_every_process(crashy: Path) -> None:
    import psutil

    model = ServedModel.from_repository(crashy, "crashy")
    with model:
        wait_until(lambda: _standby_ready(model), "the standby worker loaded", 60)
        template = model.executor.template.process.pid  # type: ignore[attr-defined]
        worker = model.executor.workers[0].pid  # type: ignore[attr-defined]
        standby = model.executor.standby.ready.pid  # type: ignore[attr-defined]
        assert psutil.Process(worker).ppid() == template
        assert psutil.Process(standby).ppid() == template
        assert model.infer_sync(_x(2.0))["y"][0, 0] == 4.0
    _, alive = psutil.wait_procs(
        [psutil.Process(p) for p in (template, worker, standby) if psutil.pid_exists(p)], timeout=10
    )
    assert not alive


def test_without_the_template_workers_are_spawned_and_crashes_still_recover(crashy: Path) -> None:
    with ServedModel.from_repository(crashy, "crashy", faults={"worker_template": False}) as model:
        assert model.executor.template is None  # type: ignore[attr-defined]
        results = _worker_outcomes(model, [1.0, 7.0, 3.0])
    assert results[0] == 2.0 and results[2] == 6.0
    assert isinstance(results[1], ModelFailure) and "crashed the model's worker" in results[1].message


def test_the_auto_watchdog_is_off_for_a_compiled_model_and_a_number_still_applies() -> None:
    def watchdog_s(**config: object) -> object:
        model = ServedModel.from_function(lambda x: x, inputs=X_IN, outputs=Y_OUT, **config)
        return model.batcher.options.watchdog_s

    assert watchdog_s() == "auto"  # 30 s until batches were timed (batching/watchdog.py)
    assert watchdog_s(compile="default") is None
    assert watchdog_s(compile="default", faults={"watchdog_ms": 2000}) == 2.0
    # A CUDA graph's capture is no minutes-long compile: the watchdog stays on.
    assert watchdog_s(compile="reduce-overhead") == "auto"
    assert watchdog_s(compile="auto") == "auto"
    assert watchdog_s(faults={"watchdog_ms": 0}) is None


def test_the_auto_watchdog_limit_is_50_times_the_slowest_batch_and_at_least_30_s() -> None:
    def limit(setting: float | str | None, slowest_s: float = 0.0) -> float | None:
        return Watchdog(SimpleNamespace(slowest_s=slowest_s), setting).limit_s  # type: ignore[arg-type]

    assert limit("auto") == 30.0  # before any batch
    assert limit("auto", slowest_s=0.1) == 30.0
    assert limit("auto", slowest_s=2.0) == 100.0
    assert (limit(2.0), limit(None), limit(0)) == (2.0, None, None)
