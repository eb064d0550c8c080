"""Reading request bodies: size-bounded, time-bounded, with
``Content-Encoding`` undone.

aiohttp's own request decompression is turned off in the app factory, so a
compressed body arrives as sent (at most ``max_request_bytes``) and is
inflated here with the same bound (``wire/compression.py``).

A body must arrive within ``body_timeout_s`` of its headers, or the caller
gets 408 and the connection is closed: a client trickling a body a byte at
a time must not hold a connection (and its buffers) forever. aiohttp bounds
the request line and headers only through its keep-alive timeout
(``keepalive_timeout_s``, docs/reliability.md), and bodies not at all.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from aiohttp import web

from tensorserve.errors import InvalidInput
from tensorserve.http.keys import SETTINGS
from tensorserve.pools import on_request_pool
from tensorserve.wire.compression import decompress, decompress_is_costly


async def read_body(request: web.Request) -> bytes:
    settings = request.app[SETTINGS]
    if request.content.is_eof():  # arrived with the headers (most bodies): nothing to bound
        body = await request.read()
    else:
        body = await _read_within(request, settings.body_timeout_s)
    encoding = request.headers.get("Content-Encoding")
    if decompress_is_costly(body, encoding):  # a bomb inflates off the loop
        return await on_request_pool(decompress, body, encoding, settings.max_request_bytes)
    return decompress(body, encoding, settings.max_request_bytes)


async def _read_within(request: web.Request, timeout: float) -> bytes:
    """The body (over ``client_max_size``: 413), or 408 after ``timeout`` s."""
    try:
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(timeout):  # no extra task, unlike wait_for
                return await request.read()
        return await asyncio.wait_for(request.read(), timeout)  # pragma: no cover
    except asyncio.TimeoutError:
        # Closed after the 408 (and aiohttp's lingering read of at most 10 s of
        # what is left, so the client reads the 408 rather than a reset), even
        # if the rest of the body arrives meanwhile.
        request.protocol.close()
        raise web.HTTPRequestTimeout(
            text=f"the request body did not arrive within {timeout:g} s (body_timeout_s); "
            f"the connection is closed"
        ) from None


async def read_json_object(request: web.Request, what: str) -> dict[str, Any]:
    """A JSON object body; an empty body is ``{}`` (tritonclient sends one)."""
    body = await read_body(request)
    if not body.strip():
        return {}
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidInput(f"the {what} is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise InvalidInput(f"the {what} must be a JSON object")
    return message
