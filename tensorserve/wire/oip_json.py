"""The JSON text of the Open Inference Protocol: read a request's JSON
header, write a response's, as fast as two C libraries do it and with
exactly the results of Python's own ``json`` module.

Measured (``66cf52f:benchmarks/oip_codec.py``, a one-off since removed;
benchmarks/results/HISTORY.md): for a
128-token tagger request and its 128 x 9 float32 logits, the stdlib spent
~30 us parsing the request and ~680 us writing the answer (a Python float's
``repr`` per value), 40 times the native msgpack codec's whole cost. So:

- **reading**: msgspec, not orjson, because msgspec keeps integers beyond
  64 bits exact, as the stdlib does (orjson turns them into floats, which
  would let ``2**64`` through as a float input, and change a request
  parameter's value). Whatever msgspec refuses (``NaN``/``Infinity``,
  ``1e400``, lone surrogates, a UTF-16 body, deep nesting) is read again by
  the stdlib, so anything it accepts is accepted alike and every refusal
  carries the stdlib's message.
- **writing**: orjson, which writes numpy arrays itself. Float outputs go as
  float64 so the numbers are the ones ``json.dumps(array.tolist())`` wrote
  (each float32 exactly, as Triton writes them; float32's own shortest
  digits would be ~25% cheaper to write, but a reader taking them as
  float64 would see other numbers). A message holding NaN or an infinity
  anywhere is written by the stdlib (orjson would write ``null``; JSON's
  extension writes ``NaN``), as is one orjson refuses (an integer beyond 64
  bits, a string with a lone surrogate, a key that is not a string).
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import numpy as np
import orjson

from tensorserve.errors import InvalidInput
from tensorserve.tensors.dtypes import DType, bfloat16_floats

_DECODER = msgspec.json.Decoder()
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def loads(text: bytes) -> Any:
    """``json.loads(text)``, faster: the same value, or the same exception."""
    try:
        return _DECODER.decode(text)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return json.loads(text)  # the stdlib decides, and says why it refuses


def tensor_data(array: np.ndarray, dt: DType) -> np.ndarray | list[str]:
    """An output's JSON ``data``: flat, C-ordered, floats as float64 (bfloat16
    from its bit patterns), BYTES as UTF-8 strings, ready for ``dumps``."""
    if dt.is_bytes:
        return _strings(array, dt)  # a list: orjson writes no object arrays
    if dt.name == "bfloat16":
        array = bfloat16_floats(array)
    if array.dtype.kind == "f":
        array = array.astype(np.float64, copy=False)
    return np.ascontiguousarray(array).reshape(-1)


def dumps(message: dict[str, Any]) -> bytes:
    """``json.dumps(message, separators=(",", ":"))`` with numpy arrays as
    lists: the same JSON values (non-ASCII is written as UTF-8, not escaped)."""
    try:
        text = orjson.dumps(message, option=_NUMPY)
    except orjson.JSONEncodeError:
        return _stdlib_dumps(message)
    # orjson writes NaN and the infinities as null: only a text with a null in
    # it needs the look at every value (a None is a null too).
    if b"null" in text and not _finite(message):
        return _stdlib_dumps(message)
    return text


def _stdlib_dumps(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), default=_plain).encode()


def _finite(value: Any) -> bool:
    """No NaN or infinity anywhere in ``value`` (arrays checked in C)."""
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (np.ndarray, np.floating)) and value.dtype.kind in "fc":
        return bool(np.isfinite(value).all())
    return True


def _plain(value: Any) -> Any:
    """What the stdlib writes for a numpy value."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _strings(array: np.ndarray, dt: DType) -> list[str]:
    """A BYTES output's elements as JSON strings; bytes that are not UTF-8
    cannot be one, so the caller is told to ask for binary data."""
    try:
        return [element.decode() for element in array.reshape(-1)]
    except UnicodeDecodeError:
        raise InvalidInput(
            f"a {dt.v2} output holds bytes that are not UTF-8, which JSON cannot carry; "
            f"ask for it as binary data (parameters.binary_data = true)"
        ) from None
