"""Per-request parameters through the batch (issue 16, item 2): declared in
config.toml, validated strictly (a 400 naming the parameter, on both
protocols), passed to forward one value per row of the padded batch (a
tensor for numbers, a list for booleans and strings), kept with their rows
when a failed batch is split, and per-row output parameters back to the
caller of each row — in a model thread and in a worker process."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from tensorserve import InvalidInput, ModelFailure, RowResult, ServedModel
from tensorserve.errors import ConfigError
from tensorserve.http.app import create_app
from tensorserve.repository.config import parse_config
from tensorserve.repository.parameters import RequestParameterSpec
from tensorserve.settings import Settings
from tensorserve.wire.validate import validate_parameters
from tests.helpers import MSGPACK, body, from_wire, write_toy_model

# y = x * scale + shift, row by row; every parameter comes back as an output
# parameter (with the batch size), so a test sees what each row was given.
# A batch holding the value 13 raises: a poisoned row.
PARAMS_MODEL = """
    import torch
    from tensorserve import WithParameters

    class Model(torch.nn.Module):
        def forward(self, x, scale, shift, loud, tag):
            if (x == 13).any():
                raise RuntimeError("poison value 13 in batch")
            assert scale.dtype == torch.float32 and scale.shape == (x.shape[0],)
            assert shift.dtype == torch.int64 and shift.device == x.device
            assert isinstance(loud, list) and isinstance(tag, list)
            y = x * scale[:, None, None] + shift[:, None, None]
            batch = [x.shape[0]] * x.shape[0]
            tags = [t.upper() if on else t for t, on in zip(tag, loud)]
            return WithParameters(
                {"y": y}, {"batch": batch, "scale": scale, "shift": shift, "tag": tags}
            )
"""
DECLARED = [
    {"name": "scale", "type": "float", "default": 1.0},
    {"name": "shift", "type": "int", "default": 0},
    {"name": "loud", "type": "bool", "default": False},
    {"name": "tag", "type": "string", "max_length": 8},  # required
]
# Batches of exactly four items: the timer holds a batch until it is full, so
# the tests know which callers share it.
PARAMS: dict[str, Any] = {
    "max_batch_size": 4,
    "dynamic_batching": {"dispatch": "timer", "max_queue_delay_ms": 30_000.0, "policy": "fifo"},
    "warmup": {"batch_sizes": [1]},
    "inputs": {"x": {"dtype": "float32", "shape": [-1, 4]}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1, 4]}},
    "request_parameter": DECLARED,
}


def _x(rows: int, value: float) -> np.ndarray:
    return np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) % 7 + value


# ---------------------------------------------------------------------- declarations
BASE = {"input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1]}]}


@pytest.mark.parametrize(("declared", "message"), [
    ({"name": "t", "type": "float", "default": True},
     ("request_parameter[0]: request parameter 't': default must be a finite number (float32), "
     "got True")),
    ({"name": "n", "type": "int", "default": 1.5},
     "request_parameter[0]: request parameter 'n': default must be an integer (int64), got 1.5"),
    ({"name": "s", "type": "string", "default": "abc", "max_length": 2},
     ("request_parameter[0]: request parameter 's': default must be a string of at most 2 "
     "characters, got one of 3")),
    ({"name": "t", "type": "complex"},
     "request_parameter[0].type: Input should be 'bool', 'int', 'float' or 'string'"),
    ({"name": "priority", "type": "int"},
     ("request_parameter[0].name: 'priority' is reserved by the server (parameters.priority "
     "keeps its meaning)")),
    ({"name": "top-k", "type": "int"},
     "request_parameter[0].name: 'top-k' is not a Python identifier (it is a keyword argument)"),
    ({"name": "x", "type": "int"}, "request_parameter 'x' has the name of an input"),
])
def test_a_bad_declaration_fails_the_load_saying_why(declared: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({**BASE, "request_parameter": [declared]}, "m/config.toml")
    assert str(caught.value) == f"m/config.toml: {message}"


def test_a_declared_name_given_twice_fails_the_load() -> None:
    twice = [{"name": "t", "type": "int"}, {"name": "t", "type": "float"}]
    with pytest.raises(ConfigError, match="duplicate request_parameter names: t"):
        parse_config({**BASE, "request_parameter": twice}, "m")


# ---------------------------------------------------------------------- request values
SPECS = [RequestParameterSpec.model_validate(d) for d in DECLARED]


def test_defaults_fill_what_a_request_leaves_out_and_unknown_keys_are_ignored() -> None:
    given = {"tag": "a", "timeout": 5, "whatever": [1, 2]}
    assert validate_parameters(given, SPECS, "m") == {
        "scale": 1.0, "shift": 0, "loud": False, "tag": "a"}
    assert validate_parameters({"tag": "b", "scale": 2, "loud": True}, SPECS, "m")["scale"] == 2


@pytest.mark.parametrize(("given", "message"), [
    ({}, "parameters.tag is required by model 'm': a string of at most 8 characters"),
    ({"tag": None}, "parameters.tag is required by model 'm': a string of at most 8 characters"),
    ({"tag": "far too long"}, ("parameters.tag must be a string of at most 8 characters, got one "
                              "of 12")),
    ({"tag": 7}, "parameters.tag must be a string of at most 8 characters, got 7"),
    ({"tag": "a", "scale": True}, "parameters.scale must be a finite number (float32), got True"),
    ({"tag": "a", "scale": "2"}, "parameters.scale must be a finite number (float32), got '2'"),
    ({"tag": "a", "scale": math.nan}, "parameters.scale must be a finite number (float32), got nan"),
    ({"tag": "a", "scale": math.inf}, "parameters.scale must be a finite number (float32), got inf"),
    ({"tag": "a", "scale": 1e39}, "parameters.scale must be a finite number (float32), got 1e+39"),
    ({"tag": "a", "shift": 1.0}, "parameters.shift must be an integer (int64), got 1.0"),
    ({"tag": "a", "shift": False}, "parameters.shift must be an integer (int64), got False"),
    ({"tag": "a", "shift": 1 << 63}, ("parameters.shift must be an integer (int64), got "
                                     "9223372036854775808")),
    ({"tag": "a", "loud": 1}, "parameters.loud must be a boolean, got 1"),
    ({"tag": "a", "loud": "true"}, "parameters.loud must be a boolean, got 'true'"),
])
def test_a_bad_value_is_invalid_input_naming_the_parameter(given: dict, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        validate_parameters(given, SPECS, "m")
    assert caught.value.message == message


def test_a_model_without_declarations_gets_no_new_arguments() -> None:
    seen: list[set[str]] = []

    def fn(**features: Any) -> Any:
        seen.append(set(features))
        return features["x"]

    model = ServedModel.from_function(
        fn, inputs=[{"name": "x", "dtype": "float32", "shape": [-1]}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}],
    )
    with model:
        result = model.infer_sync({"x": np.ones(3, np.float32)}, parameters={"scale": 2.0})
    assert seen == [{"x"}] and type(result) is dict


# ---------------------------------------------------------------------- through the batch
@pytest.fixture(scope="module", params=["thread", "process"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    repository = tmp_path_factory.mktemp(f"params-{request.param}")
    write_toy_model(repository, "params", PARAMS_MODEL, **PARAMS)
    # No standby worker: one worker process is all these tests need.
    model = ServedModel.from_repository(
        repository, "params", isolation=request.param, faults={"standby_worker": False}
    )
    with model:
        yield model


def _expected(x: np.ndarray, scale: float, shift: int) -> np.ndarray:
    return x * np.float32(scale) + shift


def test_callers_sharing_a_batch_each_get_their_own_values(served: ServedModel) -> None:
    # Four items from three requests: one batch (the timer waits until it is full).
    a = served.submit_many([{"x": _x(2, 0)}], parameters={"tag": "a", "scale": 2.5})
    b = served.submit_many([{"x": _x(5, 1)}, {"x": _x(1, 2)}],
                           parameters={"tag": "b", "shift": -3, "loud": True})
    c = served.submit_many([{"x": _x(3, 3)}], parameters={"tag": "c", "scale": 0.5, "shift": 7})
    rows = [future.result(60) for future in a + b + c]
    wanted = [(_x(2, 0), 2.5, 0, "a"), (_x(5, 1), 1.0, -3, "B"), (_x(1, 2), 1.0, -3, "B"),
              (_x(3, 3), 0.5, 7, "c")]
    for row, (x, scale, shift, tag) in zip(rows, wanted):
        assert isinstance(row, RowResult)
        # The padded batch's row is what the item alone with its values gives.
        np.testing.assert_allclose(row["y"], _expected(x, scale, shift), rtol=1e-6)
        assert row.parameters == {"batch": 4, "scale": scale, "shift": shift, "tag": tag}


def test_a_split_batch_keeps_each_rows_values(served: ServedModel) -> None:
    poisoned = _x(2, 0)
    poisoned[1, 2] = 13
    good = [served.submit_many([{"x": _x(3, i)}], parameters={"tag": f"t{i}", "shift": i * 10})
            for i in range(3)]
    bad = served.submit_many([{"x": poisoned}], parameters={"tag": "bad", "scale": 9.0})
    for i, futures in enumerate(good):
        row = futures[0].result(60)
        np.testing.assert_allclose(row["y"], _expected(_x(3, i), 1.0, i * 10), rtol=1e-6)
        # Ran again in a half of two, or alone: with its own values either way.
        assert row.parameters["shift"] == i * 10 and row.parameters["tag"] == f"t{i}"
        assert row.parameters["batch"] in (1, 2)
    with pytest.raises(ModelFailure, match="poison value 13"):
        bad[0].result(60)


async def test_the_values_reach_a_worker_process_with_their_batch(
    tmp_path: Path,
) -> None:
    # The scheduler's loop sends the worker the batch and its parameter columns.
    eager = {**PARAMS, "dynamic_batching": {"dispatch": "eager"}}
    write_toy_model(tmp_path, "params", PARAMS_MODEL, **eager)
    model = ServedModel.from_repository(tmp_path, "params", isolation="process",
                                        faults={"standby_worker": False})
    sent: list[Any] = []
    real = model.executor.dispatch  # type: ignore[attr-defined]

    def spy(*args: Any) -> Any:
        sent.append(args[2])
        return real(*args)

    model.executor.dispatch = spy  # type: ignore[attr-defined]
    async with model:
        model.batcher.wait_idle(30)
        row = (await model.infer_many([{"x": _x(2, 1)}],
                                      parameters={"tag": "d", "scale": 3.0, "loud": True}))[0]
    assert sent == [{"scale": [3.0], "shift": [0], "loud": [True], "tag": ["d"]}]
    np.testing.assert_allclose(row["y"], _expected(_x(2, 1), 3.0, 0))
    assert row.parameters == {"batch": 1, "scale": 3.0, "shift": 0, "tag": "D"}


def test_wrong_output_parameters_fail_the_batch_saying_why() -> None:
    from tensorserve import WithParameters

    model = ServedModel.from_function(
        lambda x: WithParameters(x, {"score": [1.0]}),
        inputs=[{"name": "x", "dtype": "float32", "shape": [2]}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [2]}],
        max_batch_size=2, dynamic_batching={"dispatch": "timer", "max_queue_delay_ms": 30_000.0},
        faults={"split_failed_batches": False},
    )
    with model:
        futures = model.submit_many([{"x": np.ones(2, np.float32)}] * 2)
        with pytest.raises(ModelFailure) as caught:
            futures[0].result(10)
    assert caught.value.message == (
        "output parameter 'score' has 1 values for a batch of 2 rows; give one per row")


# ---------------------------------------------------------------------- both protocols
@pytest.fixture
def params_app(tmp_path: Path):
    single = {**PARAMS, "max_batch_size": 4,
              "dynamic_batching": {"max_queue_delay_ms": 2.0}}
    write_toy_model(tmp_path, "params", PARAMS_MODEL, **single)
    return create_app(Settings(model_repository=tmp_path), wait_for_models=True)


def _oip(x: np.ndarray, parameters: dict[str, Any] | None = None) -> str:
    request: dict[str, Any] = {
        "inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                    "data": x.ravel().tolist()}]}
    if parameters is not None:
        request["parameters"] = parameters
    return json.dumps(request)


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(("parameters", "message"), [
    ({}, "parameters.tag is required by model 'params': a string of at most 8 characters"),
    ({"tag": "a", "scale": True}, "parameters.scale must be a finite number (float32), got True"),
    ({"tag": "a", "shift": 2.5}, "parameters.shift must be an integer (int64), got 2.5"),
    ({"tag": "123456789"},
     "parameters.tag must be a string of at most 8 characters, got one of 9"),
])
async def test_a_bad_value_is_a_400_naming_it_on_both_protocols(
    aiohttp_client: Any, params_app: Any, parameters: dict, message: str
) -> None:
    client = await aiohttp_client(params_app)
    x = _x(2, 0)
    native = await client.post("/v2/models/params/infer", headers=MSGPACK,
                               data=body([{"x": x}], parameters=parameters))
    assert native.status == 400
    error = msgpack.unpackb(await native.read())
    assert (error["error"], error["code"]) == (message, "invalid_input")
    oip = await client.post("/v2/models/params/infer", headers=JSON,
                            data=_oip(x[None], parameters))
    assert oip.status == 400
    assert (await oip.json())["error"] == message


async def test_a_non_finite_number_is_a_400(aiohttp_client: Any, params_app: Any) -> None:
    # msgpack carries NaN as it is (a JSON parser may refuse it before any check).
    client = await aiohttp_client(params_app)
    reply = await client.post("/v2/models/params/infer", headers=MSGPACK,
                              data=body([{"x": _x(1, 0)}], parameters={"tag": "a", "scale": math.nan}))
    assert reply.status == 400
    message = msgpack.unpackb(await reply.read())["error"]
    assert message == "parameters.scale must be a finite number (float32), got nan"


async def test_output_parameters_come_back_to_each_caller_on_both_protocols(
    aiohttp_client: Any, params_app: Any
) -> None:
    client = await aiohttp_client(params_app)
    # Native: one map per item, beside the items' outputs.
    native = await client.post(
        "/v2/models/params/infer", headers=MSGPACK,
        data=body([{"x": _x(2, 0)}, {"x": _x(3, 1)}],
                  parameters={"tag": "n", "shift": 4, "loud": True, "priority": 0}))
    assert native.status == 200
    reply = msgpack.unpackb(await native.read())
    assert [p["tag"] for p in reply["parameters"]] == ["N", "N"]
    assert [p["shift"] for p in reply["parameters"]] == [4, 4]
    np.testing.assert_allclose(from_wire(reply["outputs"][1]["y"]), _expected(_x(3, 1), 1.0, 4))
    # OIP: one value per row, like the outputs' batch dimension.
    oip = await client.post("/v2/models/params/infer", headers=JSON,
                            data=_oip(np.stack([_x(2, 0), _x(2, 5)]), {"tag": "o", "scale": 3.0}))
    assert oip.status == 200
    answer = await oip.json()
    assert answer["parameters"]["tag"] == ["o", "o"]
    assert answer["parameters"]["scale"] == [3.0, 3.0]
    y = np.array(answer["outputs"][0]["data"], np.float32).reshape(2, 2, 4)
    np.testing.assert_allclose(y[1], _expected(_x(2, 5), 3.0, 0))


async def test_the_models_config_lists_its_declared_parameters(
    aiohttp_client: Any, params_app: Any
) -> None:
    client = await aiohttp_client(params_app)
    reply = await client.get("/v2/models/params/config")
    assert reply.status == 200
    declared = (await reply.json())["request_parameter"]
    assert [(p["name"], p["type"], p["default"]) for p in declared] == [
        ("scale", "float", 1.0), ("shift", "int", 0), ("loud", "bool", False), ("tag", "string", None)]
