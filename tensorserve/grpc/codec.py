"""The KServe v2 gRPC infer messages <-> tensorserve's ``InferRequest``.

A ``ModelInferRequest`` is turned into the shape of the OIP JSON header
plus its binary section, and checked by the one OIP decoder
(``wire/oip.py decode_message``): every rule of the KServe v2 protocol
(names, datatypes, shapes, the batch dimension, ``timeout`` and
``priority``) is written once for both transports.

    inputs[i].contents (typed)     -> "data": a flat list, cast strictly
    raw_input_contents[i]          -> parameters.binary_data_size, bytes in order
    parameters (InferParameter)    -> plain values: bool, int, str, float

Replies always carry raw bytes (``raw_output_contents``), as Triton's do;
a BYTES output there is its elements' 4-byte-length framing (as Triton's),
and a BYTES input may come in either field (``bytes_contents``, or
``raw_input_contents`` in the same framing).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from tensorserve.errors import InvalidInput
from tensorserve.grpc.generated import grpc_service_pb2 as pb
from tensorserve.repository.config import ModelConfig
from tensorserve.tensors.wire_tensor import to_bytes
from tensorserve.wire import oip
from tensorserve.wire.request import InferRequest, Results, response_parameters

# Which typed field of InferTensorContents holds each KServe v2 datatype.
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def parameter_value(parameter: pb.InferParameter) -> Any:
    """An ``InferParameter``'s value (None when none of its fields is set)."""
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


def plain_parameters(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in parameters.items()}


def _typed_data(tensor: pb.ModelInferRequest.InferInputTensor, where: str) -> list[Any]:
    field = CONTENTS_FIELD.get(tensor.datatype)
    used = [f.name for f, _ in tensor.contents.ListFields()]
    if field is None:  # FP16, BF16 or unknown: only raw bytes can carry them
        if tensor.datatype in ("FP16", "BF16"):
            raise InvalidInput(f"{where}: {tensor.datatype} must be sent in raw_input_contents")
        return []  # the OIP decoder names the unknown datatype
    stray = [name for name in used if name != field]
    if stray:
        raise InvalidInput(
            f"{where}: datatype {tensor.datatype} is carried in contents.{field}, not {stray[0]}"
        )
    contents = getattr(tensor.contents, field)
    # Counted before a Python object is built for each value (protobuf holds
    # them in C until asked); a negative dimension is refused by the decoder.
    if all(d >= 0 for d in tensor.shape) and len(contents) > math.prod(tensor.shape):
        raise InvalidInput(
            f"{where}: contents.{field} holds {len(contents)} values, but shape "
            f"{list(tensor.shape)} needs {math.prod(tensor.shape)}"
        )
    return list(contents)


# A serialized request this large may hold 32k values (two bytes each): the
# data plane decodes it on the request pool.
COSTLY_MESSAGE_BYTES = 64 << 10


def to_message(request: pb.ModelInferRequest) -> tuple[dict[str, Any], memoryview]:
    """The OIP JSON header's shape, and the binary section, of ``request``."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs: "
            f"give every input's bytes there, or none"
        )
    inputs: list[dict[str, Any]] = []
    for index, tensor in enumerate(request.inputs):
        where = f"input {tensor.name!r}"
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        parameters = plain_parameters(tensor.parameters)
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInput(f"{where}: give contents or raw_input_contents, not both")
            parameters["binary_data_size"] = len(raw[index])
        else:
            entry["data"] = _typed_data(tensor, where)
        if parameters:
            entry["parameters"] = parameters
        inputs.append(entry)
    message: dict[str, Any] = {"inputs": inputs}
    if request.id:
        message["id"] = request.id
    if request.parameters:
        message["parameters"] = plain_parameters(request.parameters)
    if request.outputs:
        message["outputs"] = [
            {"name": out.name, "parameters": plain_parameters(out.parameters)}
            for out in request.outputs
        ]
    binary = memoryview(b"".join(raw))  # one copy: the OIP decoder reads one section
    return message, binary


def decode(request: pb.ModelInferRequest, config: ModelConfig, max_items: int) -> InferRequest:
    message, binary = to_message(request)
    return oip.decode_message(message, binary, config, max_items)


def _set_parameter(parameter: pb.InferParameter, value: Any) -> None:
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int) and -(2**63) <= value < 2**63:
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    elif isinstance(value, str):
        parameter.string_param = value
    else:  # per-row lists, maps: JSON text, as the HTTP reply would carry them
        parameter.string_param = json.dumps(value, default=str)


def encode(
    request: InferRequest, results: Results, name: str, version: str, config: ModelConfig
) -> pb.ModelInferResponse:
    """The requested outputs, each the request's rows stacked back into one
    dense tensor, as raw little-endian bytes (BYTES: length-framed)."""
    reply = pb.ModelInferResponse(model_name=name, model_version=version, id=request.id or "")
    for requested in request.outputs:
        array = oip.stack_rows(results, requested.name, config)
        reply.outputs.add(name=requested.name, datatype=requested.dt.v2, shape=array.shape)
        reply.raw_output_contents.append(bytes(to_bytes(array, requested.dt)))
    for key, value in response_parameters(results, config.batching).items():
        _set_parameter(reply.parameters[key], value)
    return reply
