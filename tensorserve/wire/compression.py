"""Request bodies sent with ``Content-Encoding: gzip | deflate``.

The server turns off aiohttp's own request decompression so that this is the
one place a body is inflated, and it never inflates more than ``limit`` bytes
(the server's ``max_request_bytes``): a few kilobytes of zeros can expand to
gigabytes, so the bound is enforced while decompressing, not afterwards.
"""

from __future__ import annotations

import zlib

from tensorserve.errors import InvalidInput

SUPPORTED = ("gzip", "deflate", "identity")


def _wbits(encoding: str, first_byte: int | None) -> int:
    if encoding == "gzip":
        return 16 + zlib.MAX_WBITS
    # RFC 9110: "deflate" is the zlib format; some clients send raw deflate
    # (no zlib header), recognisable by the header's compression-method nibble.
    if first_byte is not None and first_byte & 0x0F != 8:
        return -zlib.MAX_WBITS
    return zlib.MAX_WBITS


def decompress(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The decoded body, or ``InvalidInput`` if it is not valid ``gzip`` /
    ``deflate`` data or would decode to more than ``limit`` bytes."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "x-gzip":
        encoding = "gzip"
    if encoding == "identity":
        return body
    if encoding not in SUPPORTED:
        raise InvalidInput(
            f"unsupported Content-Encoding {content_encoding!r}; send one of {', '.join(SUPPORTED)}"
        )
    parts: list[bytes] = []
    total = 0
    data = body
    while True:  # a gzip body may hold several members, one after another
        inflater = zlib.decompressobj(_wbits(encoding, data[0] if data else None))
        try:
            # Ask for one byte more than may remain: getting it means "too large".
            chunk = inflater.decompress(data, limit - total + 1)
        except zlib.error as exc:
            raise InvalidInput(f"body is not valid {encoding} data: {exc}") from None
        total += len(chunk)
        if total > limit:
            raise InvalidInput(
                f"the {encoding}-compressed body decompresses to more than "
                f"max_request_bytes ({limit} bytes)"
            )
        parts.append(chunk)
        if not inflater.eof:
            raise InvalidInput(f"the {encoding}-compressed body is truncated")
        data = inflater.unused_data
        if not data:
            return b"".join(parts)
        if encoding != "gzip":
            raise InvalidInput(f"{len(data)} unexpected bytes after the {encoding} stream")
