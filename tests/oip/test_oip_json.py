"""The OIP's JSON text (``wire/oip_json.py``): read and written by fast C
libraries, with exactly the results of Python's own ``json`` module, the
edge cases where those libraries differ from it included (NaN and
Infinity, integers beyond 64 bits, duplicate keys, lone surrogates, deep
nesting, a UTF-16 body)."""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorserve.errors import InvalidInput
from tensorserve.repository.config import parse_config
from tensorserve.tensors.dtypes import DTYPES
from tensorserve.wire import oip, oip_json

EDGE_CASES = [
    b"[NaN, Infinity, -Infinity]",
    b"[1e400, -1e400, 1e-400]",
    b'{"a": 1, "a": 2}',
    b"[18446744073709551615, 18446744073709551616, -9223372036854775809]",
    b"[123456789012345678901234567890, 1.5]",
    b'["\\ud800", "\\udc00x"]',
    b'["\xed\xa0\x80"]',  # a surrogate encoded in UTF-8: the stdlib lets it through
    b"\xef\xbb\xbf[1]",  # UTF-8 byte-order mark
    '{"x": [1]}'.encode("utf-16"),
    b"[" * 1500 + b"]" * 1500,  # deep, but within the stdlib's recursion limit
    b"[" * 100_000,
    b'["\xff"]',
    b"[1,]",
    b'{"a": 1} x',
    b"",
    b"01",
    b" [-0, 0.0, -0.0, 1E5] ",
]


def outcome(parse: Any, text: bytes) -> tuple[str, str]:
    """What parsing ``text`` gives: the value's repr (ints and floats, NaN,
    key order all show) or the exception's type and message."""
    try:
        return "value", repr(parse(text))
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("text", EDGE_CASES, ids=lambda t: repr(t[:24]))
def test_loads_gives_what_the_stdlib_gives(text: bytes) -> None:
    assert outcome(oip_json.loads, text) == outcome(json.loads, text)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()  # any size: beyond 64 bits is where the libraries differ
    | st.floats()  # NaN and the infinities, written as JSON's extension writes them
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None, database=None)
@given(value=JSON_VALUES, cut=st.integers(0, 40), junk=st.binary(max_size=2))
def test_any_json_text_and_its_damaged_copies_parse_like_the_stdlib(
    value: Any, cut: int, junk: bytes
) -> None:
    text = json.dumps(value).encode()
    assert outcome(oip_json.loads, text) == outcome(json.loads, text)
    damaged = text[:cut] + junk + text[cut:]
    assert outcome(oip_json.loads, damaged) == outcome(json.loads, damaged)


# ---------------------------------------------------------------------- writing
def stdlib_text(message: dict[str, Any]) -> bytes:
    """What the codec wrote before: arrays as lists, the stdlib's JSON."""

    def plain(value: Any) -> Any:
        return value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value

    return json.dumps(message, separators=(",", ":"), default=plain).encode()


def same_json(a: bytes, b: bytes) -> bool:
    """Equal JSON values, type for type (1 and 1.0 differ; NaN equals NaN)."""
    return repr(json.loads(a)) == repr(json.loads(b))


@pytest.mark.parametrize("name", sorted(set(DTYPES) - {"bytes"}))
def test_tensor_data_writes_the_numbers_tolist_wrote(name: str) -> None:
    dt = DTYPES[name]
    values = np.array([[0, 1], [2, 3]]) if dt.numpy.kind in "iub" else np.array([[0.1, -2.5]] * 2)
    if name == "bfloat16":
        array = values.astype(ml_dtypes.bfloat16).view(np.uint16)
        expected = values.astype(ml_dtypes.bfloat16).astype(np.float32).ravel().tolist()
    else:
        array = values.astype(dt.numpy)
        expected = array.ravel().tolist()
    written = oip_json.dumps({"data": oip_json.tensor_data(array.T, dt)})  # not C-ordered
    expected = np.asarray(expected).reshape(values.shape).T.ravel().tolist()
    assert same_json(written, json.dumps({"data": expected}).encode())


def test_tensor_data_writes_bytes_as_utf8_strings_or_says_to_ask_for_binary() -> None:
    text = np.array([["h\u00e9".encode(), b""]], dtype=object)
    written = oip_json.dumps({"data": oip_json.tensor_data(text.T, DTYPES["bytes"])})
    assert json.loads(written) == {"data": ["h\u00e9", ""]}
    with pytest.raises(InvalidInput, match=r"not UTF-8.*parameters.binary_data = true"):
        oip_json.tensor_data(np.array([b"\xff"], dtype=object), DTYPES["bytes"])


@pytest.mark.parametrize(
    "message",
    [
        {"data": np.array([1.0, np.nan, np.inf, -np.inf])},  # orjson would write null
        {"id": "null", "parameters": {"none": None}, "data": np.array([1.5, -np.inf], np.float32)},
        {"id": "null", "parameters": {"none": None}, "data": np.array([1.5, 2], np.float32)},
        {"id": "\ud800", "data": np.arange(3)},  # not UTF-8: orjson refuses it
        {"parameters": {"big": 2**70, "nan": float("nan")}, "data": np.ones(2, np.float32)},
        {"parameters": {1: "an int key"}},
        {"id": "é", "data": np.array([0.1, 1e-5, 1e20, 5e-324]), "flag": np.bool_(True)},
    ],
)
def test_dumps_writes_what_the_stdlib_writes(message: dict[str, Any]) -> None:
    assert same_json(oip_json.dumps(message), stdlib_text(message))


def test_an_output_with_nan_is_written_as_json_writes_it() -> None:
    assert b"NaN" in oip_json.dumps(
        {"data": oip_json.tensor_data(np.array([np.nan], np.float32), DTYPES["float32"])}
    )


# ---------------------------------------------------------------------- the codec
FLOATS = parse_config(
    {
        "max_batch_size": 4,
        "input": [
            {"name": "x", "dtype": "float32", "shape": [-1]},
            {"name": "n", "dtype": "int64", "shape": [-1]},
        ],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
    },
    "floats",
)


def decode(x: str, n: str = "[1, 2]", extra: str = "") -> Any:
    """A request whose data is JSON text as written (NaN, 2**64 and all)."""
    inputs = [
        '{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": ' + x + "}",
        '{"name": "n", "shape": [1, 2], "datatype": "INT64", "data": ' + n + "}",
    ]
    text = '{"inputs": [' + ", ".join(inputs) + "]" + extra + "}"
    return oip.decode_request(text.encode(), {}, FLOATS, 8)


def test_nan_and_infinity_literals_stay_accepted_for_float_inputs() -> None:
    got = decode("[NaN, -Infinity]").items[0]["x"].array
    assert np.isnan(got[0]) and got[1] == -np.inf and got.dtype == np.float32


@pytest.mark.parametrize(
    "x, n, message",
    [
        (
            "[1, 18446744073709551616]",
            "[1, 2]",
            "input 'x': 'data' holds values that are not numbers",
        ),
        (
            "[1, 2]",
            "[1, -9223372036854775809]",
            "input 'n': 'data' holds values that are not numbers",
        ),
        ("[1, 2]", "[NaN, 1]", "input 'n': 'data' holds floats; datatype INT64 needs integers"),
        (
            "[1, 2]",
            "[true, false]",
            "input 'n': 'data' holds booleans; datatype INT64 needs integers",
        ),
        ("[1, 1e39]", "[1, 2]", "input 'x': 'data' holds numbers out of range for datatype FP32"),
    ],
)
def test_huge_and_wrongly_typed_numbers_are_refused_naming_the_input(
    x: str, n: str, message: str
) -> None:
    with pytest.raises(InvalidInput) as error:
        decode(x, n)
    assert message in error.value.message


def test_duplicate_keys_keep_the_last_value_as_before() -> None:
    request = decode("[1, 2]", extra=', "id": "first", "id": "second"')
    assert request.id == "second"
