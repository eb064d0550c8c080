"""The Open Inference Protocol (KServe v2) infer codec, with Triton's binary
tensor data extension; a codec in the sense of ``wire/request.py``. Pure:
bytes in, items out; results in, bytes out.

Request body: a JSON header, optionally followed by raw tensor bytes. When
the ``Inference-Header-Content-Length: N`` header is sent, the first N bytes
are the JSON and the rest are the binary inputs, in input order, each taking
``parameters.binary_data_size`` bytes (little-endian, C order; a BYTES
tensor's elements each a 4-byte little-endian length and its bytes,
``tensors/bytes_tensor.py``)::

    {"id"?: str,
     "parameters"?: {"timeout"?: µs, "priority"?: int, "binary_data_output"?: bool},
     "inputs": [{"name", "shape", "datatype", "data"? | "parameters": {"binary_data_size"}}],
     "outputs"?: [{"name", "parameters"?: {"binary_data"?: bool}}]}

How OIP batches map onto tensorserve items: a batching model's inputs carry a
leading batch dimension, ``[k, *item_shape]``; row ``i`` of every input forms
item ``i``, so one request is ``k`` items for the batcher, padded together
with other requests' rows of other lengths. Its un-padded outputs stack back
into dense ``[k, ...]`` tensors (rows of different lengths: a 400). As in
Triton, only ``max_batch_size`` 0 means no batch dimension.

Response: ``{"model_name", "model_version", "id"?, "outputs": [...], "parameters"?}``;
binary outputs carry ``parameters.binary_data_size`` and their bytes follow the
JSON in output order (``Inference-Header-Content-Length``: the JSON's length).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tensorserve.errors import InvalidInput, ModelFailure
from tensorserve.repository.config import InputSpec, ModelConfig, OutputSpec
from tensorserve.tensors.wire_tensor import WireTensor, check_shape, from_bytes, to_bytes
from tensorserve.wire import oip_json
from tensorserve.wire.oip_inputs import (
    check_batch,
    check_shape_against,
    check_string_count,
    datatype,
    from_json_data,
)
from tensorserve.wire.request import (
    EncodedResponse,
    InferRequest,
    RequestedOutput,
    Results,
    response_parameters,
    timeout_seconds,
)
from tensorserve.wire.validate import check_priority

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"

# Triton parameters that ask for features tensorserve does not have; refusing
# them beats silently returning something other than what was asked for.
_UNSUPPORTED_TENSOR_PARAMETERS = (
    "shared_memory_region",
    "shared_memory_byte_size",
    "classification",
)


# ---------------------------------------------------------------------- decoding
def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(JSON header, binary section) of a request body."""
    if header_length is None:
        return body, memoryview(b"")
    try:
        length = int(header_length)
    except ValueError:
        raise InvalidInput(
            f"{HEADER_LENGTH} must be an integer, got {header_length[:40]!r}"
        ) from None
    if not 0 < length <= len(body):
        raise InvalidInput(f"{HEADER_LENGTH} is {length}, but the body holds {len(body)} bytes")
    view = memoryview(body)
    return bytes(view[:length]), view[length:]


def _parse_json(header: bytes) -> dict[str, Any]:
    try:
        message = oip_json.loads(header)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidInput(f"the inference request header is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise InvalidInput("the inference request must be a JSON object with an 'inputs' list")
    return message


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{where}: 'parameters' must be a JSON object")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _request_parameters(parameters: dict[str, Any]) -> tuple[float | None, bool]:
    """(timeout in seconds, binary_data_output). ``priority`` is checked here
    (a non-negative integer) and against the model's priority levels by
    ``ServedModel.priority_level``."""
    if parameters.get("sequence_id") not in (None, 0, ""):
        raise InvalidInput("sequence batching (parameters.sequence_id) is not supported")
    timeout = timeout_seconds(  # Triton: a timeout of 0 means "no timeout"
        parameters.get("timeout"),
        "parameters.timeout",
        "microseconds",
        1e-6,
        integral=True,
        zero_means_none=True,
    )
    check_priority(parameters.get("priority"))
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidInput("parameters.binary_data_output must be a boolean")
    return timeout, binary_default


def _refuse_unsupported(parameters: Mapping[str, Any], where: str) -> None:
    for key in _UNSUPPORTED_TENSOR_PARAMETERS:
        if key in parameters:
            raise InvalidInput(f"{where}: parameters.{key} is not supported by tensorserve")


def _decode_input(
    tensor: Any,
    index: int,
    specs: Mapping[str, InputSpec],
    binary: memoryview,
    offset: int,
    batched: bool,
    max_items: int,
) -> tuple[str, np.ndarray, int]:
    """(name, host array, new binary offset) of one request input."""
    if not isinstance(tensor, dict):
        raise InvalidInput(f"inputs[{index}] must be a JSON object")
    name = tensor.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f"inputs[{index}]: 'name' must be a string")
    where = f"input {name!r}"
    spec = specs.get(name)
    if spec is None:
        raise InvalidInput(f"unexpected {where}; the model takes {', '.join(map(repr, specs))}")
    dt = datatype(tensor.get("datatype"), spec, where)
    shape = check_shape(tensor.get("shape"), where)
    check_shape_against(shape, spec, batched, where)
    if batched:  # before a row is built: 8M empty BYTES rows took 2.6 s to refuse
        check_batch(shape[0], max_items)
    parameters = _parameters(tensor.get("parameters"), where)
    _refuse_unsupported(parameters, where)
    size = parameters.get("binary_data_size")
    if size is None:
        if "data" not in tensor:
            raise InvalidInput(f"{where}: give either 'data' or parameters.binary_data_size")
        return name, from_json_data(tensor["data"], dt, shape, where), offset
    if "data" in tensor:
        raise InvalidInput(f"{where}: give either 'data' or parameters.binary_data_size, not both")
    if not _is_int(size) or size < 0:
        raise InvalidInput(f"{where}: binary_data_size must be a non-negative integer")
    if offset + size > len(binary):
        raise InvalidInput(
            f"{where}: binary_data_size {size} runs past the end of the binary data "
            f"({len(binary)} bytes after the {HEADER_LENGTH} header bytes)"
        )
    wire = from_bytes(dt.name, list(shape), binary[offset : offset + size], where)
    return name, wire.array, offset + size


def _requested_outputs(
    value: Any, outputs: Sequence[OutputSpec], binary_default: bool
) -> list[RequestedOutput]:
    if value is None:
        return [RequestedOutput(spec.name, spec.dt, binary_default) for spec in outputs]
    if not isinstance(value, list):
        raise InvalidInput("'outputs' must be a list")
    known = {spec.name: spec for spec in outputs}
    requested: list[RequestedOutput] = []
    for index, entry in enumerate(value):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InvalidInput(f"outputs[{index}] must be an object with a string 'name'")
        name = entry["name"]
        if name not in known:
            raise InvalidInput(
                f"unknown output {name!r}; the model produces {', '.join(map(repr, known))}"
            )
        if any(r.name == name for r in requested):
            raise InvalidInput(f"output {name!r} is requested twice")
        parameters = _parameters(entry.get("parameters"), f"output {name!r}")
        _refuse_unsupported(parameters, f"output {name!r}")
        binary = parameters.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise InvalidInput(f"output {name!r}: parameters.binary_data must be a boolean")
        requested.append(RequestedOutput(name, known[name].dt, binary))
    return requested


def decode_request(
    body: bytes, headers: Mapping[str, str], config: ModelConfig, max_items: int
) -> InferRequest:
    """Decode and check one request against the model; ``InvalidInput`` names
    the input and what is wrong. Per-item checks (lengths, fixed axes) are
    left to ``wire.validate`` like for every caller."""
    header, binary = split_body(body, headers.get(HEADER_LENGTH))
    check_string_count(header, config, max_items)
    return decode_message(_parse_json(header), binary, config, max_items)


def decode_message(
    message: dict[str, Any], binary: memoryview, config: ModelConfig, max_items: int
) -> InferRequest:
    """A request already parsed into the JSON header's shape, and its binary
    section: the one OIP check both transports share (the gRPC front end
    builds this from a ``ModelInferRequest``)."""
    request_id = message.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    parameters = _parameters(message.get("parameters"), "request")
    timeout, binary_default = _request_parameters(parameters)
    tensors = message.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise InvalidInput("'inputs' must be a non-empty list")
    specs = {spec.name: spec for spec in config.input}
    batched = config.batching
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for index, tensor in enumerate(tensors):
        name, array, offset = _decode_input(
            tensor, index, specs, binary, offset, batched, max_items
        )
        if name in arrays:
            raise InvalidInput(f"input {name!r} is given twice")
        arrays[name] = array
    if offset != len(binary):
        raise InvalidInput(
            f"the inputs' binary_data_size add up to {offset} bytes, but {len(binary)} bytes "
            f"follow the JSON header"
        )
    missing = [name for name in specs if name not in arrays]
    if missing:
        raise InvalidInput(f"missing input(s) {', '.join(map(repr, missing))}")
    outputs = _requested_outputs(message.get("outputs"), config.output, binary_default)
    items = _split_rows(arrays, specs, batched, max_items)
    return InferRequest(items, outputs, request_id, timeout, parameters)


def _split_rows(
    arrays: dict[str, np.ndarray], specs: Mapping[str, InputSpec], batched: bool, max_items: int
) -> list[dict[str, WireTensor]]:
    """Row ``i`` of every input is item ``i`` (views, no copies)."""
    if not batched:
        return [{name: WireTensor(specs[name].dtype, a) for name, a in arrays.items()}]
    sizes = {name: array.shape[0] for name, array in arrays.items()}
    if len(set(sizes.values())) > 1:
        detail = ", ".join(f"{name!r}: {k}" for name, k in sizes.items())
        raise InvalidInput(f"inputs disagree on the batch dimension (first axis): {detail}")
    k = next(iter(sizes.values()))
    check_batch(k, max_items)
    return [
        {name: WireTensor(specs[name].dtype, array[row]) for name, array in arrays.items()}
        for row in range(k)
    ]


# ---------------------------------------------------------------------- encoding
def stack_rows(results: Results, name: str, config: ModelConfig) -> np.ndarray:
    """One output of a request: its items' un-padded rows, stacked. Rows of an
    output with a -1 axis that differ are the caller's to split (400)."""
    batched = config.batching
    if not batched:
        return results[0][name]
    if len(results) == 1:  # one row (the common case): a view, not np.stack's copy
        return results[0][name][np.newaxis]
    rows = [result[name] for result in results]
    if any(row.shape != rows[0].shape for row in rows):
        shapes = sorted({tuple(row.shape) for row in rows})
        if any(o.variable_length for o in config.output if o.name == name):
            raise InvalidInput(f"output {name!r}: the {len(rows)} rows of this request have "
                               f"different shapes {shapes}, which one KServe v2 tensor cannot "
                               f"hold; send one item per request, or use the native protocol, "
                               f"which answers each item with its own rows")  # fmt: skip
        raise ModelFailure(
            f"output {name!r}: the rows of one request came back with different shapes {shapes}"
        )
    return np.stack(rows)


def encode_response(
    request: InferRequest,
    results: Results,
    model_name: str,
    model_version: str,
    config: ModelConfig,
) -> EncodedResponse:
    """The requested outputs, each the request's rows stacked back into one
    dense tensor: the JSON, then the binary outputs' bytes in order (with
    ``Inference-Header-Content-Length`` when anything is binary)."""
    message: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        message["id"] = request.id
    tensors: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    for requested in request.outputs:
        array = stack_rows(results, requested.name, config)
        tensor: dict[str, Any] = {
            "name": requested.name,
            "datatype": requested.dt.v2,
            "shape": list(array.shape),
        }
        if requested.binary:
            data = to_bytes(array, requested.dt)
            tensor["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            tensor["data"] = oip_json.tensor_data(array, requested.dt)
        tensors.append(tensor)
    message["outputs"] = tensors
    if parameters := response_parameters(results, config.batching):
        message["parameters"] = parameters
    header = oip_json.dumps(message)
    if not chunks:
        return EncodedResponse([header], JSON_CONTENT_TYPE)
    return EncodedResponse(
        [header, *chunks], BINARY_CONTENT_TYPE, {HEADER_LENGTH: str(len(header))}
    )


# Above this much JSON to parse or to write, the handler runs the codec in a
# worker thread, so one large JSON request does not stall every connection.
COSTLY_BODY_BYTES = 256 << 10
COSTLY_JSON_VALUES = 32 << 10


def decode_is_costly(body: bytes) -> bool:
    return len(body) > COSTLY_BODY_BYTES


def encode_is_costly(request: InferRequest, results: Results) -> bool:
    """Whether many values go out as JSON (the rows of one request agree in
    shape, so the first row tells)."""
    first = results[0]
    values = sum(first[out.name].size for out in request.outputs if not out.binary)
    return values * len(results) > COSTLY_JSON_VALUES
