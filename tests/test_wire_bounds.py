"""Bound before you build (issue #52): a body whose declared counts cannot be
valid is refused before its elements are built, by every decoder. Each test
measures the Python memory the decoder allocates (``tracemalloc``) for a
body of a million or more elements: before these bounds each built every
element first (tens of MB, seconds on the loop), then refused the body."""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from tensorserve.errors import InvalidInput
from tensorserve.grpc import codec as grpc_codec
from tensorserve.grpc.generated import grpc_service_pb2 as pb
from tensorserve.repository.config import parse_config
from tensorserve.wire import native, oip

MAX_ITEMS = 64
WORDS = parse_config(
    {
        "max_batch_size": 8,
        "input": [{"name": "words", "dtype": "bytes", "shape": [-1], "max_length": 16}],
        "output": [{"name": "n", "dtype": "int64", "shape": [1]}],
    },
    "words",
)
MANY = 1 << 20  # elements in each hostile body
SMALL = 1 << 20  # what a refusal may allocate: far below one object per element


def refused_within(decode: Callable[[], Any], match: str) -> int:
    """Run ``decode``, which must raise ``InvalidInput`` matching ``match``;
    the peak of what it allocated meanwhile, in bytes."""
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match=match):
            decode()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def binary_body(shape: list[int], data: bytes) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "words",
                    "datatype": "BYTES",
                    "shape": shape,
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    ).encode()
    return header + data, {oip.HEADER_LENGTH: str(len(header))}


def test_binary_bytes_past_the_batch_limit_are_refused_before_unframing() -> None:
    body, headers = binary_body([MANY, 1], struct.pack("<I", 0) * MANY)  # 4 MiB of b""
    peak = refused_within(
        lambda: oip.decode_request(body, headers, WORDS, MAX_ITEMS),
        f"the batch dimension is {MANY}; it must be between 1 and {MAX_ITEMS}",
    )
    assert peak < SMALL


def test_json_bytes_beyond_the_shape_are_refused_before_they_are_built() -> None:
    flat = {"name": "words", "datatype": "BYTES", "shape": [1, 1], "data": ["ab"] * MANY}
    nested = {**flat, "data": [["ab"] * MANY]}
    for tensor, match in ((flat, f"holds {MANY} values or more"), (nested, "nested \\[1, ")):
        peak = refused_within(
            lambda t=tensor: oip.decode_message({"inputs": [t]}, memoryview(b""), WORDS, 8),
            match,
        )
        assert peak < SMALL


def test_a_json_header_with_more_strings_than_a_valid_one_is_refused_unparsed() -> None:
    """WORDS with 64 items: 64 x 16 words and 4096 other strings at most."""
    header = _header(["ab"] * (2 * (4096 + 64 * 16)))
    peak = refused_within(
        lambda: oip.decode_request(header, {}, WORDS, MAX_ITEMS),
        "holds 10247 strings or more; a valid request to this model holds at most 5120",
    )
    assert peak < SMALL
    assert oip.decode_request(_header(["ab"]), {}, WORDS, MAX_ITEMS).items


def _header(words: list[str]) -> bytes:
    tensor = {"name": "words", "datatype": "BYTES", "shape": [1, len(words)], "data": words}
    return json.dumps({"inputs": [tensor]}).encode()


def test_grpc_bytes_contents_beyond_the_shape_are_refused_before_conversion() -> None:
    request = pb.ModelInferRequest(model_name="words")
    tensor = request.inputs.add(name="words", datatype="BYTES", shape=[1, 1])
    tensor.contents.bytes_contents.extend([b"ab"] * MANY)
    peak = refused_within(
        lambda: grpc_codec.decode(request, WORDS, MAX_ITEMS),
        f"contents.bytes_contents holds {MANY} values, but shape \\[1, 1\\] needs 1",
    )
    assert peak < SMALL


def test_native_lists_longer_than_any_valid_one_are_refused_at_their_header() -> None:
    tensor = {"dtype": "bytes", "shape": [MANY], "data": ["ab"] * MANY}
    body = msgpack.packb({"items": [{"words": tensor}]})
    assert native.decode_is_costly(body)  # 3 MiB: decoded on the request pool
    peak = refused_within(
        lambda: native.decode_request(body, {}, WORDS, MAX_ITEMS), "exceeds max_array_len"
    )
    assert peak < SMALL
    many_items = msgpack.packb({"items": [{"words": ["ab"]}] * (MAX_ITEMS + 1)})
    peak = refused_within(
        lambda: native.decode_request(many_items, {}, WORDS, MAX_ITEMS),
        f"'items' holds {MAX_ITEMS + 1} items; the limit is {MAX_ITEMS}",
    )
    assert peak < SMALL
    assert native.max_array_len(WORDS, MAX_ITEMS) == MAX_ITEMS  # 16 words < 64 items


def test_native_decoding_still_reads_every_field() -> None:
    body = msgpack.packb(
        {
            "id": "r1",
            "items": [{"words": ["a", b"b"]}, {"words": {"dtype": "bytes", "shape": [1],
                                                        "data": [b"c"]}}],
            "parameters": {"timeout_ms": 250},
        }
    )  # fmt: skip
    request = native.decode_request(body, {}, WORDS, MAX_ITEMS)
    assert (request.id, request.timeout, len(request.items)) == ("r1", 0.25, 2)
    assert request.items[0]["words"] == ["a", b"b"]
    assert request.items[1]["words"].array.tolist() == [b"c"]
    with pytest.raises(InvalidInput, match="3 bytes follow the msgpack map"):
        native.decode_request(body + b"\x01\x02\x03", {}, WORDS, MAX_ITEMS)
    with pytest.raises(InvalidInput, match="body is not valid msgpack"):
        native.decode_request(body[:-3], {}, WORDS, MAX_ITEMS)
    with pytest.raises(InvalidInput, match="'items' must be a non-empty list"):
        native.decode_request(msgpack.packb({"items": 3}), {}, WORDS, MAX_ITEMS)
