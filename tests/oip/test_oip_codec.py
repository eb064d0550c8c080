"""The OIP codec without a server: request bodies built by tritonclient's own
encoder (``generate_request_body``) decode into the right items, responses
decode with tritonclient's own parser (``InferResult.from_response_body``),
and every client-supplied size is checked."""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as triton_http

from tensorserve.errors import InvalidInput, ModelFailure
from tensorserve.repository.config import ModelConfig, parse_config
from tensorserve.tensors.dtypes import BY_V2
from tensorserve.wire import oip, triton
from tensorserve.wire.metadata import model_metadata
from tensorserve.wire.request import InferRequest, RequestedOutput

TAGGER = parse_config(
    {
        "max_batch_size": 8,
        "input": [
            {"name": "input_ids", "dtype": "int64", "shape": [-1]},
            {"name": "attention_mask", "dtype": "int64", "shape": [-1]},
        ],
        "output": [
            {"name": "logits", "dtype": "float32", "shape": [-1, 3]},
            {"name": "pooled", "dtype": "float16", "shape": [3]},
        ],
    },
    "tagger",
)
UNBATCHED = parse_config(
    {
        "max_batch_size": 0,
        "input": [{"name": "image", "dtype": "float32", "shape": [-1, -1]}],
        "output": [{"name": "filtered", "dtype": "float32", "shape": [-1, -1]}],
    },
    "filter",
)


def triton_body(
    arrays: dict[str, np.ndarray], binary: bool = True, **kwargs: Any
) -> tuple[bytes, str | None]:
    """(body, Inference-Header-Content-Length) exactly as tritonclient sends them."""
    inputs = []
    for name, array in arrays.items():
        datatype = "BF16" if array.dtype == ml_dtypes.bfloat16 else BY_V2_NAME[array.dtype.name]
        tensor = triton_http.InferInput(name, list(array.shape), datatype)
        inputs.append(tensor.set_data_from_numpy(array, binary_data=binary))
    body, header_length = triton_http.InferenceServerClient.generate_request_body(inputs, **kwargs)
    return body, None if header_length is None else str(header_length)


BY_V2_NAME = {d.numpy.name: v2 for v2, d in BY_V2.items() if v2 != "BF16"}
OUTPUT_DT = {spec.name: spec.dt for spec in TAGGER.output}


def wanted(name: str, binary: bool) -> RequestedOutput:
    return RequestedOutput(name, OUTPUT_DT[name], binary)


def decode(
    body: bytes | dict[str, Any],
    header_length: str | None = None,
    config: ModelConfig = TAGGER,
    max_items: int = 16,
) -> InferRequest:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    headers = {} if header_length is None else {oip.HEADER_LENGTH: header_length}
    return oip.decode_request(body, headers, config, max_items)


def tokens(k: int, t: int) -> dict[str, np.ndarray]:
    ids = np.arange(k * t, dtype=np.int64).reshape(k, t) + 1
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def json_request(**input_ids: Any) -> dict[str, Any]:
    base = {"name": "input_ids", "shape": [2, 3], "datatype": "INT64", "data": [1, 2, 3, 4, 5, 6]}
    mask = {"name": "attention_mask", "shape": [2, 3], "datatype": "INT64", "data": [1] * 6}
    return {"inputs": [{**base, **input_ids}, mask]}


# ---------------------------------------------------------------------- requests
@pytest.mark.parametrize("binary", [True, False])
def test_rows_of_a_batch_become_items(binary: bool) -> None:
    arrays = tokens(3, 5)
    request = decode(*triton_body(arrays, binary=binary, request_id="r-1"))
    assert request.id == "r-1"
    assert len(request.items) == 3
    for row, item in enumerate(request.items):
        assert item["input_ids"].dtype == "int64"
        np.testing.assert_array_equal(item["input_ids"].array, arrays["input_ids"][row])
        np.testing.assert_array_equal(item["attention_mask"].array, arrays["attention_mask"][row])
    # tritonclient asks for every output, as binary, when it names none
    assert request.outputs == [wanted("logits", True), wanted("pooled", True)]


def test_binary_rows_are_views_of_the_body() -> None:
    body, header_length = triton_body(tokens(2, 4))
    item = decode(body, header_length).items[1]["input_ids"].array
    assert not item.flags.owndata  # np.frombuffer on the body: no copy


def test_nested_and_flat_json_data_decode_alike() -> None:
    flat = decode(json_request())
    nested = decode(json_request(data=[[1, 2, 3], [4, 5, 6]]))
    for a, b in zip(flat.items, nested.items):
        np.testing.assert_array_equal(a["input_ids"].array, b["input_ids"].array)
    np.testing.assert_array_equal(nested.items[1]["input_ids"].array, [4, 5, 6])


def test_an_unbatched_model_takes_one_item_without_batch_dimension() -> None:
    image = np.arange(12, dtype=np.float32).reshape(3, 4)
    request = decode(*triton_body({"image": image}), config=UNBATCHED)
    assert len(request.items) == 1
    np.testing.assert_array_equal(request.items[0]["image"].array, image)


def test_max_batch_size_1_has_a_batch_dimension_as_in_triton() -> None:
    # Triton: max_batch_size >= 1 means a leading batch dimension; only 0 means
    # none. A Triton client's [1, ...] request for such a model must decode.
    one = UNBATCHED.with_overrides(max_batch_size=1)
    image = np.arange(12, dtype=np.float32).reshape(3, 4)
    request = decode(*triton_body({"image": image[None]}), config=one)
    assert len(request.items) == 1
    np.testing.assert_array_equal(request.items[0]["image"].array, image)
    with pytest.raises(InvalidInput, match="batch dimension first"):
        decode(*triton_body({"image": image}), config=one)
    # Two rows are two items (each batch the model runs still holds one).
    assert len(decode(*triton_body({"image": np.stack([image, image])}), config=one).items) == 2
    metadata = model_metadata("filter", 1, "READY", "", one)
    assert metadata["max_batch_size"] == 1 and metadata["inputs"][0]["shape"] == [-1, -1, -1]
    assert triton.model_config("filter", one)["max_batch_size"] == 1
    assert triton.model_config("filter", UNBATCHED)["max_batch_size"] == 0
    assert model_metadata("filter", 1, "READY", "", UNBATCHED)["inputs"][0]["shape"] == [-1, -1]


def test_parameters_timeout_is_microseconds_and_priority_is_accepted() -> None:
    request = decode(*triton_body(tokens(1, 2), timeout=250_000, priority=2))
    assert request.timeout == pytest.approx(0.25)
    assert request.parameters["priority"] == 2  # checked, kept, not acted on
    assert decode(*triton_body(tokens(1, 2), timeout=0)).timeout is None  # Triton: 0 = none


def test_bfloat16_json_data_becomes_bit_patterns() -> None:
    config = parse_config(
        {
            "max_batch_size": 4,
            "input": [{"name": "x", "dtype": "bfloat16", "shape": [-1]}],
            "output": [{"name": "y", "dtype": "bfloat16", "shape": [-1]}],
        },
        "bf16",
    )
    body = {
        "inputs": [{"name": "x", "shape": [1, 3], "datatype": "BF16", "data": [1.0, -2.5, 0.15625]}]
    }
    bits = decode(body, config=config).items[0]["x"].array
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(
        bits.view(ml_dtypes.bfloat16).astype(np.float32), [1.0, -2.5, 0.15625]
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"datatype": "BYTES"}, "input 'input_ids': datatype BYTES does not match the model's INT64"),
        (
            {"datatype": "INT32"},
            "input 'input_ids': datatype INT32 does not match the model's INT64",
        ),
        ({"datatype": "INT4"}, "input 'input_ids': unknown datatype 'INT4'"),
        (
            {"shape": [6]},
            "shape [6] has 1 dimension(s); the model expects [-1, -1] (batch dimension first)",
        ),
        (
            {"shape": [3, 2]},
            "inputs disagree on the batch dimension (first axis): 'input_ids': 3, 'attention_mask': 2",
        ),
        ({"data": [1.5, 2, 3, 4, 5, 6]}, "'data' holds floats; datatype INT64 needs integers"),
        ({"data": [1, 2, 3, 4, 5, "6"]}, "'data' holds values that are not numbers"),
        (
            {"data": [1, 2, 3, 4, 5, 2**64]},
            "'data' holds values that are not numbers (or out of range)",
        ),
        ({"data": [[1, 2], [3, 4, 5, 6]]}, "'data' is not a rectangular list of numbers"),
        (
            {"data": [[1, 2], [3, 4], [5, 6]]},
            "nested 'data' has shape [3, 2], but 'shape' is [2, 3]",
        ),
        ({"data": [1, 2, 3, 4, 5]}, "'data' holds 5 values, but shape [2, 3] needs 6"),
        (
            {"data": None, "parameters": {"shared_memory_region": "r"}},
            "parameters.shared_memory_region is not supported",
        ),
        (
            {"name": "token_ids"},
            "unexpected input 'token_ids'; the model takes 'input_ids', 'attention_mask'",
        ),
    ],
)
def test_bad_inputs_are_named_with_what_is_wrong(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput) as error:
        decode(json_request(**change))
    assert message in error.value.message


@pytest.mark.parametrize(
    "shape, message",
    [
        ([2, 0, 4], "shape [2, 0, 4]: axis 1 has length 0; it must be between 1 and 16"),
        ([2, 17, 4], "shape [2, 17, 4]: axis 1 has length 17; it must be between 1 and 16"),
        ([2, 3, 5], "shape [2, 3, 5]: axis 2 must be 4 (the model expects [-1, -1, 4])"),
    ],
)
def test_axes_are_checked_in_the_requests_own_numbering(shape: list[int], message: str) -> None:
    config = parse_config(
        {
            "max_batch_size": 4,
            "input": [{"name": "x", "dtype": "float32", "shape": [-1, 4], "max_length": 16}],
            "output": [{"name": "y", "dtype": "float32", "shape": [-1, 4]}],
        },
        "frames",
    )
    size = int(np.prod(shape))
    body = {"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": [0.0] * size}]}
    with pytest.raises(InvalidInput) as error:
        decode(body, config=config)
    assert error.value.message == f"input 'x': {message}"


def test_out_of_range_json_integers_are_refused() -> None:
    config = parse_config(
        {
            "max_batch_size": 4,
            "input": [{"name": "x", "dtype": "uint8", "shape": [-1]}],
            "output": [{"name": "y", "dtype": "uint8", "shape": [-1]}],
        },
        "u8",
    )
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "UINT8", "data": [1, 300]}]}
    with pytest.raises(InvalidInput, match=r"integers out of range for datatype UINT8 \(0 to 255\)"):
        decode(body, config=config)


@pytest.mark.parametrize(
    "k, message",
    [
        (0, "the batch dimension is 0; it must be between 1 and 4"),
        (5, "the batch dimension is 5; it must be between 1 and 4"),
    ],
)
def test_the_batch_dimension_is_bounded_by_max_items(k: int, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        decode(*triton_body(tokens(k, 2)), max_items=4)


def test_missing_and_repeated_inputs() -> None:
    with pytest.raises(InvalidInput, match="missing input\\(s\\) 'attention_mask'"):
        decode({"inputs": json_request()["inputs"][:1]})
    with pytest.raises(InvalidInput, match="input 'attention_mask' is given twice"):
        request = json_request()
        decode({"inputs": request["inputs"] + request["inputs"][1:]})


# ---------------------------------------------------------------------- binary sizes
def test_binary_sizes_must_add_up_to_the_body_exactly() -> None:
    body, header_length = triton_body(tokens(2, 3))
    with pytest.raises(
        InvalidInput, match="add up to 96 bytes, but 97 bytes follow the JSON header"
    ):
        decode(body + b"\0", header_length)
    with pytest.raises(
        InvalidInput, match="binary_data_size 48 runs past the end of the binary data"
    ):
        decode(body[:-1], header_length)


def test_a_binary_size_must_match_the_shape() -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input_ids",
                    "shape": [1, 3],
                    "datatype": "INT64",
                    "parameters": {"binary_data_size": 16},
                },
                {"name": "attention_mask", "shape": [1, 2], "datatype": "INT64", "data": [1, 1]},
            ]
        }
    ).encode()
    with pytest.raises(
        InvalidInput, match=r"data holds 16 bytes, but shape \[1, 3\] of int64 needs 24"
    ):
        decode(header + bytes(16), str(len(header)))


@pytest.mark.parametrize("header_length", ["ten", "0", "-5", "100000"])
def test_the_header_length_is_checked(header_length: str) -> None:
    body, _ = triton_body(tokens(1, 2))
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length"):
        decode(body, header_length)


def test_binary_data_without_the_header_length_is_not_json() -> None:
    body, _ = triton_body(tokens(1, 2))
    with pytest.raises(InvalidInput, match="not valid JSON"):
        decode(body, None)


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"timeout": -1}, "parameters.timeout must be a non-negative integer (microseconds)"),
        ({"timeout": "1s"}, "parameters.timeout must be a non-negative integer"),
        ({"priority": -2}, "parameters.priority must be a non-negative integer"),
        ({"sequence_id": 7}, "sequence batching (parameters.sequence_id) is not supported"),
        ({"binary_data_output": "yes"}, "parameters.binary_data_output must be a boolean"),
    ],
)
def test_request_parameters_are_checked(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput) as error:
        decode({**json_request(), "parameters": parameters})
    assert message in error.value.message


def test_bad_json_and_ids() -> None:
    with pytest.raises(InvalidInput, match="not valid JSON"):
        decode(b"{" * 100_000)  # deeply nested: RecursionError becomes a 400
    with pytest.raises(InvalidInput, match="'id' must be a string"):
        decode({**json_request(), "id": 5})
    with pytest.raises(InvalidInput, match="'inputs' must be a non-empty list"):
        decode({"inputs": []})


# ---------------------------------------------------------------------- outputs
def test_requested_outputs_keep_order_and_their_own_binary_flag() -> None:
    request = decode(
        {
            **json_request(),
            "parameters": {"binary_data_output": True},
            "outputs": [
                {"name": "pooled"},
                {"name": "logits", "parameters": {"binary_data": False}},
            ],
        }
    )
    assert request.outputs == [wanted("pooled", True), wanted("logits", False)]
    assert decode(json_request()).outputs[0].binary is False  # JSON unless asked


@pytest.mark.parametrize(
    "outputs, message",
    [
        ([{"name": "probs"}], "unknown output 'probs'; the model produces 'logits', 'pooled'"),
        ([{"name": "logits"}, {"name": "logits"}], "output 'logits' is requested twice"),
        (
            [{"name": "logits", "parameters": {"classification": 3}}],
            "parameters.classification is not supported",
        ),
        (
            [{"name": "logits", "parameters": {"binary_data": 1}}],
            "parameters.binary_data must be a boolean",
        ),
    ],
)
def test_bad_output_requests(outputs: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(InvalidInput) as error:
        decode({**json_request(), "outputs": outputs})
    assert message in error.value.message


# ---------------------------------------------------------------------- responses
def encode(
    outputs: list[tuple[str, bool, np.ndarray]], request_id: str | None = "r"
) -> triton_http.InferResult:
    """The reply to a request for ``outputs`` whose rows the model returned
    one item at a time, parsed by tritonclient."""
    k = len(outputs[0][2])
    results = [{name: array[row] for name, _, array in outputs} for row in range(k)]
    request = InferRequest([], [wanted(name, binary) for name, binary, _ in outputs], request_id)
    encoded = oip.encode_response(request, results, "tagger", "1", TAGGER)
    header_length = None if encoded.headers is None else int(encoded.headers[oip.HEADER_LENGTH])
    return triton_http.InferResult.from_response_body(encoded.body, header_length=header_length)


def test_binary_and_json_outputs_decode_with_tritonclient() -> None:
    logits = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3) / 7
    pooled = np.array([[0.5, -1, 2], [3, 4, 5]], dtype=np.float16)
    for binary in (True, False):
        result = encode([("pooled", binary, pooled), ("logits", not binary, logits)])
        assert result.get_response()["id"] == "r"
        assert [o["name"] for o in result.get_response()["outputs"]] == ["pooled", "logits"]
        np.testing.assert_array_equal(result.as_numpy("logits"), logits)
        np.testing.assert_array_equal(result.as_numpy("pooled"), pooled)


def test_the_header_length_is_only_set_when_something_is_binary() -> None:
    rows = [{"logits": np.zeros((2, 3), np.float32)}]
    as_json = InferRequest([], [wanted("logits", False)])
    encoded = oip.encode_response(as_json, rows, "m", "1", TAGGER)
    assert encoded.headers is None and len(encoded.chunks) == 1
    assert encoded.content_type == "application/json"
    assert "id" not in json.loads(encoded.body)
    as_binary = InferRequest([], [wanted("logits", True)])
    encoded = oip.encode_response(as_binary, rows, "m", "1", TAGGER)
    assert encoded.content_type == "application/octet-stream"
    assert encoded.headers == {oip.HEADER_LENGTH: str(len(encoded.chunks[0]))}
    assert bytes(encoded.chunks[1]) == np.zeros((1, 2, 3), np.float32).tobytes()


def test_only_many_json_values_move_the_encoder_off_the_loop() -> None:
    rows = [{"logits": np.zeros((1000, 3), np.float32)}] * 11  # 33,000 values
    assert oip.encode_is_costly(InferRequest([], [wanted("logits", False)]), rows)
    assert not oip.encode_is_costly(InferRequest([], [wanted("logits", False)]), rows[:10])
    assert not oip.encode_is_costly(InferRequest([], [wanted("logits", True)]), rows)
    assert oip.decode_is_costly(bytes(oip.COSTLY_BODY_BYTES + 1))
    assert not oip.decode_is_costly(bytes(oip.COSTLY_BODY_BYTES))


def _y(shape: list[int], max_batch_size: int = 8) -> ModelConfig:
    return parse_config(
        {"max_batch_size": max_batch_size,
         "input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
         "output": [{"name": "y", "dtype": "float32", "shape": shape}]}, "y")


def test_rows_stack_into_a_dense_batch_and_must_agree() -> None:
    rows = [{"y": np.full((2, 3), i, np.float32)} for i in range(4)]
    stacked = oip.stack_rows(rows, "y", _y([2, 3]))
    assert stacked.shape == (4, 2, 3) and stacked[3, 0, 0] == 3
    assert oip.stack_rows(rows[:1], "y", _y([2, 3], max_batch_size=0)).shape == (2, 3)
    uneven = rows + [{"y": np.zeros((1, 3), np.float32)}]
    with pytest.raises(ModelFailure, match="different shapes"):  # a fixed shape: the model's bug
        oip.stack_rows(uneven, "y", _y([2, 3]))
    with pytest.raises(InvalidInput, match="send one item per request"):  # a -1 axis: the caller's
        oip.stack_rows(uneven, "y", _y([-1, 3]))
