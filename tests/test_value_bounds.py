"""An input's ``min_value`` / ``max_value`` (issue 34, item 1): a value outside
is its caller's 400 ``invalid_input`` naming the input, the value and the
bound, checked once for every protocol (``wire.validate.check_range``)
before the item is queued: it never reaches the model, and the next good
request is served. On a GPU an id past an embedding table is a device-side
assert that poisons the whole CUDA context; on a CPU it fails the batch."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from tensorserve import InvalidInput
from tensorserve.repository.config import InputSpec
from tensorserve.wire.validate import validate_item
from tests.conftest import ServerProcess
from tests.helpers import MSGPACK, body, from_wire, write_toy_model


# ---------------------------------------------------------------------- the rule
def spec(dtype: str = "int64", **bounds: Any) -> InputSpec:
    return InputSpec.model_validate({"name": "ids", "dtype": dtype, "shape": [-1], **bounds})


def problem(value: Any, input_spec: InputSpec) -> str | None:
    try:
        validate_item({"ids": value}, [input_spec], 0)
    except InvalidInput as error:
        return error.message
    return None


def test_values_within_the_bounds_pass_and_the_bounds_themselves_are_inside() -> None:
    ids = spec(min_value=0, max_value=4095)
    assert problem(np.array([0, 17, 4095]), ids) is None
    assert problem(np.array([5000]), spec()) is None  # no bounds: no check


@pytest.mark.parametrize(
    "value, input_spec, message",
    [
        (np.array([3, 5000, 4096, 9]), spec(min_value=0, max_value=4095),
         "value 5000 is above max_value 4095"),
        (np.array([3, -2, -7]), spec(min_value=0, max_value=4095), "value -7 is below min_value 0"),
        (np.array([0.5, 2.25], np.float32), spec("float32", max_value=2), "value 2.25 is above max_value 2"),
        (np.array([1.0, np.nan], np.float32), spec("float32", min_value=0.0),
         "value nan is outside the input's bounds (min_value 0.0)"),
        # bfloat16 travels as its bit patterns (uint16): 3.0 is 0x4040, compared as a number.
        (torch.tensor([1.0, 3.0], dtype=torch.bfloat16), spec("bfloat16", max_value=2),
         "value 3.0 is above max_value 2"),
        ([1, 4096], spec(max_value=4095), "value 4096 is above max_value 4095"),  # a JSON list
        (torch.tensor([-1, 1]), spec(min_value=0), "value -1 is below min_value 0"),  # in-process
    ],
    ids=["above", "below", "float", "nan", "bfloat16", "list", "torch"],
)
def test_a_value_outside_is_refused_naming_the_input_the_value_and_the_bound(
    value: Any, input_spec: InputSpec, message: str
) -> None:
    assert problem(value, input_spec) == f"item 0, feature 'ids': {message}"


# ---------------------------------------------------------------------- end to end
# Appends every value of every batch it runs to SEEN: what reached the model.
RECORDING_MODEL = """
    import torch

    SEEN = {seen!r}

    class Model(torch.nn.Module):
        def forward(self, ids):
            with open(SEEN, "a") as log:
                log.write("".join(f"{{v}}\\n" for v in ids.flatten().tolist()))
            return ids.to(torch.float32) * 2
"""
BOUNDED: dict[str, Any] = {
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_ms": 1.0},
    "warmup": {"enabled": False},
    "inputs": {"ids": {"dtype": "int64", "shape": [-1], "min_value": 0, "max_value": 4095}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1]}},
}
ABOVE = "item 0, feature 'ids': value 5000 is above max_value 4095"
BELOW = "item 0, feature 'ids': value -3 is below min_value 0"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    repo = tmp_path_factory.mktemp("bounds_repo")
    seen = repo / "seen"
    write_toy_model(repo, "bounded", RECORDING_MODEL.format(seen=str(seen)), **BOUNDED)
    server = ServerProcess(repo)
    yield server, seen
    server.stop()


def seen_values(seen: Path) -> set[int]:
    return {int(v) for v in seen.read_text().split()} if seen.exists() else set()


def post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def native(server: ServerProcess, ids: list[int]) -> tuple[int, dict[str, Any]]:
    status, reply = post(f"{server.url}/v2/models/bounded/infer",
                         body([{"ids": np.array(ids, np.int64)}]), MSGPACK)
    return status, msgpack.unpackb(reply)


def kserve_json(server: ServerProcess, ids: list[int]) -> tuple[int, dict[str, Any]]:
    request = {"inputs": [{"name": "ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids}]}
    status, reply = post(f"{server.url}/v2/models/bounded/infer", json.dumps(request).encode(),
                         {"Content-Type": "application/json"})
    return status, json.loads(reply)


def grpc_infer(server: ServerProcess, ids: list[int]) -> tuple[str, Any]:
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    tensor = triton_grpc.InferInput("ids", [1, len(ids)], "INT64")
    tensor.set_data_from_numpy(np.array([ids], np.int64))
    try:
        return "OK", client.infer("bounded", [tensor]).as_numpy("y")
    except InferenceServerException as error:
        return error.status(), error.message()
    finally:
        client.close()


@pytest.mark.parametrize("bad, message", [([7, 5000, 12], ABOVE), ([-3, 1], BELOW)],
                         ids=["above", "below"])
def test_every_protocol_answers_400_invalid_input_and_the_model_never_sees_it(
    served: tuple[ServerProcess, Path], bad: list[int], message: str
) -> None:
    server, seen = served
    status, reply = native(server, bad)
    assert status == 400 and (reply["code"], reply["error"]) == ("invalid_input", message)
    status, reply = kserve_json(server, bad)
    assert status == 400 and reply["error"] == message
    assert grpc_infer(server, bad) == ("StatusCode.INVALID_ARGUMENT", message)
    # The next good request is served, on every protocol.
    status, reply = native(server, [1, 4095])
    assert status == 200
    np.testing.assert_array_equal(from_wire(reply["outputs"][0]["y"]), [2.0, 8190.0])
    status, reply = kserve_json(server, [0, 2])
    assert status == 200 and reply["outputs"][0]["data"] == [0.0, 4.0]
    status, y = grpc_infer(server, [3])
    assert status == "OK" and y.tolist() == [[6.0]]
    reached = seen_values(seen)
    assert {0, 1, 2, 3, 4095} <= reached
    assert not reached & {5000, -3}, "a refused value reached the model"


def test_the_config_endpoint_shows_the_bounds(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    with urllib.request.urlopen(f"{server.url}/v2/models/bounded/config", timeout=30) as response:
        config = json.loads(response.read())
    assert (config["input"][0]["min_value"], config["input"][0]["max_value"]) == (0, 4095)


def test_warm_up_items_hold_a_value_the_input_accepts() -> None:
    """Warm-up requests are validated too: a model whose ids start at 5 loads."""
    from tensorserve import ServedModel

    seen: list[int] = []

    def fn(ids: torch.Tensor) -> torch.Tensor:
        seen.extend(ids.flatten().tolist())
        return ids * 2

    model = ServedModel.from_function(
        fn,
        inputs=[{"name": "ids", "dtype": "int64", "shape": [-1], "min_value": 5, "max_value": 9}],
        outputs=[{"name": "y", "dtype": "int64", "shape": [-1]}],
        max_batch_size=4,
    )
    with model:
        model.warmup()
    assert seen and set(seen) == {5}
