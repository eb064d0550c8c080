"""The native protocol: msgpack bodies (see docs/protocol.md).

Request  ``{"items": [{feature: tensor}, ...], "id"?: str, "parameters"?: map}``
Response ``{"model_name", "model_version", "id"?, "outputs": [{output: tensor}, ...]}``
Error    ``{"error": str, "code": str}``
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from tensorserve.errors import InvalidInput
from tensorserve.tensors.wire_tensor import decode_tensor, encode_tensor

CONTENT_TYPE = "application/msgpack"


@dataclass
class InferRequest:
    items: list[dict[str, Any]]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


def decode_request(body: bytes, max_items: int) -> InferRequest:
    try:
        message = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise InvalidInput(f"body is not valid msgpack: {exc}") from None
    if not isinstance(message, dict):
        raise InvalidInput("body must be a msgpack map with an 'items' list")
    items = message.get("items")
    if not isinstance(items, list) or not items:
        raise InvalidInput("'items' must be a non-empty list of feature maps")
    if len(items) > max_items:
        raise InvalidInput(f"'items' holds {len(items)} items; the limit is {max_items}")
    request_id = message.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    parameters = message.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a map")
    decoded: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidInput(f"item {index}: expected a map of feature name to tensor")
        decoded.append(
            {name: decode_tensor(value, f"item {index}, feature {name!r}") for name, value in item.items()}
        )
    return InferRequest(decoded, request_id, parameters)


def encode_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: Sequence[Mapping[str, np.ndarray]],
    dtypes: Mapping[str, str],
) -> bytes:
    message: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        message["id"] = request_id
    message["outputs"] = [
        {name: encode_tensor(array, dtypes[name]) for name, array in result.items()}
        for result in outputs
    ]
    return msgpack.packb(message)


def encode_error(message: str, code: str) -> bytes:
    return msgpack.packb({"error": message, "code": code})
