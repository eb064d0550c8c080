"""Arrays on the wire: ``{"dtype", "shape", "data"}`` with raw little-endian,
C-order bytes (the native protocol, docs/protocol.md). Pure: no I/O.

Going out, a feature may be a numpy array or scalar, a torch tensor (only if
the caller already imported torch: this module never imports it to check), or
a plain (nested) list / number, which is sent as-is for the server to cast to
the declared dtype. Typed data keeps its dtype: the server rejects a mismatch
rather than silently casting, so an int32 array for an int64 input is a 400.

Coming back, every tensor becomes a writable numpy array (one copy out of the
message buffer: read-only arrays surprise callers and make torch warn) or,
with ``return_torch=True``, a torch tensor sharing that array's memory.
numpy has no bfloat16, so a bfloat16 output comes back as float32 (exact)
unless torch is asked for.

A bytes (KServe v2 BYTES) feature is a numpy object array of ``bytes`` or
``str`` (or a numpy ``S`` / ``U`` array, or a plain list of them), sent as
``{"dtype": "bytes", "shape", "data": [bin, ...]}``; a bytes output comes
back as an object array of ``bytes``, also with ``return_torch=True``.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tensorserve_client.errors import ProtocolError

# Names the server understands (numpy names, plus bfloat16 as uint16 patterns).
# np.dtype("<f4") rather than .newbyteorder("<"): the same little-endian dtype,
# but it prints as dtype('float32') on the (little-endian) hosts everyone runs.
WIRE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype("<" + np.dtype(name).str[1:])
    for name in (
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
# numpy dtype -> wire name, for arrays going out (bfloat16 only comes from torch).
WIRE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in WIRE_DTYPES.items()}
WIRE_DTYPES["bfloat16"] = np.dtype("<u2")
# bytes (KServe v2 BYTES): an object array of ``bytes``; str and numpy's fixed
# width strings go out as it too (str as UTF-8), and replies come back as it.
WIRE_DTYPES["bytes"] = np.dtype(object)
_LENGTH = struct.Struct("<I")

Wire = dict[str, Any] | list[Any] | int | float | bool


def _torch() -> Any:
    """The torch module if the caller imported it; never imports it ourselves."""
    return sys.modules.get("torch")


def require_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(
            "return_torch=True needs torch, which is not installed; "
            "pip install torch, or leave return_torch off to get numpy arrays"
        ) from None
    return torch


def _typed(array: np.ndarray, name: str) -> dict[str, Any]:
    contiguous = np.ascontiguousarray(array)
    # memoryview: msgpack packs the buffer without an intermediate bytes copy.
    return {"dtype": name, "shape": list(contiguous.shape), "data": contiguous.data}


def _from_torch(tensor: Any, where: str) -> dict[str, Any]:
    torch = _torch()
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        return _typed(tensor.contiguous().view(torch.uint16).numpy(), "bfloat16")
    try:
        array = tensor.resolve_conj().resolve_neg().numpy()
    except TypeError as exc:  # dtypes numpy cannot hold
        raise TypeError(f"{where}: torch dtype {tensor.dtype} cannot be sent: {exc}") from None
    return _from_numpy(array, where)


def bytes_elements(array: np.ndarray, where: str) -> list[bytes]:
    """An object (or numpy string) array's elements as ``bytes``, row-major;
    str as UTF-8. TypeError names ``where`` for anything else."""
    elements = []
    for element in array.reshape(-1).tolist():
        if isinstance(element, str):
            element = element.encode()
        elif isinstance(element, (bytearray, memoryview)):
            element = bytes(element)
        if not isinstance(element, bytes):
            raise TypeError(
                f"{where}: an object array is sent as bytes, so every element must be bytes "
                f"or str, got {type(element).__name__}"
            )
        elements.append(element)
    return elements


def frame(elements: Sequence[bytes]) -> bytes:
    """Triton's BYTES framing: each element as a 4-byte little-endian length, then it."""
    return b"".join(_LENGTH.pack(len(e)) + e for e in elements)


def unframe(data: bytes, shape: Sequence[int], where: str) -> np.ndarray:
    """The framing back into an object array of ``bytes`` of ``shape``."""
    count, offset, view = math.prod(shape), 0, memoryview(data)
    out = np.empty(count, dtype=object)
    for index in range(count):
        if offset + _LENGTH.size > len(view):
            raise ProtocolError(f"{where}: the BYTES data ends before element {index}")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if offset + length > len(view):
            raise ProtocolError(f"{where}: BYTES element {index} runs past the data")
        out[index] = bytes(view[offset : offset + length])
        offset += length
    if offset != len(view):
        raise ProtocolError(f"{where}: {len(view) - offset} bytes left after the BYTES elements")
    return out.reshape(shape)


def _from_numpy(array: np.ndarray, where: str) -> dict[str, Any]:
    name = WIRE_NAMES.get(array.dtype)  # a dict hit: dtype.name is slow Python code
    if name is None and array.dtype.kind in "OSU":  # a list of bin: a bytes tensor
        return {"dtype": "bytes", "shape": list(array.shape), "data": bytes_elements(array, where)}
    if name is None and array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
        name = WIRE_NAMES.get(array.dtype)
    if name is None:
        raise TypeError(
            f"{where}: numpy dtype {array.dtype} cannot be sent; "
            f"use one of {', '.join(WIRE_DTYPES)}"
        )
    return _typed(array, name)


def encode_feature(value: Any, where: str) -> Wire:
    """One feature's value as it goes on the wire; TypeError names ``where``."""
    if isinstance(value, np.ndarray):
        return _from_numpy(value, where)
    if isinstance(value, np.generic):
        return _from_numpy(np.asarray(value), where)
    if isinstance(value, (list, int, float)):  # the server casts to the declared dtype
        return value
    if isinstance(value, tuple):
        return list(value)
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return _from_torch(value, where)
    raise TypeError(
        f"{where}: expected a numpy array, a torch tensor or a (nested) list of numbers, "
        f"got {type(value).__name__}"
    )


def encode_item(features: Mapping[str, Any], index: int) -> dict[str, Wire]:
    if not isinstance(features, Mapping):
        raise TypeError(
            f"item {index}: expected a mapping of feature name to array, "
            f"got {type(features).__name__}"
        )
    encoded: dict[str, Wire] = {}
    for name, value in features.items():
        if not isinstance(name, str):
            raise TypeError(f"item {index}: feature names must be str, got {name!r}")
        encoded[name] = encode_feature(value, f"item {index}, feature {name!r}")
    return encoded


def pack_default(value: Any) -> Any:
    """msgpack fallback: numpy scalars inside plain lists become Python numbers."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot send {type(value).__name__} inside a list")


def decode_tensor(value: Any, where: str, return_torch: bool) -> Any:
    """A tensor map from the server -> a writable numpy array (or torch tensor)."""
    if isinstance(value, list):
        array = np.asarray(value)
        return require_torch().from_numpy(array) if return_torch else array
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected a tensor map, got {type(value).__name__}")
    name, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
    if name not in WIRE_DTYPES:
        raise ProtocolError(f"{where}: unknown dtype {name!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"{where}: bad shape {shape!r}")
    if name == "bytes":  # never a torch tensor: torch has no strings
        return _bytes_tensor(data, shape, where)
    if not isinstance(data, bytes):
        raise ProtocolError(f"{where}: data must be binary, got {type(data).__name__}")
    dt = WIRE_DTYPES[name]
    if len(data) != math.prod(shape) * dt.itemsize:
        raise ProtocolError(f"{where}: {len(data)} bytes do not hold shape {shape} of {name}")
    flat = np.frombuffer(data, dtype=dt)
    if name == "bfloat16":
        if return_torch:
            torch = require_torch()
            return torch.from_numpy(flat.copy().reshape(shape)).view(torch.bfloat16)
        # bfloat16 is the top half of a float32: widening is exact (and a copy).
        return (flat.astype("<u4") << 16).view("<f4").reshape(shape)
    array = flat.reshape(shape).copy()
    return require_torch().from_numpy(array) if return_torch else array


def _bytes_tensor(data: Any, shape: list[int], where: str) -> np.ndarray:
    """A bytes tensor's data (a list of bin, or the length framing) as an
    object array of ``bytes``."""
    if isinstance(data, bytes):
        return unframe(data, shape, where)
    if not isinstance(data, list) or len(data) != math.prod(shape):
        raise ProtocolError(f"{where}: a bytes tensor's data must be {math.prod(shape)} elements")
    array = np.empty(len(data), dtype=object)
    for index, element in enumerate(data):
        if not isinstance(element, (bytes, str)):
            raise ProtocolError(f"{where}: element {index} is {type(element).__name__}, not bytes")
        array[index] = element.encode() if isinstance(element, str) else element
    return array.reshape(shape)
