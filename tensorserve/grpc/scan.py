"""Bounds on a serialized ``ModelInferRequest``, checked on its bytes before
protobuf parses it (issue #52).

Parsing costs far more than the wire for some messages: each entry of a
repeated field becomes an element of its own (``bytes_contents`` entries of
two bytes cost ~50 bytes each: a 60 MiB message of 15M of them took 765 MB
and held the event loop for seconds), and grpc's message limit
(``max_request_bytes``) counts only the wire. So the fields are walked first,
without building anything, and the counts a valid request to the model can
hold are enforced: at most ``MOST_FIELDS`` fields at the top level and in
each tensor beside its values (names, parameters, outputs, raw contents), at
most ``MOST_DIMS`` dimensions, and in each input's ``contents`` at most the
values its shape needs, and never more than a request to the model holds.

The walk visits one field per entry, and stops at the first count past its
bound, so it costs no more than the parse of a valid request would.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from tensorserve.errors import InvalidInput
from tensorserve.repository.config import ModelConfig
from tensorserve.wire.validate import most_values

VARINT, I64, LEN, I32 = 0, 1, 2, 5
MOST_FIELDS = 4096  # names, parameters, tensors: far more than any request needs
MOST_DIMS = 64  # the decoder allows 8; beyond this nothing more is read

# ModelInferRequest: model_name 1, model_version 2, inputs 5.
# InferInputTensor: name 1, shape 3 (packed int64), contents 5.
# InferTensorContents: 1..7 numbers (packed; 6 and 7 fixed 32 / 64 bits), 8 bytes.
CONTENTS_FIELDS = {
    1: "bool_contents",
    2: "int_contents",
    3: "int64_contents",
    4: "uint_contents",
    5: "uint64_contents",
    6: "fp32_contents",
    7: "fp64_contents",
    8: "bytes_contents",
}
FIXED_WIDTH = {6: 4, 7: 8}
_LOW_BYTES = bytes(range(0x80))  # a varint's last byte: one per value


def _malformed() -> InvalidInput:
    return InvalidInput("the ModelInferRequest is not a valid protobuf message")


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise _malformed()


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, start, end of its value) of each field."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, kind = key >> 3, key & 7
        if kind == VARINT:
            after = _varint(buf, pos, end)[1]
        elif kind == LEN:
            size, pos = _varint(buf, pos, end)
            after = pos + size
        elif kind in (I64, I32):
            after = pos + (8 if kind == I64 else 4)
        else:  # groups: no field of these messages is one
            raise _malformed()
        if after > end:
            raise _malformed()
        yield number, kind, pos, after
        pos = after


def _too_many(what: str, most: int) -> InvalidInput:
    return InvalidInput(f"{what} holds more than {most} fields")


def model_name(buf: bytes) -> tuple[str, str]:
    """(model_name, model_version) of the serialized request, its top level
    walked as ``check`` walks it."""
    name = version = b""
    for count, (number, kind, start, end) in enumerate(_fields(buf, 0, len(buf))):
        if count >= MOST_FIELDS:
            raise _too_many("the ModelInferRequest", MOST_FIELDS)
        if kind == LEN and number in (1, 2):
            if number == 1:
                name = buf[start:end]
            else:
                version = buf[start:end]
    try:
        return name.decode(), version.decode()
    except UnicodeDecodeError:
        raise InvalidInput("model_name and model_version must be UTF-8 text") from None


def check(buf: bytes, config: ModelConfig, max_items: int) -> None:
    """Raise ``InvalidInput`` when the serialized request ``buf`` holds more
    fields or values than a valid request to the model of ``config`` can."""
    items = max_items if config.batching else 1
    most = {spec.name: items * most_values(spec) for spec in config.input}
    anyone = max(most.values(), default=0)  # an unknown input: the decoder names it
    for count, (number, kind, start, end) in enumerate(_fields(buf, 0, len(buf))):
        if count >= MOST_FIELDS:
            raise _too_many("the ModelInferRequest", MOST_FIELDS)
        if number == 5 and kind == LEN:
            _check_input(buf, start, end, most, anyone, max_items)


def _check_input(
    buf: bytes, start: int, end: int, most: dict[str, int], anyone: int, max_items: int
) -> None:
    name, dims, fields = "", 0, 0
    shape: list[int] | None = []
    for number, kind, at, after in _fields(buf, start, end):
        if number == 1 and kind == LEN:
            name = buf[at:after].decode("utf-8", "replace")
        elif number == 3:  # the shape, packed or one dimension per field
            if kind == LEN:
                found = (after - at) - len(buf[at:after].translate(None, _LOW_BYTES))
                if shape is not None and found <= MOST_DIMS:
                    shape += _packed_varints(buf, at, after)
            else:
                found = 1
                if shape is not None:
                    shape.append(_varint(buf, at, after)[0] if kind == VARINT else -1)
            dims += found
            if dims > MOST_DIMS:
                raise InvalidInput(f"input {name!r}: shape has more than {MOST_DIMS} dimensions")
        elif number == 5 and kind == LEN:
            bound = most.get(name, anyone)
            why = (
                f"a request to this model holds at most {bound} (max_items_per_request {max_items})"
            )
            if shape and all(0 <= d < 2**63 for d in shape) and math.prod(shape) < bound:
                bound, why = math.prod(shape), f"shape {shape} needs {math.prod(shape)}"
            _check_contents(buf, at, after, bound, f"input {name!r}: contents", why)
            shape = None  # values count only against the shape given before them
        else:
            fields += 1
            if fields > MOST_FIELDS:
                raise _too_many(f"input {name!r}", MOST_FIELDS)


def _packed_varints(buf: bytes, start: int, end: int) -> list[int]:
    values, pos = [], start
    while pos < end:
        value, pos = _varint(buf, pos, end)
        values.append(value - (1 << 64) if value >= 1 << 63 else value)
    return values


def _check_contents(buf: bytes, start: int, end: int, bound: int, where: str, why: str) -> None:
    values = 0
    for number, kind, at, after in _fields(buf, start, end):
        if kind == LEN and number in FIXED_WIDTH:
            values += (after - at) // FIXED_WIDTH[number]
        elif kind == LEN and number != 8:  # packed varints: one last byte per value
            values += (after - at) - len(buf[at:after].translate(None, _LOW_BYTES))
        else:
            values += 1
        if values > bound:
            field = CONTENTS_FIELDS.get(number, f"field {number}")
            raise InvalidInput(f"{where}.{field} holds more than {bound} values; {why}")
