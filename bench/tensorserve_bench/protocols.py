"""One request encoder per protocol the server speaks, for the load generator
and the benchmark scripts: items (feature name -> numpy array) in, the body
of one ``POST /v2/models/{m}/infer`` and its headers out.

    msgpack  the native protocol: ``{"items": [{feature: {dtype, shape, data}}]}``
             (``wire/native.py`` reads it)
    json     KServe v2 (Open Inference Protocol) JSON, the data inline
    binary   KServe v2 with Triton's binary tensor extension: the JSON header,
             then each input's raw bytes, and ``Inference-Header-Content-Length``
             saying where the JSON ends (what ``tritonclient`` sends)

In both KServe spellings the items are the rows of a leading batch dimension:
for a model with a batch dimension (``max_batch_size`` >= 1) every input is
``[k, *item_shape]``, so one item of ``n`` tokens is ``shape [1, n]``; a model
with ``max_batch_size`` 0 takes exactly one item, without that dimension. The rows
of one request share their shape, so items of different lengths cannot travel
in one KServe request (send them one per request). ``wire/oip.py`` reads both.

``dtypes`` maps a feature to the model's dtype name (numpy style, as in
config.toml); a feature it does not name keeps its array's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Item = Mapping[str, np.ndarray]

PROTOCOLS = ("msgpack", "json", "binary")
# The content types of wire/native.py and wire/oip.py (not imported: they load torch).
CONTENT_TYPES = {
    "msgpack": "application/msgpack",
    "json": "application/json",
    "binary": "application/octet-stream",
}
HEADER_LENGTH = "Inference-Header-Content-Length"  # wire.oip.HEADER_LENGTH


@dataclass(frozen=True)
class EncodedRequest:
    """The body of one infer request, its content type and its other headers."""

    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)


def encode_request(
    protocol: str,
    items: Sequence[Item],
    dtypes: Mapping[str, str],
    *,
    batched: bool = True,
    binary_outputs: Sequence[str] | None = None,
) -> EncodedRequest:
    """``items`` as one request in ``protocol`` (one of ``PROTOCOLS``).
    ``batched`` and ``binary_outputs``: KServe only (see ``binary_body``)."""
    if protocol == "msgpack":
        return EncodedRequest(msgpack_body(items, dtypes), CONTENT_TYPES[protocol])
    if protocol == "json":
        return EncodedRequest(json_body(items, dtypes, batched=batched), CONTENT_TYPES[protocol])
    if protocol == "binary":
        body, headers = binary_body(items, dtypes, batched=batched, outputs=binary_outputs)
        return EncodedRequest(body, CONTENT_TYPES[protocol], headers)
    raise ValueError(f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")


def msgpack_body(
    items: Sequence[Item], dtypes: Mapping[str, str], *, parameters: Mapping[str, Any] | None = None
) -> bytes:
    """The native body of ``items`` (typed tensors, raw little-endian bytes);
    ``parameters``: the request's ``parameters`` map (``timeout_ms``, ...)."""
    import msgpack

    from tensorserve.wire.native import encode_tensor

    message: dict[str, Any] = {
        "items": [
            {name: encode_tensor(*_typed(name, array, dtypes)) for name, array in item.items()}
            for item in items
        ]
    }
    if parameters:
        message["parameters"] = dict(parameters)
    return bytes(msgpack.packb(message))


def json_body(items: Sequence[Item], dtypes: Mapping[str, str], *, batched: bool = True) -> bytes:
    """The KServe v2 JSON body of ``items`` (``data`` inline, flat row-major)."""
    inputs = []
    for name, tensor, v2 in _kserve_inputs(items, dtypes, batched):
        inputs.append(
            {
                "name": name,
                "shape": list(tensor.shape),
                "datatype": v2,
                "data": tensor.reshape(-1).tolist(),
            }
        )
    return _compact({"inputs": inputs})


def binary_body(
    items: Sequence[Item],
    dtypes: Mapping[str, str],
    *,
    batched: bool = True,
    outputs: Sequence[str] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The KServe v2 binary body of ``items`` and its header-length header.
    The answer is asked for in binary too: every output
    (``parameters.binary_data_output``), or with ``outputs`` those outputs by
    name (``outputs[].parameters.binary_data``; Triton's per-output spelling)."""
    inputs, chunks = [], []
    for name, tensor, v2 in _kserve_inputs(items, dtypes, batched):
        data = np.ascontiguousarray(tensor).tobytes()
        inputs.append(
            {
                "name": name,
                "shape": list(tensor.shape),
                "datatype": v2,
                "parameters": {"binary_data_size": len(data)},
            }
        )
        chunks.append(data)
    message: dict[str, Any] = {"inputs": inputs}
    if outputs is None:
        message["parameters"] = {"binary_data_output": True}
    else:
        message["outputs"] = [{"name": o, "parameters": {"binary_data": True}} for o in outputs]
    header = _compact(message)
    return b"".join([header, *chunks]), {HEADER_LENGTH: str(len(header))}


def _typed(name: str, array: np.ndarray, dtypes: Mapping[str, str]) -> tuple[np.ndarray, str]:
    """(array in the model's dtype, little-endian; that dtype's name)."""
    array = np.asarray(array)
    dtype_name = dtypes.get(name, array.dtype.name)
    if dtype_name != "bfloat16":  # bfloat16 travels as uint16 patterns, as it is
        array = array.astype(np.dtype(dtype_name).newbyteorder("<"), copy=False)
    return array, dtype_name


def _kserve_inputs(
    items: Sequence[Item], dtypes: Mapping[str, str], batched: bool
) -> list[tuple[str, np.ndarray, str]]:
    """(name, tensor, KServe datatype) of each input: the items' rows stacked."""
    from tensorserve.tensors.dtypes import dtype as lookup  # the server's table (no torch)

    if not items:
        raise ValueError("a KServe v2 request needs at least one item")
    if not batched and len(items) != 1:
        raise ValueError(
            f"a model that does not batch takes one item per request, not {len(items)}"
        )
    inputs = []
    for name in items[0]:
        rows = [_typed(name, item[name], dtypes) for item in items]
        arrays = [row for row, _ in rows]
        if any(row.shape != arrays[0].shape for row in arrays):
            shapes = sorted({tuple(row.shape) for row in arrays})
            raise ValueError(
                f"feature {name!r}: rows of one KServe v2 request differ in shape {shapes} "
                f"(send one item per request, or items of one length)"
            )
        tensor = np.stack(arrays) if batched else arrays[0]
        inputs.append((name, tensor, lookup(rows[0][1]).v2))
    return inputs


def _compact(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode_error(body: bytes) -> dict[str, Any] | None:
    """The server's error body, ``{"error", "code", ...}``, in either
    protocol's spelling (msgpack, else JSON); None for any other body (a
    proxy's, say, or a success)."""
    import msgpack

    for decode in (msgpack.unpackb, json.loads):
        try:
            message = decode(body)
        except Exception:  # noqa: BLE001, S112 - msgpack and json raise several types
            continue
        if isinstance(message, dict) and "code" in message:
            return message
    return None
