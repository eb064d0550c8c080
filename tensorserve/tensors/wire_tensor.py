"""A typed tensor as it travels: ``{"dtype", "shape", "data"}`` with raw
little-endian, C-order bytes. Decoding is zero-copy (``np.frombuffer``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorserve.errors import InvalidInput
from tensorserve.tensors.dtypes import DTYPES

MAX_RANK = 8


@dataclass(frozen=True, slots=True)
class WireTensor:
    """A tensor that said what its dtype is (as opposed to a plain list).

    ``array`` is the host representation: bfloat16 as uint16 bit patterns.
    """

    dtype: str
    array: np.ndarray


def check_shape(shape: Any, where: str) -> tuple[int, ...]:
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_RANK
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise InvalidInput(
            f"{where}: shape must be a list of at most {MAX_RANK} non-negative integers, got {shape!r}"
        )
    return tuple(shape)


def from_bytes(dtype_name: Any, shape: Any, data: Any, where: str) -> WireTensor:
    """Zero-copy view of raw bytes as a typed tensor, with every size checked."""
    if dtype_name not in DTYPES:
        raise InvalidInput(f"{where}: unknown dtype {dtype_name!r}")
    dt = DTYPES[dtype_name]
    dims = check_shape(shape, where)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"{where}: data must be binary, got {type(data).__name__}")
    expected = math.prod(dims) * dt.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"{where}: data holds {len(data)} bytes, but shape {list(dims)} of {dt.name} "
            f"needs {expected}"
        )
    return WireTensor(dt.name, np.frombuffer(data, dtype=dt.numpy).reshape(dims))


def decode_tensor(value: Any, where: str) -> WireTensor | Any:
    """A native-protocol tensor: a typed map, or a plain (nested) list / number
    left for validation to cast to the declared dtype."""
    if isinstance(value, dict):
        missing = [k for k in ("dtype", "shape", "data") if k not in value]
        if missing:
            raise InvalidInput(f"{where}: tensor map is missing {', '.join(missing)}")
        return from_bytes(value["dtype"], value["shape"], value["data"], where)
    if isinstance(value, (list, int, float)) and not isinstance(value, bool):
        return value
    raise InvalidInput(f"{where}: expected a tensor map or a list of numbers, got {type(value).__name__}")


def encode_tensor(array: np.ndarray, dtype_name: str) -> dict[str, Any]:
    contiguous = np.ascontiguousarray(array)
    return {"dtype": dtype_name, "shape": list(contiguous.shape), "data": contiguous.data}
