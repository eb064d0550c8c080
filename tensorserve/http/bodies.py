"""Reading request bodies: size-bounded, with ``Content-Encoding`` undone.

aiohttp's own request decompression is turned off in the app factory, so a
compressed body arrives as sent (at most ``max_request_bytes``) and is
inflated here with the same bound (``wire/compression.py``).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from tensorserve.errors import InvalidInput
from tensorserve.http.keys import SETTINGS
from tensorserve.wire.compression import decompress


async def read_body(request: web.Request) -> bytes:
    body = await request.read()  # over client_max_size: 413
    limit = request.app[SETTINGS].max_request_bytes
    return decompress(body, request.headers.get("Content-Encoding"), limit)


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
