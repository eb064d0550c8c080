"""``grpc/scan.py``: a serialized ``ModelInferRequest`` is counted against the
model before protobuf parses it (issue #52). Each refusal below would
otherwise have been parsed whole: an element per entry."""

from __future__ import annotations

import tracemalloc

import pytest

from tensorserve.errors import InvalidInput
from tensorserve.grpc import scan
from tensorserve.grpc.generated import grpc_service_pb2 as pb
from tensorserve.repository.config import parse_config

MAX_ITEMS = 64
CONFIG = parse_config(
    {
        "max_batch_size": 8,
        "input": [
            {"name": "words", "dtype": "bytes", "shape": [-1], "max_length": 16},
            {"name": "ids", "dtype": "int64", "shape": [-1], "max_length": 16},
            {"name": "real", "dtype": "float32", "shape": [4]},
        ],
        "output": [{"name": "n", "dtype": "int64", "shape": [1]}],
    },
    "m",
)


def request(**contents: list[object]) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m", model_version="2")
    for name, values in contents.items():
        datatype, field = {
            "words": ("BYTES", "bytes_contents"),
            "ids": ("INT64", "int64_contents"),
            "real": ("FP32", "fp32_contents"),
        }[name]
        tensor = message.inputs.add(name=name, datatype=datatype, shape=[1, len(values)])
        getattr(tensor.contents, field).extend(values)
    return message


def check(message: pb.ModelInferRequest | bytes) -> None:
    data = message if isinstance(message, bytes) else message.SerializeToString()
    scan.check(data, CONFIG, MAX_ITEMS)


def test_valid_requests_pass_and_name_their_model() -> None:
    valid = request(words=[b"a", b"bc"], ids=[1, -2, 2**62], real=[0.5] * 4)
    valid.outputs.add(name="n").parameters["binary_data"].bool_param = True
    valid.parameters["priority"].int64_param = 1
    check(valid)
    raw = pb.ModelInferRequest(model_name="m")
    raw.inputs.add(name="real", datatype="FP32", shape=[1, 4])
    raw.raw_input_contents.append(bytes(16))
    check(raw)
    assert scan.model_name(valid.SerializeToString()) == ("m", "2")
    assert scan.model_name(b"") == ("", "")


@pytest.mark.parametrize(
    ("values", "phrase"),
    [
        ({"words": [b"ab"]}, r"contents.bytes_contents holds more than 1 values; shape \[1, 1\]"),
        ({"ids": [1, 2**40]}, r"contents.int64_contents holds more than 1 values; shape \[1, 1\]"),
        ({"real": [0.5, 0.5]}, r"contents.fp32_contents holds more than 1 values; shape \[1, 1\]"),
    ],
)
def test_values_beyond_the_shape_are_refused(values: dict[str, list[object]], phrase: str) -> None:
    message = request(**{name: v * 2 for name, v in values.items()})
    del message.inputs[0].shape[:]
    message.inputs[0].shape.extend([1, 1])
    with pytest.raises(InvalidInput, match=phrase):
        check(message)


def test_values_beyond_what_the_model_holds_are_refused_whatever_the_shape() -> None:
    message = request(words=[b""] * 2000)  # 64 items x 16 strings: 1024 at most
    message.inputs[0].shape[:] = [1, 10**12]
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match="holds at most 1024 \\(max_items_per_request 64"):
            check(message)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_too_many_fields_and_dimensions_are_refused() -> None:
    outputs = pb.ModelInferRequest(model_name="m")
    for _ in range(scan.MOST_FIELDS + 1):
        outputs.outputs.add(name="n")
    with pytest.raises(InvalidInput, match="ModelInferRequest holds more than 4096 fields"):
        check(outputs)
    with pytest.raises(InvalidInput, match="more than 4096 fields"):
        scan.model_name(outputs.SerializeToString())
    parameters = request(ids=[1])
    for key in range(scan.MOST_FIELDS + 1):
        parameters.inputs[0].parameters[str(key)].int64_param = 1
    with pytest.raises(InvalidInput, match="input 'ids' holds more than 4096 fields"):
        check(parameters)
    rank = request(ids=[1])
    rank.inputs[0].shape.extend([1] * scan.MOST_DIMS)
    with pytest.raises(InvalidInput, match="input 'ids': shape has more than 64 dimensions"):
        check(rank)


@pytest.mark.parametrize("cut", [1, 5, 9])
def test_a_truncated_message_is_refused(cut: int) -> None:
    data = request(words=[b"abc"]).SerializeToString()
    with pytest.raises(InvalidInput, match="not a valid protobuf message"):
        check(data[:-cut])
