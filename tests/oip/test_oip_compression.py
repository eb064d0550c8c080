"""Content-Encoding bodies: gzip and deflate (zlib or raw) decode, and no body
ever inflates past the limit, however well it compresses."""

from __future__ import annotations

import gzip
import time
import zlib

import pytest

from tensorserve.errors import InvalidInput
from tensorserve.wire.compression import decompress

DATA = b'{"inputs": []}' * 1000


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


# mtime=0: the same bytes in every process, so test ids agree (pytest-xdist).
@pytest.mark.parametrize(
    "encoding, body",
    [
        (None, DATA),
        ("identity", DATA),
        ("gzip", gzip.compress(DATA, mtime=0)),
        ("x-gzip", gzip.compress(DATA, mtime=0)),
        ("GZIP", gzip.compress(DATA, mtime=0)),
        ("deflate", zlib.compress(DATA)),  # what tritonclient sends
        ("deflate", raw_deflate(DATA)),  # what some other clients send
    ],
)
def test_bodies_decode(encoding: str | None, body: bytes) -> None:
    assert decompress(body, encoding, len(DATA)) == DATA


def test_gzip_members_are_concatenated() -> None:
    assert (
        decompress(gzip.compress(b"ab", mtime=0) + gzip.compress(b"cd", mtime=0), "gzip", 10)
        == b"abcd"
    )


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compression_bomb_stops_at_the_limit(encoding: str) -> None:
    # 64 MiB of zeros, compressed to ~64 KiB, against a 1 MiB limit
    compressor = zlib.compressobj(1, wbits=31 if encoding == "gzip" else 15)
    chunk = bytes(1 << 20)
    bomb = b"".join(compressor.compress(chunk) for _ in range(64)) + compressor.flush()
    started = time.perf_counter()
    with pytest.raises(
        InvalidInput, match=r"decompresses to more than max_request_bytes \(1048576 bytes\)"
    ):
        decompress(bomb, encoding, 1 << 20)
    assert time.perf_counter() - started < 0.5  # it stopped early, it did not inflate it all


def test_exactly_the_limit_is_accepted() -> None:
    assert len(decompress(gzip.compress(bytes(1000), mtime=0), "gzip", 1000)) == 1000
    with pytest.raises(InvalidInput, match="more than max_request_bytes"):
        decompress(gzip.compress(bytes(1001), mtime=0), "gzip", 1000)


@pytest.mark.parametrize(
    "encoding, body, message",
    [
        ("br", DATA, "unsupported Content-Encoding 'br'; send one of gzip, deflate, identity"),
        ("gzip", DATA, "body is not valid gzip data"),
        ("gzip", gzip.compress(DATA, mtime=0)[:-20], "the gzip-compressed body is truncated"),
        ("gzip", b"", "the gzip-compressed body is truncated"),
        ("deflate", zlib.compress(DATA) + b"junk", "4 unexpected bytes after the deflate stream"),
        ("gzip", gzip.compress(DATA, mtime=0) + b"junk", "body is not valid gzip data"),
    ],
)
def test_bad_bodies_are_400s(encoding: str, body: bytes, message: str) -> None:
    with pytest.raises(InvalidInput) as error:
        decompress(body, encoding, 1 << 20)
    assert message in error.value.message


def test_many_gzip_members_are_refused_in_linear_time() -> None:
    """4 MiB of empty members took 10 s on the loop (each member copied the
    remainder of the body); now the member cap refuses it at once."""
    empty = gzip.compress(b"", mtime=0)
    body = empty * ((4 << 20) // len(empty))
    started = time.perf_counter()
    with pytest.raises(InvalidInput, match="more than 64 members"):
        decompress(body, "gzip", 64 << 20)
    assert time.perf_counter() - started < 0.5


def test_members_up_to_the_cap_decode_across_windows() -> None:
    """Members that straddle the windows zlib is fed in still decode whole;
    the time stays linear however long the tail after each member."""
    import random

    noise = random.Random(0).randbytes(200_000)  # incompressible: spans several windows
    members = [gzip.compress(noise, mtime=0), gzip.compress(b"", mtime=0)] * 32
    assert decompress(b"".join(members), "gzip", 64 << 20) == noise * 32
    with pytest.raises(InvalidInput, match="more than 64 members"):
        decompress(b"".join(members) + members[1], "gzip", 64 << 20)
