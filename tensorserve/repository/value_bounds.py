"""An input's ``min_value`` / ``max_value``: the one rule, both halves. When
a config loads, ``bounds_problem`` says whether the bounds can hold for the
input's dtype; for every item of every protocol, ``values_problem`` says
whether its values keep them (``wire.validate.check_range`` raises it as
the caller's 400 before the item is queued).

Why: a value past what the model can take (an id past an embedding's table)
fails the whole batch on a CPU and, on a GPU, is a device-side assert that
leaves the CUDA context broken for every later batch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tensorserve.tensors.dtypes import NUMERIC, DType, bfloat16_floats

# The largest bfloat16 (numpy has none: torch.finfo(torch.bfloat16).max).
BFLOAT16_MAX = 3.3895313892515355e38


def _value_range(dt: DType) -> tuple[Any, Any]:
    if dt.name == "bfloat16":
        return -BFLOAT16_MAX, BFLOAT16_MAX
    if dt.is_float:
        floats = np.finfo(dt.numpy)
        return float(floats.min), float(floats.max)
    ints = np.iinfo(dt.numpy)
    return int(ints.min), int(ints.max)


# Each integer and float dtype's least and greatest value, from numpy (a
# front-end process checks configs too, and never imports torch).
RANGES: dict[str, tuple[Any, Any]] = {
    name: _value_range(dt) for name, dt in NUMERIC.items() if name != "bool"
}


def bounds_problem(dt: DType, low: float | None, high: float | None) -> str | None:
    """Why ``min_value`` / ``max_value`` cannot bound an input of ``dt``, or
    None: numbers only on integer and float inputs, whole numbers within an
    integer dtype's range, finite ones within a float's, and low <= high."""
    bounds = {name: v for name, v in (("min_value", low), ("max_value", high)) if v is not None}
    if not bounds:
        return None
    if dt.name not in RANGES:
        return f"min_value and max_value are for integer and float inputs, not {dt.name}"
    least, greatest = RANGES[dt.name]
    for name, value in bounds.items():
        if dt.is_float:
            if not math.isfinite(value):
                return f"{name} must be a finite number, got {value}"
        elif not isinstance(value, int):
            return f"{name} must be a whole number for dtype {dt.name}, got {value}"
        if not least <= value <= greatest:
            return f"{name} {value} is outside the range of {dt.name} ({least} to {greatest})"
    if low is not None and high is not None and low > high:
        return f"min_value {low} is above max_value {high}"
    return None


def values_problem(
    array: np.ndarray, dt: DType, low: float | None, high: float | None
) -> str | None:
    """What value of ``array`` (the host array of a ``dt`` input) is outside
    ``low`` .. ``high``, or None: a few numpy passes over the array, no
    Python loop. A NaN is outside any bound."""
    values = array
    if dt.name == "bfloat16":  # the host carries its bit patterns as uint16
        values = bfloat16_floats(array)
    if values.dtype.kind == "f" and np.isnan(values).any():
        bounds = ", ".join(
            f"{name} {value}"
            for name, value in (("min_value", low), ("max_value", high))
            if value is not None
        )
        return f"value nan is outside the input's bounds ({bounds})"
    if low is not None and (least := values.min()) < low:
        return f"value {least} is below min_value {low}"
    if high is not None and (most := values.max()) > high:
        return f"value {most} is above max_value {high}"
    return None
