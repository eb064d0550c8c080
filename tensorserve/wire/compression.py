"""Request bodies sent with ``Content-Encoding: gzip | deflate``.

The server turns off aiohttp's own request decompression so that this is the
one place a body is inflated, and it never inflates more than ``limit`` bytes
(the server's ``max_request_bytes``): a few kilobytes of zeros can expand to
gigabytes, so the bound is enforced while decompressing, not afterwards.

The time is bounded too, linear in the body: the input is fed to zlib in
windows of ``WINDOW`` bytes (zlib copies what it did not use of its input
into ``unused_data`` at the end of each member, so feeding it the whole
remainder made a body of many tiny members quadratic: 4 MiB of empty gzip
members took 10 s), and a body may hold at most ``MAX_MEMBERS`` gzip members
(one is the norm; ``cat a.gz b.gz`` makes two).
"""

from __future__ import annotations

import zlib

from tensorserve.errors import InvalidInput

SUPPORTED = ("gzip", "deflate", "identity")
MAX_MEMBERS = 64
WINDOW = 64 << 10
# Above this many compressed bytes the HTTP layer inflates on the request pool:
# zlib releases the GIL while it inflates, so the loop keeps serving meanwhile.
COSTLY_BYTES = 16 << 10


def _wbits(encoding: str, first_byte: int | None) -> int:
    if encoding == "gzip":
        return 16 + zlib.MAX_WBITS
    # RFC 9110: "deflate" is the zlib format; some clients send raw deflate
    # (no zlib header), recognisable by the header's compression-method nibble.
    if first_byte is not None and first_byte & 0x0F != 8:
        return -zlib.MAX_WBITS
    return zlib.MAX_WBITS


def encoding_of(content_encoding: str | None) -> str:
    """The body's encoding, one of ``SUPPORTED``, or ``InvalidInput``."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "x-gzip":
        encoding = "gzip"
    if encoding not in SUPPORTED:
        raise InvalidInput(
            f"unsupported Content-Encoding {content_encoding!r}; send one of {', '.join(SUPPORTED)}"
        )
    return encoding


def decompress_is_costly(body: bytes, content_encoding: str | None) -> bool:
    return len(body) > COSTLY_BYTES and encoding_of(content_encoding) != "identity"


def decompress(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The decoded body, or ``InvalidInput`` if it is not valid ``gzip`` /
    ``deflate`` data, would decode to more than ``limit`` bytes, or holds
    more than ``MAX_MEMBERS`` gzip members. Time linear in ``len(body)``."""
    encoding = encoding_of(content_encoding)
    if encoding == "identity":
        return body
    view = memoryview(body)
    parts: list[bytes] = []
    total = 0
    position = 0  # where the next member starts
    for _member in range(MAX_MEMBERS):
        inflater = zlib.decompressobj(_wbits(encoding, body[position] if body else None))
        fed = position  # the input up to here has been given to this inflater
        pending: bytes | memoryview = b""  # input it has not taken (its unconsumed_tail)
        while not inflater.eof:
            if not pending:
                if fed >= len(view):
                    raise InvalidInput(f"the {encoding}-compressed body is truncated")
                pending = view[fed : fed + WINDOW]
                fed += len(pending)
            try:
                # Ask for one byte more than may remain: getting it means "too large".
                chunk = inflater.decompress(pending, limit - total + 1)
            except zlib.error as exc:
                raise InvalidInput(f"body is not valid {encoding} data: {exc}") from None
            total += len(chunk)
            if total > limit:
                raise InvalidInput(
                    f"the {encoding}-compressed body decompresses to more than "
                    f"max_request_bytes ({limit} bytes)"
                )
            parts.append(chunk)
            pending = inflater.unconsumed_tail
        position = fed - len(inflater.unused_data)  # at most WINDOW bytes copied
        if position == len(view):
            return b"".join(parts)
        if encoding != "gzip":
            raise InvalidInput(
                f"{len(view) - position} unexpected bytes after the {encoding} stream"
            )
    raise InvalidInput(
        f"the gzip-compressed body holds more than {MAX_MEMBERS} members (gzip streams "
        f"one after another); the server accepts at most {MAX_MEMBERS}"
    )
