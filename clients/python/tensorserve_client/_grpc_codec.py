"""Items <-> KServe v2 ``ModelInferRequest`` / ``ModelInferResponse``, and a
failed call's status -> the client's error. Pure: no I/O, no grpcio (only
the protobuf messages).

A KServe v2 tensor is dense: the rows of one request share their lengths.
So the items of one client call are grouped by their features' shapes, one
request per group, ``[k, *shape]`` with the group's k rows stacked
(``raw_input_contents``); the server pads rows of different requests
together and answers each request with its own rows un-padded, so row r of
a group's outputs is exactly what the native protocol returns for that
item. A model without a batch dimension (``max_batch_size`` 0) takes one
item per request. Plain lists are cast here, strictly, to the model's
declared dtype (read once from ``ModelConfig``): the native protocol lets
the server cast them, but a raw tensor needs its dtype up front.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorserve_client._kserve import grpc_service_pb2 as pb
from tensorserve_client._kserve import model_config_pb2 as mc
from tensorserve_client._ops import InferOp
from tensorserve_client._protocol import InferResult
from tensorserve_client._tensors import (
    WIRE_DTYPES,
    Wire,
    bytes_elements,
    decode_tensor,
    frame,
    unframe,
)
from tensorserve_client.errors import (
    CODES,
    ConnectionError,
    InvalidInput,
    ProtocolError,
    RequestTimeout,
    TensorServeError,
    error_for,
)

# The native protocol's dtype names <-> KServe v2 datatypes.
DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
    "bfloat16": "BF16",
    "bytes": "BYTES",
}
WIRE_NAMES = {datatype: name for name, datatype in DATATYPES.items()}
WIRE_NAMES["STRING"] = "bytes"  # what Triton's model config calls BYTES (TYPE_STRING)
CODE_KEY, RETRY_AFTER_KEY = "tensorserve-code", "retry-after"
# A status with no tensorserve code (a proxy, grpc itself) -> the HTTP status
# whose class it stands for. UNAVAILABLE and DEADLINE_EXCEEDED without a code
# are the channel's own: no connection, and the client's deadline.
STATUS_AS_HTTP = {
    "INVALID_ARGUMENT": 400,
    "NOT_FOUND": 404,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 413,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNKNOWN": 500,
}


@dataclass(frozen=True)
class ModelInputs:
    """What encoding needs of a model: whether it has a batch dimension, and
    each input's declared dtype (native name)."""

    batches: bool
    dtypes: Mapping[str, str]

    @classmethod
    def from_config(cls, reply: pb.ModelConfigResponse) -> ModelInputs:
        config = reply.config
        dtypes = {}
        for tensor in config.input:
            name = WIRE_NAMES.get(mc.DataType.Name(tensor.data_type).removeprefix("TYPE_"))
            if name is not None:
                dtypes[tensor.name] = name
        return cls(config.max_batch_size > 0, dtypes)


Tensor = tuple[str, tuple[int, ...], bytes]  # native dtype name, shape, raw bytes


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even as torch does."""
    bits = np.ascontiguousarray(values, "<f4").view("<u4")
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


def cast_list(value: Any, dtype: str | None, where: str) -> Tensor:
    """A plain (nested) list as the declared dtype, by the server's rules:
    integers within range for integer types, booleans for bool, finite
    numbers for floats; anything else an ``InvalidInput`` naming ``where``."""
    try:
        array = np.asarray(value)
    except ValueError:
        array = np.asarray(None, dtype=object)
    if dtype == "bytes":  # strings or bytes, framed as raw_input_contents carry BYTES
        try:
            return "bytes", array.shape, frame(bytes_elements(array, where))
        except TypeError:
            raise InvalidInput(
                f"{where}: the model declares bytes, so the list must hold strings or bytes",
                status=400,
                code="invalid_input",
            ) from None
    if array.dtype.kind not in "biuf":
        raise InvalidInput(
            f"{where}: expected a (non-ragged) list of numbers", status=400, code="invalid_input"
        )
    name = dtype or ("float64" if array.dtype.kind == "f" else array.dtype.name)
    target = WIRE_DTYPES.get(name)
    if target is None:
        raise InvalidInput(
            f"{where}: the model declares {dtype!r}, which lists cannot fill",
            status=400,
            code="invalid_input",
        )
    kind = array.dtype.kind
    if name == "bool":
        fits = kind == "b"
    elif np.dtype(target).kind in "iu":
        info = np.iinfo(target)
        fits = kind in "iu" and (
            array.size == 0 or info.min <= array.min() <= array.max() <= info.max
        )
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            widened = array.astype("<f4" if name == "bfloat16" else target)
        fits = kind in "iuf" and bool(np.isfinite(widened).all())
    if not fits:
        raise InvalidInput(
            f"{where}: the list does not fit the declared {name}", status=400, code="invalid_input"
        )
    if name == "bfloat16":
        return name, array.shape, _bfloat16_bits(widened).tobytes()
    return name, array.shape, np.ascontiguousarray(array, target).tobytes()


def _tensor(value: Wire, dtype: str | None, where: str) -> Tensor:
    if isinstance(value, dict):  # a typed array, as _tensors.encode_feature made it
        if value["dtype"] == "bytes":  # a list of bin: raw contents carry the framing
            return "bytes", tuple(value["shape"]), frame(value["data"])
        return value["dtype"], tuple(value["shape"]), bytes(value["data"])
    return cast_list(value, dtype, where)


@dataclass(frozen=True)
class Group:
    """Items of one call whose features share names, dtypes and shapes: one request."""

    indices: list[int]  # positions in the call
    request: pb.ModelInferRequest


def _parameter(target: pb.InferParameter, value: Any, where: str) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    elif isinstance(value, str):
        target.string_param = value
    else:
        raise TypeError(
            f"{where}: a gRPC parameter is a bool, int, float or str, got {type(value).__name__}"
        )


def requests(op: InferOp, inputs: ModelInputs) -> list[Group]:
    """The call's items as one ``ModelInferRequest`` per group of equal shapes."""
    grouped: dict[Any, list[tuple[int, dict[str, Tensor]]]] = {}
    for position, item in enumerate(op.items):
        index = op.first_index + position
        tensors = {
            name: _tensor(value, inputs.dtypes.get(name), f"item {index}, feature {name!r}")
            for name, value in item.items()
        }
        key: Any = tuple((n, t[0], t[1]) for n, t in tensors.items())
        if not inputs.batches:
            key = position  # no batch dimension: every item alone
        grouped.setdefault(key, []).append((position, tensors))
    groups = []
    for members in grouped.values():
        request = pb.ModelInferRequest(model_name=op.model, model_version=op.version or "")
        for name, value in op.parameters.items():
            _parameter(request.parameters[name], value, f"parameters.{name}")
        if op.timeout is not None:  # Triton's unit: microseconds, a whole number
            request.parameters["timeout"].int64_param = max(1, round(op.timeout * 1e6))
        first = members[0][1]
        for name, (dtype, shape, _) in first.items():
            full = [len(members), *shape] if inputs.batches else list(shape)
            request.inputs.add(name=name, datatype=DATATYPES[dtype], shape=full)
            request.raw_input_contents.append(b"".join(t[name][2] for _, t in members))
        groups.append(Group([position for position, _ in members], request))
    return groups


def _rows(value: Any, k: int, batches: bool) -> list[Any]:
    """An output parameter's value per row: the server sends a batching
    model's rows as a JSON list (KServe parameters are scalars)."""
    if not batches:
        return [value]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    return list(value) if isinstance(value, list) and len(value) == k else [value] * k


def results(
    count: int,
    groups: Sequence[Group],
    replies: Sequence[pb.ModelInferResponse],
    batches: bool,
    return_torch: bool,
) -> list[InferResult]:
    """Each item's outputs and output parameters, in the call's order."""
    ordered: list[InferResult | None] = [None] * count
    for group, reply in zip(groups, replies):
        k = len(group.indices)
        if len(reply.raw_output_contents) != len(reply.outputs):
            raise ProtocolError("the answer's outputs are not all in raw_output_contents")
        per_row: list[dict[str, Any]] = [{} for _ in range(k)]
        for output, raw in zip(reply.outputs, reply.raw_output_contents):
            name = WIRE_NAMES.get(output.datatype)
            if name is None:
                raise ProtocolError(f"output {output.name!r}: unknown datatype {output.datatype}")
            shape = list(output.shape)
            row_shape = shape[1:] if batches else shape
            if batches and (not shape or shape[0] != k):
                raise ProtocolError(f"output {output.name!r}: shape {shape} is not {k} rows")
            if name == "bytes":  # length-framed: rows are found by reading the lengths
                rows = unframe(raw, shape, f"output {output.name!r}")
                for r in range(k):
                    per_row[r][output.name] = rows[r] if batches else rows
                continue
            size = len(raw) // k
            for r in range(k):
                tensor = {"dtype": name, "shape": row_shape, "data": raw[r * size : (r + 1) * size]}
                per_row[r][output.name] = decode_tensor(
                    tensor, f"output {output.name!r}", return_torch
                )
        parameters: list[dict[str, Any]] = [{} for _ in range(k)]
        for key, parameter in reply.parameters.items():
            which = parameter.WhichOneof("parameter_choice")
            value = None if which is None else getattr(parameter, which)
            for r, row_value in enumerate(_rows(value, k, batches)):
                parameters[r][key] = row_value
        for r, position in enumerate(group.indices):
            ordered[position] = InferResult(per_row[r], parameters[r])
    if any(result is None for result in ordered):
        raise ProtocolError(f"sent {count} items but not every one was answered")
    return [result for result in ordered if result is not None]


def error_from_status(
    status: str,
    details: str,
    trailing: Sequence[tuple[str, Any]],
    attempts: int,
    client_deadline: bool,
) -> TensorServeError:
    """The error a failed call stands for: by the ``tensorserve-code`` trailing
    metadata through the client's one ``CODES`` table, else by the gRPC
    status. ``client_deadline``: the call's deadline was the client's own
    ``timeout``, so running past it is a ``RequestTimeout`` whoever noticed first."""
    metadata = {key: value for key, value in trailing}
    code = metadata.get(CODE_KEY)
    retry_after = None
    try:
        retry_after = float(metadata[RETRY_AFTER_KEY])
    except (KeyError, ValueError):
        pass
    error: TensorServeError
    if status == "DEADLINE_EXCEEDED" and (client_deadline or code is None):
        error = RequestTimeout(f"no answer within the call's deadline ({details})")
    elif isinstance(code, str) and code in CODES:
        error = error_for(CODES[code][0], code, details, retry_after)
    elif status == "UNAVAILABLE":
        error = ConnectionError(f"gRPC UNAVAILABLE: {details}")
    else:
        http = STATUS_AS_HTTP.get(status, 500)
        error = error_for(
            http, code if isinstance(code, str) else None, f"gRPC {status}: {details}", retry_after
        )
    error.attempts = attempts
    return error
