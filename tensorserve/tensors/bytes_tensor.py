"""BYTES tensors: a numpy object array of ``bytes`` on the host, and the
one binary framing every wire uses for it (Triton's): each element, in
row-major order, as a 4-byte little-endian length and then its bytes.

    b"\\x02\\x00\\x00\\x00hi\\x00\\x00\\x00\\x00"   ->   [b"hi", b""]

The KServe v2 binary extension, gRPC's ``raw_input_contents`` and the
worker process's socket (ipc/messages.py) carry this framing; JSON carries a
list of strings, msgpack and gRPC's ``bytes_contents`` a list of bin. Never
pickle. Pure functions, no torch.
"""

from __future__ import annotations

import math
import reprlib
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from tensorserve.errors import InvalidInput, ModelFailure

_LENGTH = struct.Struct("<I")


def bytes_array(values: Any, where: str, *, what: str = "the list") -> np.ndarray:
    """``values`` (a (nested) list or an array of ``bytes`` / ``str``, str
    as UTF-8) as an object array of ``bytes`` in the shape the nesting gives;
    ``InvalidInput`` starting with ``where`` for anything else (a number, a
    ragged list)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "SU":
        values = values.astype(object)  # fixed-width numpy strings: one element each
    try:
        raw = values if isinstance(values, np.ndarray) else _object_array(values)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"{where}: {what} is not a rectangular list of strings: {exc}") from None
    if raw.dtype != object:
        raise InvalidInput(
            f"{where}: {what} holds {raw.dtype.name} values; datatype BYTES needs strings or bytes"
        )
    flat = raw.reshape(-1)
    out = np.empty(flat.shape, dtype=object)
    for index, element in enumerate(flat):
        if isinstance(element, bytes):
            out[index] = element
        elif isinstance(element, str):
            try:
                out[index] = element.encode()
            except UnicodeEncodeError as exc:  # a lone surrogate: JSON's "\ud800" parses to one
                raise InvalidInput(
                    f"{where}: {what} element {index} is not valid Unicode text: "
                    f"{exc.reason} at position {exc.start}"
                ) from None
        elif isinstance(element, (bytearray, memoryview)):
            out[index] = bytes(element)
        else:
            raise InvalidInput(
                f"{where}: {what} holds {reprlib.repr(element)} ({type(element).__name__}); "
                f"datatype BYTES needs strings or bytes"
            )
    return out.reshape(raw.shape)


def bytes_output(value: Any, name: str) -> np.ndarray:
    """A model's bytes output (an object array, or nested lists, of
    ``bytes`` / ``str``) as ``bytes_array`` makes it; anything else is the
    model's fault (``ModelFailure``), not the caller's."""
    try:
        return bytes_array(value, f"output {name!r}", what="the model's output")
    except InvalidInput as exc:
        raise ModelFailure(exc.message) from None


def _object_array(values: Any) -> np.ndarray:
    """A nested list as an object array of its leaves. (``np.array(...,
    dtype=object)`` alone would take a list of equal-length bytes apart
    into nothing, but a ragged nesting into lists: both are checked.)"""
    if not isinstance(values, list):
        raise TypeError(f"expected a list, got {type(values).__name__}")
    shape: list[int] = []
    probe: Any = values
    while isinstance(probe, list):
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    array = np.empty(shape, dtype=object)
    leaves = list(_leaves(values, len(shape)))
    if len(leaves) != array.size:
        raise ValueError(f"nested lists do not form the shape {shape}")
    array.reshape(-1)[:] = leaves if leaves else []
    return array


def _leaves(values: Any, depth: int) -> Iterable[Any]:
    if depth == 0:
        if isinstance(values, list):
            raise ValueError("nested lists are ragged")
        yield values
        return
    if not isinstance(values, list):
        raise TypeError("nested lists are ragged")
    for value in values:
        yield from _leaves(value, depth - 1)


def longest_element(array: np.ndarray) -> int:
    """The length of the longest element of a bytes array (0 when empty)."""
    return max((len(element) for element in array.reshape(-1)), default=0)


def check_byte_sizes(array: np.ndarray, element_limit: int, item_limit: int, where: str) -> None:
    """``InvalidInput`` naming ``where`` when an element is longer than
    ``element_limit`` bytes (the server's ``max_bytes_element_length``), or
    the elements together than ``item_limit`` (``max_bytes_item_bytes``)."""
    total = 0
    for index, element in enumerate(array.reshape(-1)):
        length = len(element)
        if length > element_limit:
            raise InvalidInput(
                f"{where}: element {index} is {length} bytes long; the server's "
                f"max_bytes_element_length is {element_limit}"
            )
        total += length
    if total > item_limit:
        raise InvalidInput(
            f"{where}: its {array.size} elements hold {total} bytes together; the server's "
            f"max_bytes_item_bytes is {item_limit}"
        )


def check_utf8(array: np.ndarray, where: str) -> None:
    """``InvalidInput`` naming ``where`` when an element is not UTF-8 text
    (an input declared ``utf8 = true``: a tokenizer's)."""
    for index, element in enumerate(array.reshape(-1)):
        if isinstance(element, str):
            continue  # text already
        try:
            element.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"{where}: element {index} is not UTF-8 text: byte 0x{element[exc.start]:02x} "
                f"at position {exc.start} ({exc.reason})"
            ) from None


def frame(array: np.ndarray) -> bytes:
    """A bytes array in the 4-byte little-endian length framing, row-major."""
    parts: list[bytes] = []
    for element in array.reshape(-1):
        parts.append(_LENGTH.pack(len(element)))
        parts.append(element)
    return b"".join(parts)


def unframe(data: bytes | bytearray | memoryview, shape: Iterable[int], where: str) -> np.ndarray:
    """The framing of exactly ``prod(shape)`` elements back into a bytes
    array of ``shape``; ``InvalidInput`` starting with ``where`` when a length
    runs past the end or bytes are left over."""
    dims = tuple(shape)
    count = math.prod(dims)  # exact: a hostile shape cannot wrap around
    view = memoryview(data).cast("B")
    if count * _LENGTH.size > len(view):  # checked before anything is allocated
        raise InvalidInput(
            f"{where}: {len(view)} bytes cannot hold {count} BYTES elements "
            f"(each needs a 4-byte length)"
        )
    out = np.empty(count, dtype=object)
    offset = 0
    for index in range(count):
        if offset + _LENGTH.size > len(view):
            raise InvalidInput(
                f"{where}: the BYTES data ends inside the length of element {index} "
                f"(offset {offset} of {len(view)} bytes)"
            )
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if offset + length > len(view):
            raise InvalidInput(
                f"{where}: BYTES element {index} says it is {length} bytes long, but only "
                f"{len(view) - offset} bytes are left"
            )
        out[index] = bytes(view[offset : offset + length])
        offset += length
    if offset != len(view):
        raise InvalidInput(
            f"{where}: {len(view) - offset} bytes are left after the {count} BYTES elements "
            f"of shape {list(dims)}"
        )
    return out.reshape(dims)
