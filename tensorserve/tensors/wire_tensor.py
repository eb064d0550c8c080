"""A typed tensor as it travels: a dtype name, a shape and raw little-endian,
C-order bytes. Decoding is zero-copy (``np.frombuffer``). A bytes tensor's
data is its 4-byte-length framing, or a flat list of bin / str
(``tensors/bytes_tensor.py``)."""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorserve.errors import InvalidInput
from tensorserve.tensors.bytes_tensor import bytes_array, frame, unframe
from tensorserve.tensors.dtypes import DTYPES, DType

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
            f"{where}: shape must be a list of at most {MAX_RANK} non-negative integers, "
            f"got {reprlib.repr(shape)}"
        )
    return tuple(shape)


def from_bytes(dtype_name: Any, shape: Any, data: Any, where: str) -> WireTensor:
    """Zero-copy view of raw bytes as a typed tensor, with every size checked."""
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:  # a list is not hashable
        raise InvalidInput(
            f"{where}: unknown dtype {reprlib.repr(dtype_name)}; expected one of {', '.join(DTYPES)}"
        )
    dt = DTYPES[dtype_name]
    dims = check_shape(shape, where)
    if dt.is_bytes:
        return WireTensor(dt.name, _bytes_data(data, dims, where))
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"{where}: data must be binary, got {type(data).__name__}")
    expected = math.prod(dims) * dt.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"{where}: data holds {len(data)} bytes, but shape {list(dims)} of {dt.name} "
            f"needs {expected}"
        )
    return WireTensor(dt.name, np.frombuffer(data, dtype=dt.numpy).reshape(dims))


def to_bytes(array: np.ndarray, dt: DType) -> bytes | memoryview:
    """``from_bytes``'s inverse, as the binary extension and gRPC's raw
    contents carry a tensor: raw little-endian values (a view, no copy), or
    a bytes tensor's length framing."""
    if dt.is_bytes:
        return frame(array)
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def _bytes_data(data: Any, dims: tuple[int, ...], where: str) -> np.ndarray:
    """A bytes tensor's data: the length framing, or a flat list of bin / str."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return unframe(data, dims, where)
    if not isinstance(data, list):
        raise InvalidInput(
            f"{where}: data of a bytes tensor must be a list of bin / str or the "
            f"length-framed binary, got {type(data).__name__}"
        )
    if len(data) != math.prod(dims):
        raise InvalidInput(
            f"{where}: data holds {len(data)} elements, but shape {list(dims)} needs "
            f"{math.prod(dims)}"
        )
    return bytes_array(data, where, what="data").reshape(dims)
