"""Overload and the queue: slots of items that timed out or whose caller left
are free at once, a request that can never be admitted is a 413 that says
why, and a 503's Retry-After is an estimate from how fast the queue drains."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import msgpack
import numpy as np
import pytest

from tensorserve import DeadlineExceeded, ServedModel, ServerBusy
from tensorserve.batching.admission import AdmissionQueue, BatcherOptions, Pending, retry_after_s
from tensorserve.batching.drain import DrainRate
from tensorserve.errors import RequestTooLarge
from tensorserve.http.app import create_app
from tensorserve.settings import Settings
from tests.helpers import ECHO, MSGPACK, POISON_MODEL, Gate, body, write_toy_model

X_IN = [{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": 0.0}]
Y_OUT = [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}]


def _entry(deadline: float | None = None) -> Pending:
    return Pending(item=1, volume=1, future=Future(), loop=None, enqueued=0.0, deadline=deadline)


def _queue(size: int) -> AdmissionQueue:
    return AdmissionQueue(BatcherOptions(max_queue_size=size), lambda items: len(items), "toy")


# ---------------------------------------------------------------------- admission
def test_a_request_larger_than_the_queue_is_refused_as_too_large_not_busy() -> None:
    queue = _queue(4)
    with pytest.raises(RequestTooLarge) as caught:
        queue.admit([_entry() for _ in range(5)], 0.0)
    assert caught.value.code == "request_too_large"
    assert caught.value.message == (
        "model 'toy': a request of 5 items can never be queued (the queue holds at most 4); "
        "send at most 4 items per request"
    )


def test_items_whose_caller_left_or_whose_deadline_passed_free_their_slots() -> None:
    queue = _queue(4)
    left, late, live = _entry(), _entry(deadline=5.0), [_entry(), _entry()]
    queue.admit([left, late, *live], 0.0)
    left.future.cancel()
    queue.withdraw([left])  # what the batcher does when a caller cancels (O(1))
    assert queue.make_room(2, 1.0) == []  # at t=1 the late one is still on time
    with pytest.raises(ServerBusy):  # 3 live + 2 > 4
        queue.admit([_entry(), _entry()], 1.0)
    newcomer = [_entry(), _entry()]
    expired = queue.make_room(2, 6.0)  # the late one leaves, with its answer
    assert [(entry, type(error), failed) for entry, error, failed in expired] == [
        (late, DeadlineExceeded, True)
    ]
    assert str(expired[0][1]) == "model 'toy': item waited past its deadline"
    queue.admit(newcomer, 6.0)  # room for two
    assert queue.drain() == [*live, *newcomer]


def test_retry_after_is_the_queue_ahead_over_the_measured_drain_rate() -> None:
    rate = DrainRate()
    assert retry_after_s(rate.seconds_for(100)) == 1.0  # nothing measured: the lower bound
    for second in range(10):
        rate.taken(20, float(second), left=50)  # 20 items a second, from a backlog
    assert rate.seconds_for(100) == pytest.approx(100 / 20)
    assert retry_after_s(rate.seconds_for(1)) == 1.0  # clamped below
    assert retry_after_s(rate.seconds_for(100_000)) == 60.0  # and above


async def test_an_item_that_timed_out_leaves_the_queue_at_once() -> None:
    gate = Gate(timeout=30)
    model = ServedModel.from_function(gate, inputs=X_IN, outputs=Y_OUT, max_batch_size=1,
                                      max_queue_size=8)
    item = {"x": np.ones(3, np.float32)}
    async with model:
        running = asyncio.ensure_future(model.infer(item))  # holds the only instance
        await asyncio.to_thread(gate.wait_entered)
        with pytest.raises(DeadlineExceeded):
            await model.infer_many([item] * 6, timeout=0.05)
        waiting = asyncio.ensure_future(model.infer_many([item] * 8, timeout=30))
        await asyncio.sleep(0)
        # The six that timed out left at once: all eight fresh ones got in.
        assert model.batcher.queue_depth == 8
        gate.release.set()
        assert len(await waiting) == 8
        await running


# ---------------------------------------------------------------------- over HTTP
@pytest.fixture
def small_queue_app(tmp_path):
    write_toy_model(tmp_path, "echo", POISON_MODEL,
                    **{**ECHO, "dynamic_batching": {"max_queue_size": 4}})
    return create_app(Settings(model_repository=tmp_path), wait_for_models=True)


async def test_a_request_that_can_never_fit_is_a_413_naming_the_limit(aiohttp_client,
                                                                       small_queue_app) -> None:
    client = await aiohttp_client(small_queue_app)
    items = [{"x": np.ones((2, 4), np.float32)}] * 5
    reply = await client.post("/v2/models/echo/infer", data=body(items), headers=MSGPACK)
    assert reply.status == 413
    error = msgpack.unpackb(await reply.read())
    assert error["code"] == "request_too_large"
    assert "send at most 4 items per request" in error["error"]
    assert "Retry-After" not in reply.headers
