"""Priority levels (Triton's ``priority_levels`` / ``default_priority_level``):
higher levels are taken first, a lower level is not starved past its
deadline, the length-aware policy groups lengths within what priority
allows, and a request's priority is validated on both protocols."""

from __future__ import annotations

import json
from concurrent.futures import Future

import msgpack
import numpy as np
import pytest

from tensorserve import InvalidInput, ServedModel
from tensorserve.batching.admission import AdmissionQueue, BatcherOptions, Pending
from tensorserve.batching.policy import make_policy
from tensorserve.errors import ConfigError
from tensorserve.http.app import create_app
from tensorserve.repository.config import parse_config
from tensorserve.settings import Settings
from tests.helpers import ECHO, MSGPACK, POISON_MODEL, Gate, body, write_toy_model


def _entry(volume: int, priority: int, enqueued: float = 0.0,
           deadline: float | None = None) -> Pending:
    return Pending(item=volume, volume=volume, future=Future(), loop=None, enqueued=enqueued,
                   deadline=deadline, priority=priority)


def _queue(policy: str = "fifo", **options: object) -> AdmissionQueue:
    opts = BatcherOptions(priority_levels=3, max_batch_size=2, policy=make_policy(policy, None),
                          **options)  # type: ignore[arg-type]
    return AdmissionQueue(opts, lambda items: len(items) * max(items), "toy")


def test_higher_levels_are_taken_first_and_arrival_order_within_a_level() -> None:
    queue = _queue()
    low, mid, first, second = _entry(1, 3), _entry(2, 2), _entry(3, 1), _entry(4, 1)
    queue.admit([low, mid, first, second], 0.0)
    assert queue.take(0.0) == [first, second]
    assert queue.take(0.0) == [mid, low]


def test_a_lower_level_half_way_to_its_deadline_goes_before_every_level() -> None:
    queue = _queue()
    patient = _entry(1, 3, enqueued=0.0, deadline=10.0)
    flood = [_entry(1, 1, enqueued=t) for t in (1.0, 2.0, 3.0, 4.0)]
    queue.admit([patient, *flood], 0.0)
    assert patient not in queue.take(4.9)  # 49% of its time gone: the flood first
    assert queue.take(5.0)[0] is patient  # half of it gone: first in the next batch


def test_the_length_aware_policy_groups_lengths_only_within_what_priority_allows() -> None:
    queue = _queue(policy="length_aware")
    long_high, short_high = _entry(100, 1), _entry(3, 1)
    short_low = [_entry(3, 2), _entry(4, 2)]
    queue.admit([long_high, *short_low, short_high], 0.0)
    # Lengths alone would pair the three short ones; level 1 fills the batch.
    assert sorted(p.volume for p in queue.take(0.0)) == [3, 100]


def test_priority_levels_are_checked_in_config() -> None:
    base = {"input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
            "output": [{"name": "y", "dtype": "float32", "shape": [-1]}]}
    with pytest.raises(ConfigError, match="default_priority_level 3 is not one of the 2"):
        parse_config({**base, "dynamic_batching": {"priority_levels": 2,
                                                    "default_priority_level": 3}}, "m")


def _model(**batching: object) -> ServedModel:
    return ServedModel.from_function(
        lambda x: x * 2,
        inputs=[{"name": "x", "dtype": "float32", "shape": [-1]}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}],
        dynamic_batching=batching,
    )


@pytest.mark.parametrize(("priority", "level"), [(None, 3), (0, 3), (1, 1), (3, 3)])
def test_a_requests_priority_becomes_its_level(priority: int | None, level: int) -> None:
    assert _model(priority_levels=3).priority_level(priority) == level


def test_the_default_level_applies_to_a_request_without_one() -> None:
    assert _model(priority_levels=3, default_priority_level=2).priority_level(None) == 2


@pytest.mark.parametrize(("priority", "message"), [
    (4, ("parameters.priority must be 1 (highest) to 3 for model 'function' (0: its default "
         "level), got 4")),
    (-1, "parameters.priority must be a non-negative integer, got -1"),
    (True, "parameters.priority must be a non-negative integer, got True"),
    ("1", "parameters.priority must be a non-negative integer, got '1'"),
    (1.5, "parameters.priority must be a non-negative integer, got 1.5"),
])
def test_a_priority_outside_the_levels_is_invalid_input(priority: object, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        _model(priority_levels=3).priority_level(priority)
    assert caught.value.message == message


def test_a_model_without_levels_accepts_and_ignores_any_priority() -> None:
    assert _model().priority_level(7) == 0


def test_queued_high_priority_items_run_before_earlier_low_priority_ones() -> None:
    gate = Gate()
    model = ServedModel.from_function(
        gate, inputs=[{"name": "x", "dtype": "float32", "shape": [-1]}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}],
        max_batch_size=2, dynamic_batching={"priority_levels": 2, "policy": "fifo"},
    )

    def item(v: float) -> dict[str, np.ndarray]:
        return {"x": np.full(2, v, np.float32)}

    with model:
        blocker = model.submit_many([item(0.0)])  # holds the only instance
        gate.wait_entered()
        low = model.submit_many([item(1.0), item(2.0)], priority=2)
        high = model.submit_many([item(3.0), item(4.0)], priority=1)
        gate.release.set()
        for future in blocker + low + high:
            future.result(10)
    assert gate.seen == [0.0, 3.0, 4.0, 1.0, 2.0]


# ---------------------------------------------------------------------- both protocols
@pytest.fixture
def prioritised_app(tmp_path):
    write_toy_model(tmp_path, "echo", POISON_MODEL,
                    **{**ECHO, "dynamic_batching": {"priority_levels": 2}})
    return create_app(Settings(model_repository=tmp_path), wait_for_models=True)


async def test_priority_is_validated_on_both_protocols(aiohttp_client, prioritised_app) -> None:
    client = await aiohttp_client(prioritised_app)
    x = np.ones((2, 4), np.float32)
    native = await client.post("/v2/models/echo/infer", headers=MSGPACK,
                               data=body([{"x": x}], parameters={"priority": 5}))
    assert native.status == 400
    assert "parameters.priority must be 1 (highest) to 2" in msgpack.unpackb(await native.read())["error"]
    oip = {"inputs": [{"name": "x", "shape": [1, 2, 4], "datatype": "FP32",
                       "data": x.ravel().tolist()}],
           "parameters": {"priority": 5}}
    reply = await client.post("/v2/models/echo/infer", data=json.dumps(oip),
                              headers={"Content-Type": "application/json"})
    assert reply.status == 400
    assert "parameters.priority must be 1 (highest) to 2" in (await reply.json())["error"]
    ok = await client.post("/v2/models/echo/infer", headers=MSGPACK,
                           data=body([{"x": x}], parameters={"priority": 1}))
    assert ok.status == 200
