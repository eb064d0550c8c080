"""One KServe v2 input's checks, before anything of its data is built: its
datatype, its shape against the model's (in the request's own axis
numbers), the batch dimension against ``max_items``, and JSON ``data``
(counted before a single element is built). ``wire/oip.py`` calls them
in that order for every input."""

from __future__ import annotations

import math
import reprlib
from typing import Any

import numpy as np

from tensorserve.errors import InvalidInput
from tensorserve.repository.config import InputSpec, ModelConfig
from tensorserve.tensors.bytes_tensor import bytes_array
from tensorserve.tensors.dtypes import BY_V2, DType
from tensorserve.tensors.wire_tensor import MAX_RANK
from tensorserve.wire.lists import array_from_list
from tensorserve.wire.validate import most_values, shape_problem

_SUPPORTED_V2 = ", ".join(BY_V2)
# Strings a request holds beside its BYTES values: names, datatypes, keys, ids.
OTHER_STRINGS = 4096


def check_string_count(header: bytes, config: ModelConfig, max_items: int) -> None:
    """Refuse, before the JSON is parsed, a header with more strings than a
    valid request to this model holds: parsing builds an object per string
    (a million two-byte strings took 60 MB). Counting its quote marks is a
    scan at memory speed; escaped quotes only make the count larger."""
    items = max_items if config.batching else 1
    most = OTHER_STRINGS + items * sum(most_values(s) for s in config.input if s.dt.is_bytes)
    quotes = header.count(b'"')
    if quotes > 2 * most:
        raise InvalidInput(
            f"the inference request header holds {quotes // 2} strings or more; a valid "
            f"request to this model holds at most {most} (max_items_per_request {max_items})"
        )


def datatype(value: Any, spec: InputSpec, where: str) -> DType:
    if not isinstance(value, str) or value not in BY_V2:  # a list or a map is not hashable
        raise InvalidInput(
            f"{where}: unknown datatype {reprlib.repr(value)}; expected one of {_SUPPORTED_V2}"
        )
    if value != spec.dt.v2:
        raise InvalidInput(f"{where}: datatype {value} does not match the model's {spec.dt.v2}")
    return BY_V2[value]


def from_json_data(data: Any, dt: DType, shape: tuple[int, ...], where: str) -> np.ndarray:
    """JSON ``data`` (flat row-major, or nested to match ``shape``) as a host
    array of ``dt``, cast by the strict list caster both protocols share
    (BYTES: strings, as UTF-8; gRPC's ``bytes_contents`` gives bytes)."""
    expected = math.prod(shape)
    # BYTES: refused before a bytes object is built for each string (numbers
    # go to numpy whole). The first elements' nesting says how many values
    # rectangular data holds; ragged data is refused anyway.
    nesting = _nesting(data) if dt.is_bytes else []
    if dt.is_bytes and math.prod(nesting) > expected:
        raise InvalidInput(
            f"{where}: 'data' holds {math.prod(nesting)} values or more (nested {nesting}), "
            f"but shape {list(shape)} needs {expected}"
        )
    if dt.is_bytes:
        array = bytes_array(data, where, what="'data'")
    else:
        array = array_from_list(data, dt, where, what="'data'", v2=True)
    if array.ndim > 1 and array.shape != shape:
        raise InvalidInput(
            f"{where}: nested 'data' has shape {list(array.shape)}, but 'shape' is {list(shape)}"
        )
    if array.size != expected:
        raise InvalidInput(
            f"{where}: 'data' holds {array.size} values, but shape {list(shape)} needs {expected}"
        )
    return array.reshape(shape)


def _nesting(data: Any) -> list[int]:
    """The lengths of ``data``'s first elements down its nesting of lists."""
    lengths: list[int] = []
    while isinstance(data, list) and len(lengths) <= MAX_RANK:
        lengths.append(len(data))
        if not data:
            break
        data = data[0]
    return lengths


def check_shape_against(shape: tuple[int, ...], spec: InputSpec, batched: bool, where: str) -> None:
    """The shape against the model's (``validate.shape_problem``), said in the
    request's own axis numbers. (``wire.validate`` checks every row again.)"""
    problem = shape_problem(shape, spec, batched=batched)
    if problem is None:
        return
    kind, axis, got, expected, limit = problem
    if kind == "rank":
        raise InvalidInput(
            f"{where}: shape {list(shape)} has {got} dimension(s); the model expects "
            f"{expected}" + (" (batch dimension first)" if batched else "")
        )
    if kind == "length":
        raise InvalidInput(
            f"{where}: shape {list(shape)}: axis {axis} has length {got}; "
            f"it must be between 1 and {limit}"
        )
    raise InvalidInput(
        f"{where}: shape {list(shape)}: axis {axis} must be {expected[axis]} (the model expects "
        f"{expected})"
    )


def check_batch(k: int, max_items: int) -> None:
    """The batch dimension (the request's item count) within 1 .. ``max_items``."""
    if not 1 <= k <= max_items:
        raise InvalidInput(f"the batch dimension is {k}; it must be between 1 and {max_items}")
