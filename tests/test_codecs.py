"""The codecs' shared rules: one strict caster for plain lists of numbers,
strict timeouts, and hostile shapes of data (a list where a name should be)
that are 400s, never 500s, on both protocols; and the client's dtype table
is the server's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
from tensorserve_client import _tensors as client_tensors

from tensorserve.errors import InvalidInput
from tensorserve.http.app import create_app
from tensorserve.settings import MAX_TIMEOUT_S, Settings
from tensorserve.repository.value_bounds import RANGES
from tensorserve.tensors.dtypes import DTYPES, bfloat16_bits, bfloat16_floats
from tensorserve.wire.lists import array_from_list
from tests.helpers import MSGPACK, body, from_wire, write_toy_model

JSON = {"Content-Type": "application/json"}


# ---------------------------------------------------------------------- the caster alone
def cast(data: Any, dtype: str) -> np.ndarray:
    return array_from_list(data, DTYPES[dtype], "item 0, feature 'x'", what="the list", v2=False)


@pytest.mark.parametrize(
    "data, dtype, expected",
    [
        ([1, 2, 3], "int64", np.array([1, 2, 3], np.int64)),
        ([[1, -2], [3, 4]], "int8", np.array([[1, -2], [3, 4]], np.int8)),
        ([0, 255], "uint8", np.array([0, 255], np.uint8)),
        ([2**63], "uint64", np.array([2**63], np.uint64)),
        ([True, False], "bool", np.array([True, False])),
        ([1, 2.5], "float32", np.array([1, 2.5], np.float32)),
        ([1, 2], "float16", np.array([1, 2], np.float16)),
        ([float("nan"), float("inf")], "float32", np.array([np.nan, np.inf], np.float32)),
        (7, "int32", np.array(7, np.int32)),  # a bare number: a 0-d tensor
    ],
)
def test_good_lists_cast_exactly(data: Any, dtype: str, expected: np.ndarray) -> None:
    array = cast(data, dtype)
    assert array.dtype == expected.dtype and array.shape == expected.shape
    np.testing.assert_array_equal(array, expected)


def test_bfloat16_lists_become_bit_patterns() -> None:
    bits = cast([1.0, -2.5, 3], "bfloat16")
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits.view(ml_dtypes.bfloat16).astype(np.float32), [1, -2.5, 3])


def test_bfloat16_is_rounded_and_read_back_as_torch_does_without_torch() -> None:
    # A front-end process converts BF16 with numpy alone (tensors/dtypes.py):
    # every bit pattern it could be given, and the halfway cases, agree with torch.
    import torch

    floats = np.concatenate([
        np.random.default_rng(0).integers(0, 2**32, 1_000_000, np.uint64).astype(np.uint32),
        np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00000001, 0x80000000, 0x7F800000],
                 np.uint32),  # ties to even (down, up), to inf, subnormal, -0, inf
    ]).view(np.float32)
    ours = bfloat16_bits(floats)
    theirs = torch.from_numpy(floats.copy()).to(torch.bfloat16).view(torch.uint16).numpy()
    nan = np.isnan(floats)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(bfloat16_floats(ours[nan])).all()  # a NaN stays a NaN
    patterns = np.arange(2**16, dtype=np.uint16)
    read = torch.from_numpy(patterns.copy()).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(bfloat16_floats(patterns).view(np.uint32), read.view(np.uint32))
    assert bfloat16_bits(np.float32(1.5)).shape == ()  # a 0-d tensor stays one


def test_the_value_ranges_checked_without_torch_are_torchs() -> None:
    import torch

    for name, (least, greatest) in RANGES.items():
        dt = DTYPES[name].torch_dtype
        info: Any = torch.finfo(dt) if dt.is_floating_point else torch.iinfo(dt)
        assert (least, greatest) == (info.min, info.max), name
    assert set(RANGES) == set(DTYPES) - {"bool", "bytes"}


def test_an_empty_list_is_left_to_the_shape_checks() -> None:
    array = cast([], "int64")
    assert array.dtype == np.int64 and array.shape == (0,)


DEEP: list[Any] = [1]
for _ in range(70):
    DEEP = [DEEP]

BAD_LISTS = [
    ([1.7], "int64", "the list holds floats; dtype int64 needs integers"),
    ([1, 2.0], "int32", "the list holds floats; dtype int32 needs integers"),
    ([2], "bool", "the list holds integers; dtype bool needs booleans"),
    ([1, 0], "bool", "the list holds integers; dtype bool needs booleans"),
    ([0.5], "bool", "the list holds floats; dtype bool needs booleans"),
    ([True], "int64", "the list holds booleans; dtype int64 needs integers"),
    ([False, True], "float32", "the list holds booleans; dtype float32 needs numbers"),
    ([128], "int8", "the list holds integers out of range for dtype int8 (-128 to 127)"),
    ([-1], "uint8", "the list holds integers out of range for dtype uint8 (0 to 255)"),
    ([1, 256], "uint8", "the list holds integers out of range for dtype uint8 (0 to 255)"),
    ([2**63], "int64", "the list holds integers out of range for dtype int64"),
    ([2**64], "uint64", "the list holds values that are not numbers (or out of range)"),
    (["5"], "int64", "the list holds values that are not numbers"),
    ([1, None], "float32", "the list holds values that are not numbers"),
    ([1e300], "float32", "the list holds numbers out of range for dtype float32"),
    ([70000], "float16", "the list holds numbers out of range for dtype float16"),
    ([1e300], "bfloat16", "the list holds numbers out of range for dtype bfloat16"),
    ([[1, 2], [3]], "int64", "the list is not a rectangular list of numbers"),
    ([1, [2]], "float32", "the list is not a rectangular list of numbers"),
    (DEEP, "int64", "the list is not a rectangular list of numbers"),
]


@pytest.mark.parametrize("data, dtype, message", BAD_LISTS)
def test_bad_lists_are_refused_naming_where(data: Any, dtype: str, message: str) -> None:
    with pytest.raises(InvalidInput) as error:
        cast(data, dtype)
    assert error.value.message.startswith(f"item 0, feature 'x': {message}"), error.value.message


def test_the_oip_naming_of_the_same_rule() -> None:
    with pytest.raises(InvalidInput) as error:
        array_from_list([1.7], DTYPES["int64"], "input 'x'", what="'data'", v2=True)
    assert error.value.message == "input 'x': 'data' holds floats; datatype INT64 needs integers"


# ---------------------------------------------------------------------- a server
# One input of each kind the caster treats differently; the output shows
# every input's values, so a wrong cast or a wrong row is visible.
KINDS_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, ids, small, byte, flag, real):
            return (
                ids.double() * 1000 + small.double() * 100 + byte.double() * 10
                + flag.double() + real.double()
            )
"""
KINDS = {
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_ms": 1.0},
    "inputs": {
        "ids": {"dtype": "int64", "shape": [-1]},
        "small": {"dtype": "int8", "shape": [-1]},
        "byte": {"dtype": "uint8", "shape": [-1]},
        "flag": {"dtype": "bool", "shape": [-1]},
        "real": {"dtype": "float32", "shape": [-1]},
    },
    "outputs": {"y": {"dtype": "float64", "shape": [-1]}},
}
GOOD: dict[str, list[Any]] = {
    "ids": [5, 6, 7],
    "small": [-3, 0, 3],
    "byte": [0, 9, 255],
    "flag": [True, False, True],
    "real": [0.5, 1, -2.25],
}
V2 = {name: DTYPES[spec["dtype"]].v2 for name, spec in KINDS["inputs"].items()}
NUMPY = {name: DTYPES[spec["dtype"]].numpy for name, spec in KINDS["inputs"].items()}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("codecs")
    write_toy_model(repo, "kinds", KINDS_MODEL, **KINDS)
    return repo


@pytest.fixture
async def client(aiohttp_client: Any, repository: Path) -> Any:
    return await aiohttp_client(
        create_app(Settings(model_repository=repository), wait_for_models=True)
    )


async def native(client: Any, payload: bytes) -> tuple[int, Any]:
    response = await client.post("/v2/models/kinds/infer", data=payload, headers=MSGPACK)
    return response.status, msgpack.unpackb(await response.read())


async def oip(client: Any, message: dict[str, Any] | bytes) -> tuple[int, Any]:
    data = message if isinstance(message, bytes) else json.dumps(message).encode()
    response = await client.post("/v2/models/kinds/infer", data=data, headers=JSON)
    return response.status, json.loads(await response.read())


def oip_inputs(features: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per request (shape [1, T]), every input as JSON data."""
    return [
        {"name": name, "datatype": V2[name], "shape": [1, 3], "data": [value]}
        for name, value in features.items()
    ]


def expected_y(features: dict[str, Any]) -> np.ndarray:
    f = {
        name: np.asarray(value, NUMPY[name]).astype(np.float64) for name, value in features.items()
    }
    return f["ids"] * 1000 + f["small"] * 100 + f["byte"] * 10 + f["flag"] + f["real"]


# (feature, value, what the caster says about it, in native words)
BAD_FEATURES = [
    ("ids", [1.7, 2, 3], "holds floats; {dtype} needs integers"),
    ("flag", [2, 0, 1], "holds integers; {dtype} needs booleans"),
    ("flag", [1, 1, 1], "holds integers; {dtype} needs booleans"),
    ("ids", [True, True, False], "holds booleans; {dtype} needs integers"),
    ("real", [True, False, True], "holds booleans; {dtype} needs numbers"),
    ("small", [1, 2, 200], "holds integers out of range for {dtype} (-128 to 127)"),
    ("byte", [1, -2, 3], "holds integers out of range for {dtype} (0 to 255)"),
    ("byte", [1, 2, 256], "holds integers out of range for {dtype} (0 to 255)"),
    ("ids", [[1, 2], [3]], "is not a rectangular list of numbers"),
]


@pytest.mark.parametrize("feature, value, rule", BAD_FEATURES)
async def test_the_strict_caster_on_the_native_protocol(
    client: Any, feature: str, value: Any, rule: str
) -> None:
    status, reply = await native(client, body([{**GOOD, feature: value}]))
    assert (status, reply["code"]) == (400, "invalid_input")
    dtype = f"dtype {KINDS['inputs'][feature]['dtype']}"
    expected = f"item 0, feature {feature!r}: the list {rule.format(dtype=dtype)}"
    assert reply["error"].startswith(expected), reply["error"]


@pytest.mark.parametrize("feature, value, rule", BAD_FEATURES)
async def test_the_strict_caster_on_the_open_inference_protocol(
    client: Any, feature: str, value: Any, rule: str
) -> None:
    inputs = oip_inputs(GOOD)
    for tensor in inputs:
        if tensor["name"] == feature:
            tensor["data"] = [value]  # the row of a [1, T] tensor
    status, reply = await oip(client, {"inputs": inputs})
    assert (status, reply["code"]) == (400, "invalid_input")
    datatype = f"datatype {V2[feature]}"
    expected = f"input {feature!r}: 'data' {rule.format(dtype=datatype)}"
    assert reply["error"].startswith(expected), reply["error"]


async def test_good_lists_give_the_rows_typed_tensors_give(client: Any) -> None:
    typed = {name: np.asarray(value, NUMPY[name]) for name, value in GOOD.items()}
    other = {**GOOD, "ids": [9, 8, 7], "real": [-1, 2, 0.125]}  # ints for a float input
    status, by_list = await native(client, body([GOOD, other]))
    assert status == 200, by_list
    status, by_type = await native(client, body([typed]))
    assert status == 200, by_type
    y = [from_wire(output["y"]) for output in by_list["outputs"]]
    np.testing.assert_array_equal(y[0], from_wire(by_type["outputs"][0]["y"]))
    np.testing.assert_array_equal(y[0], expected_y(GOOD))
    np.testing.assert_array_equal(y[1], expected_y(other))
    status, reply = await oip(client, {"inputs": oip_inputs(GOOD)})
    assert status == 200, reply
    assert reply["outputs"][0]["shape"] == [1, 3]
    np.testing.assert_array_equal(reply["outputs"][0]["data"], expected_y(GOOD))


# ---------------------------------------------------------------------- timeouts
LIMIT_MS = MAX_TIMEOUT_S * 1000


@pytest.mark.parametrize(
    "timeout, shown",
    [
        (True, "True"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (-1, "-1"),
        (0, "0"),
        (1e300, "1e+300"),
        (LIMIT_MS + 1, str(LIMIT_MS + 1)),
        ("5", "'5'"),
        ([5], "[5]"),
    ],
)
async def test_native_timeouts_are_strict(client: Any, timeout: Any, shown: str) -> None:
    status, reply = await native(client, body([GOOD], parameters={"timeout_ms": timeout}))
    assert status == 400
    assert reply["error"] == (
        f"parameters.timeout_ms must be a positive number (milliseconds), at most {LIMIT_MS} "
        f"(one hour); got {shown}"
    )


@pytest.mark.parametrize("timeout", [0.5, 250, LIMIT_MS, None])
async def test_native_timeouts_in_bounds_are_accepted(client: Any, timeout: Any) -> None:
    status, reply = await native(client, body([GOOD], parameters={"timeout_ms": timeout}))
    if timeout == 0.5 and status == 504:
        # Accepted, then expired: half a millisecond can pass before a busy
        # machine's model thread reaches the item. Never a 400.
        assert reply["code"] == "deadline_exceeded", reply
        return
    assert status == 200, reply


LIMIT_US = MAX_TIMEOUT_S * 1_000_000


@pytest.mark.parametrize(
    "timeout, shown",
    [
        ("true", "True"),
        ("NaN", "nan"),
        ("Infinity", "inf"),
        ("-1", "-1"),
        ("1.5", "1.5"),
        ("250000.0", "250000.0"),  # a float, even a whole one: Triton sends integers
        ("1e300", "1e+300"),
        (str(LIMIT_US + 1), str(LIMIT_US + 1)),
        ('"5"', "'5'"),
        ("{}", "{}"),
    ],
)
async def test_oip_timeouts_are_strict(client: Any, timeout: str, shown: str) -> None:
    header = json.dumps({"inputs": oip_inputs(GOOD)})
    status, reply = await oip(
        client, f'{{"parameters": {{"timeout": {timeout}}}, {header[1:]}'.encode()
    )
    assert status == 400
    assert reply["error"] == (
        f"parameters.timeout must be a non-negative integer (microseconds), 0 for no timeout, "
        f"at most {LIMIT_US} (one hour); got {shown}"
    )


@pytest.mark.parametrize("timeout", [0, 1_000_000, LIMIT_US])
async def test_oip_timeouts_in_bounds_are_accepted(client: Any, timeout: int) -> None:
    status, reply = await oip(
        client, {"parameters": {"timeout": timeout}, "inputs": oip_inputs(GOOD)}
    )
    assert status == 200, reply


# ---------------------------------------------------------------------- hostile shapes of data
def typed(dtype: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [3], "data": np.asarray(GOOD["ids"], np.int64).tobytes()}


@pytest.mark.parametrize("dtype", [["int64"], {"int64": 1}])
async def test_a_native_dtype_that_is_a_list_or_a_map_is_a_400(client: Any, dtype: Any) -> None:
    status, reply = await native(client, body([{**GOOD, "ids": typed(dtype)}]))
    assert status == 400
    assert reply["error"].startswith("item 0, feature 'ids': unknown dtype ")
    assert "expected one of bool, uint8" in reply["error"]


@pytest.mark.parametrize("key", [[1, 2], {"a": 1}])
async def test_a_native_feature_name_that_is_a_list_or_a_map_is_a_400(
    client: Any, key: Any
) -> None:
    packer = msgpack.Packer()
    item = packer.pack_map_header(1) + packer.pack(key) + packer.pack([1, 2, 3])
    payload = packer.pack_map_header(1) + packer.pack("items") + packer.pack_array_header(1) + item
    status, reply = await native(client, payload)
    assert status == 400
    assert reply["error"].startswith("body is not valid msgpack: ")
    assert "is not allowed for map key" in reply["error"]


@pytest.mark.parametrize("datatype", [["INT64"], {"INT64": 1}])
async def test_an_oip_datatype_that_is_a_list_or_a_map_is_a_400(client: Any, datatype: Any) -> None:
    inputs = oip_inputs(GOOD)
    inputs[0]["datatype"] = datatype
    status, reply = await oip(client, {"inputs": inputs})
    assert status == 400
    assert reply["error"].startswith("input 'ids': unknown datatype ")


@pytest.mark.parametrize("name", [["ids"], {"ids": 1}])
async def test_an_oip_name_that_is_a_list_or_a_map_is_a_400(client: Any, name: Any) -> None:
    inputs = oip_inputs(GOOD)
    inputs[0]["name"] = name
    status, reply = await oip(client, {"inputs": inputs})
    assert (status, reply["error"]) == (400, "inputs[0]: 'name' must be a string")
    status, reply = await oip(client, {"inputs": oip_inputs(GOOD), "outputs": [{"name": name}]})
    assert (status, reply["error"]) == (400, "outputs[0] must be an object with a string 'name'")


# ---------------------------------------------------------------------- the client's table
def test_the_clients_dtype_table_is_the_servers() -> None:
    """The client speaks only the native protocol, so it has numpy names and
    no v2 ones: every name, and the host dtype under it, must be the server's."""
    client = client_tensors.WIRE_DTYPES
    assert set(client) == set(DTYPES)
    for name, dt in DTYPES.items():
        assert client[name] == dt.numpy, name
    # Arrays going out are named as the server reads them (bfloat16 only from torch).
    for dtype, name in client_tensors.WIRE_NAMES.items():
        assert DTYPES[name].numpy == dtype and name != "bfloat16"
