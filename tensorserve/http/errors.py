"""The one place where tensorserve errors become HTTP statuses.

Error bodies are ``{"error": message, "code": code}`` in the request's
content type (msgpack for the native protocol, JSON otherwise).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from tensorserve import errors
from tensorserve.wire import native

log = logging.getLogger(__name__)

STATUS = {
    errors.InvalidInput.code: 400,
    errors.ModelNotFound.code: 404,
    errors.ModelNotReady.code: 503,
    errors.ServerBusy.code: 503,
    errors.DeadlineExceeded.code: 504,
    errors.ModelFailure.code: 500,
}


def error_response(request: web.Request, status: int, message: str, code: str) -> web.Response:
    headers = {"Retry-After": "1"} if code == errors.ServerBusy.code else None
    if request.content_type == native.CONTENT_TYPE:
        return web.Response(
            status=status,
            body=native.encode_error(message, code),
            content_type=native.CONTENT_TYPE,
            headers=headers,
        )
    return web.Response(
        status=status,
        text=json.dumps({"error": message, "code": code}),
        content_type="application/json",
        headers=headers,
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except errors.TensorServeError as exc:
        return error_response(request, STATUS.get(exc.code, 500), exc.message, exc.code)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and exc.text != exc.reason else exc.reason
        if exc.status == 413:
            message = f"request body too large: {exc.text}"
        return error_response(request, exc.status, message, "http_error")
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}", "internal")
