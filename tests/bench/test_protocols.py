"""The bench's request encoders, one per protocol: what each writes is read
back by the server's own decoders (wire/native.py, wire/oip.py) and
validator as the very items it was made from."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from tensorserve_bench.protocols import (
    HEADER_LENGTH,
    PROTOCOLS,
    decode_error,
    encode_request,
    json_body,
    msgpack_body,
)

from tensorserve.repository.config import ModelConfig, parse_config
from tensorserve.wire import native, oip
from tensorserve.wire.validate import validate_item

# Three dtypes, a variable axis and a fixed one: a wrong dtype, row order or
# reshape would each show.
INPUTS: list[dict[str, Any]] = [
    {"name": "input_ids", "dtype": "int64", "shape": [-1]},
    {"name": "features", "dtype": "float32", "shape": [-1, 3]},
    {"name": "flags", "dtype": "bool", "shape": [2]},
]
DTYPES = {spec["name"]: spec["dtype"] for spec in INPUTS}
CODECS = {"msgpack": native, "json": oip, "binary": oip}


def config(max_batch_size: int) -> ModelConfig:
    return parse_config(
        {
            "max_batch_size": max_batch_size,
            "input": INPUTS,
            "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
        },
        "toy",
    )


def items(count: int, length: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "input_ids": rng.integers(1, 30000, size=length),  # int64
            # float64 arrays: the encoder casts them to the model's float32
            "features": rng.standard_normal((length, 3)),
            "flags": rng.integers(0, 2, size=2).astype(bool),
        }
        for _ in range(count)
    ]


def decoded(protocol: str, made: list[dict[str, np.ndarray]], model: ModelConfig) -> list[Any]:
    """The server's reading of the encoded request: its items, validated."""
    encoded = encode_request(protocol, made, DTYPES, batched=model.batching)
    request = CODECS[protocol].decode_request(encoded.body, encoded.headers, model, 64)
    return [validate_item(item, model.input, index) for index, item in enumerate(request.items)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("count", [1, 3])
def test_the_server_reads_back_the_items(protocol: str, count: int) -> None:
    made = items(count, length=5)
    back = decoded(protocol, made, config(max_batch_size=8))
    assert len(back) == count
    for item, read in zip(made, back):
        assert read.keys() == item.keys()
        for name, array in item.items():
            assert read[name].dtype == np.dtype(DTYPES[name])
            np.testing.assert_array_equal(read[name], array.astype(DTYPES[name]))


@pytest.mark.parametrize("protocol", ["json", "binary"])
def test_a_model_that_does_not_batch_gets_its_one_item_without_the_batch_axis(
    protocol: str,
) -> None:
    (item,) = made = items(1, length=4)
    (read,) = decoded(protocol, made, config(max_batch_size=1))
    np.testing.assert_array_equal(read["features"], item["features"].astype(np.float32))
    body = encode_request(protocol, made, DTYPES, batched=False).body
    assert b'"shape":[4,3]' in body  # no leading [1, ...]
    with pytest.raises(ValueError, match="one item per request"):
        encode_request(protocol, items(2, length=4), DTYPES, batched=False)


@pytest.mark.parametrize("protocol", ["json", "binary"])
def test_kserve_rows_of_one_request_share_their_shape(protocol: str) -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        encode_request(protocol, [*items(1, length=3), *items(1, length=4)], DTYPES)


def test_the_spellings() -> None:
    item = {"input_ids": np.array([5, 6, 7], np.int64)}
    assert json_body([item], {"input_ids": "int64"}) == (
        b'{"inputs":[{"name":"input_ids","shape":[1,3],"datatype":"INT64","data":[5,6,7]}]}'
    )
    binary = encode_request("binary", [item], {})
    length = int(binary.headers[HEADER_LENGTH])
    header = json.loads(binary.body[:length])
    assert header["inputs"][0]["parameters"] == {"binary_data_size": 24}
    assert header["parameters"] == {"binary_data_output": True}  # the answer in binary too
    assert binary.body[length:] == item["input_ids"].tobytes()
    assert binary.content_type == "application/octet-stream"
    named = encode_request("binary", [item], {}, binary_outputs=["logits"])
    header = json.loads(named.body[: int(named.headers[HEADER_LENGTH])])
    assert header["outputs"] == [{"name": "logits", "parameters": {"binary_data": True}}]
    with pytest.raises(ValueError, match="unknown protocol"):
        encode_request("grpc", [item], {})


def test_native_request_parameters_reach_the_decoder() -> None:
    body = msgpack_body(items(1, length=2), DTYPES, parameters={"timeout_ms": 250})
    request = native.decode_request(body, {}, config(max_batch_size=8), 64)
    assert request.timeout == pytest.approx(0.25)


def test_error_bodies_of_either_protocol() -> None:
    error = native.encode_error("no such model", "MODEL_NOT_FOUND")
    assert decode_error(error) == {"error": "no such model", "code": "MODEL_NOT_FOUND"}
    as_json = json.dumps({"error": "bad", "code": "INVALID_INPUT"}).encode()
    assert decode_error(as_json)["code"] == "INVALID_INPUT"  # type: ignore[index]
    assert decode_error(b"<html>502 Bad Gateway</html>") is None
    assert decode_error(json.dumps({"outputs": []}).encode()) is None
