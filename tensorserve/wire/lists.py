"""The one strict caster of plain (nested) lists of numbers, for both
protocols: the native protocol's untyped features and the Open Inference
Protocol's JSON ``data``.

Nothing is silently truncated, rounded, wrapped or coerced: numpy reads the
list once (``np.asarray``, in C) and the kind it found is checked against the
declared dtype, so the check costs no Python loop over the elements.

============  =========================================================
declared      the list may hold
============  =========================================================
bool          only booleans
integers      only integers, each within the dtype's range
floats, bf16  integers or floats, each within the dtype's finite range
============  =========================================================

A list mixing booleans with numbers reads as numbers (numpy's promotion):
telling them apart would take a look at every element.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorserve.errors import InvalidInput
from tensorserve.tensors.dtypes import NUMERIC, DType, bfloat16_bits

# numpy kinds each declared dtype accepts, and how an error names them.
_ALLOWED = {
    name: "b" if name == "bool" else ("iuf" if dt.is_float else "iu")
    for name, dt in NUMERIC.items()
}
# An integer dtype's bounds (np.iinfo is slow to build per call).
_BOUNDS = {
    name: (int(np.iinfo(dt.numpy).min), int(np.iinfo(dt.numpy).max))
    for name, dt in NUMERIC.items()
    if _ALLOWED[name] == "iu"
}
_KIND_NAMES = {"b": "booleans", "i": "integers", "u": "integers", "f": "floats"}
_NEEDS = {"b": "booleans", "iu": "integers", "iuf": "numbers"}


def array_from_list(data: Any, dt: DType, where: str, *, what: str, v2: bool) -> np.ndarray:
    """``data`` as a host array of ``dt`` (bfloat16 as its bit patterns), in
    the shape numpy found; ``InvalidInput`` otherwise, starting with ``where``.

    ``what`` names the data in messages (``"the list"``, ``"'data'"``); ``v2``
    names the dtype the OIP way (``INT64``) instead of the native one (``int64``).
    """
    try:
        raw = np.asarray(data)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged, or nested too deep
        raise InvalidInput(f"{where}: {what} is not a rectangular list of numbers: {exc}") from None
    if not raw.size:
        return raw.astype(dt.numpy)  # nothing to check; the caller's shape checks decide
    allowed = _ALLOWED[dt.name]
    kind = raw.dtype.kind
    if kind not in allowed:
        found = _KIND_NAMES.get(kind, "values that are not numbers (or out of range)")
        raise InvalidInput(
            f"{where}: {what} holds {found}; {_type_name(dt, v2)} needs {_NEEDS[allowed]}"
        )
    target = dt.numpy
    if raw.dtype == target:
        return raw  # the common case (int64, float64, bool): nothing to check or cast
    if allowed == "iu":
        low, high = _BOUNDS[dt.name]
        if raw.min() < low or raw.max() > high:
            raise InvalidInput(
                f"{where}: {what} holds integers out of range for {_type_name(dt, v2)} "
                f"({low} to {high})"
            )
        return raw.astype(target)
    host = np.dtype(np.float32) if dt.name == "bfloat16" else target  # bf16 via float32
    if kind == "f" or dt.name == "float16":
        # A finite number too large for the type would silently become inf.
        try:
            with np.errstate(over="raise"):
                floats = raw.astype(host)
        except FloatingPointError:
            raise InvalidInput(
                f"{where}: {what} holds numbers out of range for {_type_name(dt, v2)}"
            ) from None
    else:
        floats = raw.astype(host)  # any 64-bit integer is within float32's range
    if dt.name == "bfloat16":
        return bfloat16_bits(floats)
    return floats


def _type_name(dt: DType, v2: bool) -> str:
    return f"datatype {dt.v2}" if v2 else f"dtype {dt.name}"
