"""The native protocol: msgpack bodies (see docs/protocol.md). A codec in the
sense of ``wire/request.py``.

Request  ``{"items": [{feature: tensor}, ...], "id"?: str, "parameters"?: {"timeout_ms"?: number,
           "priority"?: int, <the model's declared parameters>?: value}}``
Response ``{"model_name", "model_version", "id"?, "outputs": [{output: tensor}, ...],
           "parameters"?: [{name: value}, ...]}``  (one map per item, when the model
           returns output parameters)
Error    ``{"error": str, "code": str}``

A tensor is ``{"dtype", "shape", "data"}`` (raw bytes, decoded zero-copy) or
a plain (nested) list of numbers, cast strictly to the declared dtype when
the item is validated (``wire/lists.py``).

A bytes tensor is ``{"dtype": "bytes", "shape", "data": [bin | str, ...]}``
(flat, row-major; str as UTF-8; ``data`` may also be the 4-byte-length
framing as one bin) or a plain (nested) list of bin / str. Replies carry
bytes outputs as that map with a list of bin.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from tensorserve.errors import InvalidInput
from tensorserve.repository.config import ModelConfig
from tensorserve.tensors.results import row_parameters
from tensorserve.tensors.wire_tensor import WireTensor, from_bytes
from tensorserve.wire.request import (
    EncodedResponse,
    InferRequest,
    RequestedOutput,
    Results,
    timeout_seconds,
)
from tensorserve.wire.validate import most_values

CONTENT_TYPE = "application/msgpack"


def decode_request(
    body: bytes, headers: Mapping[str, str], config: ModelConfig, max_items: int
) -> InferRequest:
    """Decode one request; items are checked against the model later, by
    ``ServedModel.validate``, like every caller's."""
    message, items = _unpack(body, config, max_items)
    request_id = message.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    parameters = message.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a map")
    timeout = timeout_seconds(
        parameters.get("timeout_ms"),
        "parameters.timeout_ms",
        "milliseconds",
        1e-3,
        integral=False,
        zero_means_none=False,
    )
    decoded: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidInput(f"item {index}: expected a map of feature name to tensor")
        decoded.append(
            {
                name: decode_tensor(value, f"item {index}, feature {name!r}")
                for name, value in item.items()
            }
        )
    # The native protocol has no output selection: every output, typed.
    outputs = [RequestedOutput(spec.name, spec.dt) for spec in config.output]
    return InferRequest(decoded, outputs, request_id, timeout, parameters)


# What a valid body may hold, given to msgpack so that it refuses more at the
# header, before building anything: an array of ``max_array_len`` at most (the
# items, or the longest tensor an input allows), maps of a few keys. Strings
# and bins are bounded by the body's length (msgpack's default).
MAX_MAP_LEN = 1024
READ_SIZE = 64 << 10


def max_array_len(config: ModelConfig, max_items: int) -> int:
    """The longest list a valid body holds: its items, or one input's values."""
    return max([max_items, *(most_values(spec) for spec in config.input)])


def _unpack(body: bytes, config: ModelConfig, max_items: int) -> tuple[dict[Any, Any], list[Any]]:
    """The top-level map (without its items) and the items, unpacked one item
    per call: msgpack holds the GIL for a whole call, so one call per item
    lets the event loop run between them when this runs on the request pool."""
    unpacker = msgpack.Unpacker(
        io.BytesIO(body),  # read in pieces: feed() would copy the whole body first
        raw=False,  # map keys: str or bytes only
        read_size=min(READ_SIZE, max(len(body), 1)),
        max_buffer_size=max(len(body), 1),
        max_array_len=max_array_len(config, max_items),
        max_map_len=MAX_MAP_LEN,
    )
    message: dict[Any, Any] = {}
    items: Any = None
    try:
        try:
            keys = unpacker.read_map_header()
        except ValueError:  # valid msgpack, but not a map (or not msgpack at all)
            msgpack.unpackb(body, raw=False, max_array_len=max_array_len(config, max_items),
                            max_map_len=MAX_MAP_LEN)  # fmt: skip
            raise InvalidInput("body must be a msgpack map with an 'items' list") from None
        for _ in range(keys):
            key = unpacker.unpack()
            if key != "items":
                message[key] = unpacker.unpack()
                continue
            try:
                count = unpacker.read_array_header()
            except ValueError:
                raise InvalidInput("'items' must be a non-empty list of feature maps") from None
            if count > max_items:
                raise InvalidInput(f"'items' holds {count} items; the limit is {max_items}")
            items = [unpacker.unpack() for _ in range(count)]
        if unpacker.tell() != len(body):
            raise InvalidInput(f"{len(body) - unpacker.tell()} bytes follow the msgpack map")
    except InvalidInput:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise InvalidInput(f"body is not valid msgpack: {exc}") from None
    if not isinstance(items, list) or not items:
        raise InvalidInput("'items' must be a non-empty list of feature maps")
    return message, items


def decode_tensor(value: Any, where: str) -> WireTensor | Any:
    """A typed tensor map, or a plain (nested) list / number left for
    validation to cast to the declared dtype."""
    if isinstance(value, dict):
        missing = [k for k in ("dtype", "shape", "data") if k not in value]
        if missing:
            raise InvalidInput(f"{where}: tensor map is missing {', '.join(missing)}")
        return from_bytes(value["dtype"], value["shape"], value["data"], where)
    if isinstance(value, (list, int, float)) and not isinstance(value, bool):
        return value
    raise InvalidInput(
        f"{where}: expected a tensor map or a list of numbers, got {type(value).__name__}"
    )


def encode_tensor(array: np.ndarray, dtype_name: str) -> dict[str, Any]:
    if dtype_name == "bytes":  # a list of bin: msgpack packs each element as it is
        return {"dtype": dtype_name, "shape": list(array.shape), "data": array.reshape(-1).tolist()}
    contiguous = np.ascontiguousarray(array)
    # memoryview: msgpack packs the buffer without an intermediate bytes copy.
    return {"dtype": dtype_name, "shape": list(contiguous.shape), "data": contiguous.data}


def encode_response(
    request: InferRequest,
    results: Results,
    model_name: str,
    model_version: str,
    config: ModelConfig,
) -> EncodedResponse:
    message: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        message["id"] = request.id
    wanted = [(output.name, output.dt.name) for output in request.outputs]
    message["outputs"] = [
        {name: encode_tensor(result[name], dtype) for name, dtype in wanted} for result in results
    ]
    parameters = [row_parameters(result) for result in results]
    if any(parameters):  # the model returned output parameters: each item's own
        message["parameters"] = parameters
    return EncodedResponse([msgpack.packb(message)], CONTENT_TYPE)


# Above this size the data plane decodes on the request pool: typed tensors
# unpack at memcpy speed, but lists of strings or numbers build an object each.
COSTLY_BODY_BYTES = 256 << 10


def decode_is_costly(body: bytes) -> bool:
    return len(body) > COSTLY_BODY_BYTES


def encode_is_costly(request: InferRequest, results: Results) -> bool:
    return False  # raw bytes out: no per-element work


def encode_error(message: str, code: str, request_id: str | None = None) -> bytes:
    body = {"error": message, "code": code}
    if request_id is not None:
        body["request_id"] = request_id
    return msgpack.packb(body)
