"""The dynamic batcher through its in-process API (``ServedModel``), with
batch functions whose results are tied to their inputs."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tensorserve import (
    DeadlineExceeded,
    InvalidInput,
    ModelFailure,
    ModelNotReady,
    ServedModel,
    ServerBusy,
)
from tensorserve.batching.admission import BatcherOptions
from tensorserve.batching.batcher import Batcher
from tensorserve.batching.collate import Collator
from tensorserve.batching.policy import BatchPolicy, make_policy
from tensorserve.repository.config import parse_config
from tensorserve.runtime.executor import Executed
from tests.helpers import Gate, wait_until, wait_until_async

X_IN = [{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": -1.0}]
Y_OUT = [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}]
rng = np.random.default_rng(0)


def cumsum_model(**config):
    """y = cumulative sum of x: every position depends on all earlier ones, so a
    wrong pad value, a wrong row or a wrong slice changes the numbers."""
    seen: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return torch.cumsum(x, dim=1)

    model = ServedModel.from_function(fn, inputs=X_IN, outputs=Y_OUT, **config)
    return model, seen


def items(n: int, low: int = 1, high: int = 40) -> list[dict[str, np.ndarray]]:
    return [{"x": rng.normal(size=int(rng.integers(low, high))).astype(np.float32)} for _ in range(n)]


async def test_concurrent_callers_each_get_their_own_row() -> None:
    model, seen = cumsum_model(max_batch_size=16, max_queue_delay_ms=20, dispatch="timer")
    inputs = items(64)
    async with model:
        results = await asyncio.gather(*(model.infer(item) for item in inputs))
    for item, result in zip(inputs, results):
        np.testing.assert_allclose(result["y"], np.cumsum(item["x"]), rtol=1e-5, atol=1e-5)
    assert sum(seen) == 64 and max(seen) > 1, "callers were never batched together"
    assert model.stats.snapshot(0)["avg_batch_size"] > 1


async def test_a_request_larger_than_max_batch_size_comes_back_whole_and_in_order() -> None:
    model, seen = cumsum_model(max_batch_size=4)
    inputs = items(27)
    async with model:
        results = await model.infer_many(inputs)
    assert len(results) == 27
    for item, result in zip(inputs, results):
        np.testing.assert_allclose(result["y"], np.cumsum(item["x"]), rtol=1e-5, atol=1e-5)
    assert max(seen) <= 4 and sum(seen) == 27


@pytest.mark.parametrize("policy", ["fifo", "length_aware"])
@pytest.mark.parametrize("instances", [1, 2])
def test_pipeline_never_reorders_or_loses_items(policy: str, instances: int) -> None:
    model, seen = cumsum_model(max_batch_size=8, policy=policy, instance_count=instances)
    inputs = items(300)
    with model, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(model.infer_sync, inputs))
    assert sum(seen) == 300
    for item, result in zip(inputs, results):
        np.testing.assert_allclose(result["y"], np.cumsum(item["x"]), rtol=1e-5, atol=1e-5)


async def test_results_do_not_depend_on_batch_composition() -> None:
    inputs = items(40)
    outcomes = []
    for max_batch_size in (1, 7, 40):
        model, _ = cumsum_model(max_batch_size=max_batch_size, policy="length_aware")
        async with model:
            outcomes.append(await model.infer_many(inputs))
    for a, b, c in zip(*outcomes):
        np.testing.assert_allclose(a["y"], b["y"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a["y"], c["y"], rtol=1e-5, atol=1e-5)


async def test_without_splitting_a_model_that_raises_fails_its_batch_and_the_next_succeeds() -> None:
    # (With splitting on, the default, a batch that raised runs again in
    # halves: tests/test_faults.py.)
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if len(calls) == 1:
            raise RuntimeError("CUDA says no")
        return x

    model = ServedModel.from_function(fn, inputs=X_IN, outputs=Y_OUT, max_batch_size=8,
                                      faults={"split_failed_batches": False})
    async with model:
        with pytest.raises(ModelFailure, match="RuntimeError: CUDA says no"):
            await model.infer_many(items(3))
        result = await model.infer({"x": np.ones(3, np.float32)})
    assert result["y"].tolist() == [1.0, 1.0, 1.0]
    assert model.stats.snapshot(0)["failed_items"] == 3


def test_an_exception_in_a_per_item_list_fails_that_item_only() -> None:
    def fn(x: torch.Tensor) -> list:
        return [ValueError("negative start") if row[0] < 0 else {"y": row} for row in x]

    model = ServedModel.from_function(
        fn, inputs=X_IN, outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}],
        max_batch_size=8, max_queue_delay_ms=200, dispatch="timer",
    )
    batch = [{"x": np.array([1.0, 2.0], np.float32)}, {"x": np.array([-1.0], np.float32)},
             {"x": np.array([3.0], np.float32)}]
    with model:
        futures = model.submit_many(batch)
        assert futures[0].result(5)["y"].tolist() == [1.0, 2.0]
        with pytest.raises(ModelFailure, match="ValueError: negative start"):
            futures[1].result(5)
        assert futures[2].result(5)["y"].tolist()[0] == 3.0


def test_a_result_of_the_wrong_batch_size_fails_the_batch_with_a_sentence() -> None:
    model = ServedModel.from_function(
        lambda x: [{"y": x[0]}], inputs=X_IN, outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}],
        max_batch_size=8, max_queue_delay_ms=200, dispatch="timer",
    )
    with model:
        futures = model.submit_many(items(3))
        for future in futures:
            with pytest.raises(ModelFailure, match="returned 1 results for a batch of 3 items"):
                future.result(5)


def gated_model(gate: Gate, **config) -> ServedModel:
    return ServedModel.from_function(gate, inputs=X_IN, outputs=Y_OUT, max_batch_size=4, **config)


def test_items_accumulate_while_the_model_is_busy_and_cancelled_items_are_skipped() -> None:
    gate = Gate()
    with gated_model(gate) as model:
        first = model.submit_many([{"x": np.array([0.0], np.float32)}])
        assert gate.entered.wait(5)
        later = model.submit_many([{"x": np.array([float(i)], np.float32)} for i in range(1, 4)])
        assert later[1].cancel()  # its caller went away while it was queued
        gate.release.set()
        assert first[0].result(5)["y"].tolist() == [0.0]
        assert later[0].result(5)["y"].tolist() == [1.0]
        assert later[2].result(5)["y"].tolist() == [3.0]
    assert 2.0 not in gate.seen


def test_an_item_past_its_deadline_is_not_run() -> None:
    gate = Gate()
    with gated_model(gate, max_queue_delay_ms=1000) as model:
        model.submit_many([{"x": np.array([0.0], np.float32)}])
        assert gate.entered.wait(5)
        late = model.submit_many([{"x": np.array([9.0], np.float32)}], timeout=0.01)
        threading.Event().wait(0.05)
        gate.release.set()
        with pytest.raises(DeadlineExceeded):
            late[0].result(5)
    assert 9.0 not in gate.seen


def test_a_full_queue_answers_server_busy_and_keeps_serving() -> None:
    gate = Gate()
    with gated_model(gate, max_queue_size=4) as model:
        model.submit_many([{"x": np.array([0.0], np.float32)}])
        assert gate.entered.wait(5)
        queued = model.submit_many([{"x": np.array([1.0], np.float32)}] * 4)
        with pytest.raises(ServerBusy, match="queue is full"):
            model.submit_many([{"x": np.array([2.0], np.float32)}])
        gate.release.set()
        assert all(f.result(5)["y"].tolist() == [1.0] for f in queued)


def test_close_finishes_everything_already_queued() -> None:
    gate = Gate()
    model = gated_model(gate).start()
    futures = model.submit_many([{"x": np.array([float(i)], np.float32)} for i in range(10)])
    assert gate.entered.wait(5)
    gate.release.set()
    model.close()
    assert [f.result(0)["y"].tolist() for f in futures] == [[float(i)] for i in range(10)]


def test_timer_dispatch_sends_a_full_batch_without_waiting_for_the_timer() -> None:
    model, seen = cumsum_model(max_batch_size=4, max_queue_delay_ms=60_000, dispatch="timer")
    with model:
        futures = model.submit_many(items(4))
        assert all(f.result(10)["y"].shape[0] >= 1 for f in futures)
    assert seen == [4]


def test_eager_dispatch_runs_a_lone_item_without_waiting_for_the_timer() -> None:
    model, seen = cumsum_model(max_batch_size=32, max_queue_delay_ms=60_000, dispatch="eager")
    with model:
        assert model.infer_sync({"x": np.ones(2, np.float32)}, timeout=10)["y"].tolist() == [1.0, 2.0]
    assert seen == [1]


def test_bad_items_are_rejected_before_they_are_queued() -> None:
    model, seen = cumsum_model()
    with model:
        with pytest.raises(InvalidInput, match="item 1, feature 'x': dtype int64 does not match the declared float32"):
            model.submit_many([{"x": np.ones(2, np.float32)}, {"x": np.ones(2, np.int64)}])
        with pytest.raises(InvalidInput, match="item 0: missing feature 'x'"):
            model.submit_many([{}])
        with pytest.raises(InvalidInput, match=r"expected 1 dimension\(s\)"):
            model.submit_many([{"x": np.ones((2, 2), np.float32)}])
        assert model.infer_sync({"x": [1, 2]})["y"].tolist() == [1.0, 3.0]  # lists are cast
    assert seen == [1]


async def test_an_async_caller_that_leaves_while_queued_is_skipped() -> None:
    gate = Gate()
    async with gated_model(gate) as model:
        first = asyncio.ensure_future(model.infer({"x": np.array([0.0], np.float32)}))
        assert await asyncio.to_thread(gate.entered.wait, 5)
        leaving = asyncio.ensure_future(model.infer({"x": np.array([7.0], np.float32)}))
        staying = asyncio.ensure_future(model.infer({"x": np.array([8.0], np.float32)}))
        await wait_until_async(lambda: model.batcher.queue_depth == 2, "both callers queued")
        leaving.cancel()  # e.g. the HTTP client disconnected
        with pytest.raises(asyncio.CancelledError):
            await leaving  # its futures are cancelled on the way out
        assert model.batcher.queue_depth == 1  # withdrawn at once, not at the next batch
        gate.release.set()
        assert (await first)["y"].tolist() == [0.0]
        assert (await staying)["y"].tolist() == [8.0]
    assert 7.0 not in gate.seen


def test_a_failure_while_finishing_a_batch_answers_its_callers_and_keeps_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, _ = cumsum_model(max_batch_size=4)
    calls = []

    def broken_record(*args: object, **kwargs: object) -> None:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("stats bug")

    monkeypatch.setattr(model.stats, "record_batch", broken_record)
    with model:
        with pytest.raises(ModelFailure, match="finishing the batch failed: RuntimeError"):
            model.infer_sync({"x": np.ones(2, np.float32)}, timeout=5)
        assert model.infer_sync({"x": np.ones(2, np.float32)}, timeout=5)["y"].tolist() == [1.0, 2.0]


def test_items_of_very_different_shapes_are_not_padded_into_one_huge_batch() -> None:
    shapes: list[tuple[int, ...]] = []

    def fn(image: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(image.shape))
        return image

    spec = dict(
        inputs=[{"name": "image", "dtype": "float32", "shape": [-1, -1]}],
        outputs=[{"name": "out", "dtype": "float32", "shape": [-1, -1], "unpad_like": "image"}],
        max_batch_size=8, max_queue_delay_ms=200, dispatch="timer",
    )
    tall, wide = np.ones((50, 1), np.float32), np.ones((1, 50), np.float32)
    for cap, expected in ((10_000, [(2, 50, 50)]), (1_000, [(1, 50, 1), (1, 1, 50)])):
        shapes.clear()
        with ServedModel.from_function(fn, max_batch_elements=cap, **spec) as model:
            results = model.infer_many_sync([{"image": tall}, {"image": wide}], timeout=5)
        assert sorted(shapes) == sorted(expected)
        assert [r["out"].shape for r in results] == [(50, 1), (1, 50)]


class OverlappingDevice:
    """A fake accelerator executor for the Batcher: ``launch`` returns at once,
    ``collect`` waits until the test opens the gate; records how many batches
    were launched before the first one was collected."""

    instance_count = 1
    overlaps = True
    pin_memory = False

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.launched: list[torch.Tensor] = []
        self.launched_before_first_collect: int | None = None
        self.first_collect = threading.Event()

    restarts = 0
    restart_seconds = None

    def start_instance(self, instance: int) -> None:
        pass

    def abort(self, launched: torch.Tensor, because: str) -> bool:
        return False

    def repair(self, instance: int) -> None:
        pass

    def health(self) -> str | None:
        return None

    def free_memory_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        pass

    def launch(
        self, features: dict[str, torch.Tensor], instance: int, parameters: object = None
    ) -> torch.Tensor:
        self.launched.append(features["x"])
        return features["x"]

    def collect(self, launched: torch.Tensor) -> Executed:
        if self.launched_before_first_collect is None:
            self.launched_before_first_collect = len(self.launched)
            self.first_collect.set()
        assert self.gate.wait(10)
        return Executed({"y": (launched * 2).numpy()}, None)


@pytest.mark.parametrize(
    ("policy", "ahead"),
    [
        # The budget (2 items of 10) cuts the next batch short of the 4 waiting:
        # it is as big as it gets, so it is launched while batch 1 still runs.
        (make_policy("length_aware", 20), 2),
        # FIFO would take all 2 waiting of a possible 4: that batch could still
        # grow, so it waits for the device.
        (make_policy("fifo", None), 1),
    ],
)
def test_a_full_batch_is_launched_ahead_of_a_busy_device_and_a_growing_one_waits(
    policy: BatchPolicy, ahead: int
) -> None:
    device = OverlappingDevice()
    options = BatcherOptions(max_batch_size=4 if ahead == 1 else 8, policy=policy)
    collator = Collator(parse_config({"input": X_IN, "output": Y_OUT}, "fake"))
    inputs = [{"x": np.full(10, float(i), np.float32)} for i in range(6)]
    with Batcher(device, collator, options) as batcher:
        futures = batcher.submit_many(inputs)
        assert device.first_collect.wait(10)
        # The scheduler hands the instance the second batch while the first is
        # on the device only if it cannot grow; its launch waits for no collect.
        wait_until(lambda: len(device.launched) == ahead, f"{ahead} batch(es) launched", 10)
        assert len(batcher.scheduler.running[0]) == ahead
        assert batcher.queue_depth == 6 - sum(len(b) for b in device.launched)
        device.gate.set()
        results = [f.result(10) for f in futures]
    for item, result in zip(inputs, results):  # nothing reordered or lost
        np.testing.assert_array_equal(result["y"], item["x"] * 2)
    assert sum(len(b) for b in device.launched) == 6


class SecondSelectionFails:
    """FIFO, but choosing the second batch raises: a bug in a model thread."""

    name, cost, max_batch_tokens, budget = "fifo", None, None, None

    def __init__(self) -> None:
        self.fifo, self.calls = make_policy("fifo", None), 0

    def select(self, waiting: object, max_batch_size: int) -> list[int]:
        self.calls += 1
        if self.calls == 2:  # batch 1 is on the device: forming batch 2 fails
            raise RuntimeError("selection bug")
        return self.fifo.select(waiting, max_batch_size)


def test_a_pipeline_failure_answers_the_launched_batch_and_the_queued_items() -> None:
    """A bug in a model thread (here: forming the batch to launch ahead) must
    answer every caller: the batch already on the device, and those queued."""
    device = OverlappingDevice()
    collator = Collator(parse_config({"input": X_IN, "output": Y_OUT}, "fake"))
    fatal: list[BaseException] = []
    options = BatcherOptions(max_batch_size=1, policy=SecondSelectionFails())
    batcher = Batcher(device, collator, options, on_fatal=fatal.append)
    with batcher:
        futures = batcher.submit_many([{"x": np.full(3, float(i), np.float32)} for i in range(3)])
        for future in futures:
            with pytest.raises(ModelFailure, match="internal batcher failure: RuntimeError"):
                future.result(10)
        with pytest.raises(ModelNotReady, match="not accepting"):
            batcher.submit({"x": np.ones(2, np.float32)})
    assert [type(e) for e in fatal] == [RuntimeError]
    assert len(device.launched) == 1  # batch 1 was on the device, never collected


@pytest.mark.parametrize("policy", ["fifo", "length_aware"])
@pytest.mark.parametrize("cap", ["max_batch_tokens", "max_batch_elements"])
def test_pad_to_multiple_of_is_counted_by_the_budget_and_the_element_cap(policy: str, cap: str) -> None:
    """Items of length 5 padded to a multiple of 8 take 8 per row: a budget
    (or an element cap) of 16 fits two of them, not the three that 15 real
    elements would suggest."""
    model, seen = cumsum_model(
        max_batch_size=8, max_queue_delay_ms=200, dispatch="timer", policy=policy,
        pad_to_multiple_of=8, **{"max_batch_tokens": 0, cap: 16},
    )
    with model:
        results = model.infer_many_sync([{"x": np.ones(5, np.float32)}] * 3, timeout=5)
    assert sorted(seen) == [1, 2]
    assert [r["y"].tolist() for r in results] == [[1.0, 2.0, 3.0, 4.0, 5.0]] * 3


def test_the_learnt_budget_is_taught_the_rounded_up_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    model, seen = cumsum_model(
        max_batch_size=8, max_queue_delay_ms=200, dispatch="timer", pad_to_multiple_of=8,
        max_batch_tokens="auto",
    )
    budget = model.batcher.options.policy.budget
    assert budget is not None
    taught: list[int] = []
    monkeypatch.setattr(budget, "observe", lambda padded, real, seconds: taught.append(padded))
    with model:
        model.infer_many_sync([{"x": np.ones(5, np.float32)}] * 3, timeout=5)
    assert seen == [3] and taught == [3 * 8]
