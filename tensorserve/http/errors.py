"""The one place where tensorserve errors become HTTP statuses.

Error bodies are ``{"error": message, "code": code, "request_id": id}`` in
the request's content type (msgpack for the native protocol, JSON otherwise);
every response also carries the id as X-Request-ID.

Every error is logged through the data plane (``DataPlane.log_failure``),
with its request id: a 5xx that is the server's or the model's fault at
ERROR with its traceback; a 4xx or a rejection (queue full, deadline, not
ready) at WARNING, rate-limited per code so a flood of bad requests cannot
flood the log.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable

from aiohttp import web

from tensorserve import errors
from tensorserve.dataplane.plane import is_server_fault
from tensorserve.http.keys import PLANE, REQUEST_INFO, RequestInfo
from tensorserve.wire import native

# Error code -> HTTP status, from the one table (errors.CODES: each class's
# http_status); tests/test_error_codes.py holds a code retried later to 503.
STATUS = {code: cls.http_status for code, cls in errors.CODES.items()}


def error_response(
    request: web.Request, status: int, message: str, code: str, retry_after: float | None = None
) -> web.Response:
    info: RequestInfo | None = request.get(REQUEST_INFO)
    if info is not None:
        info.error_code = code
    # Overload is a 503 (what load balancers retry) with the batcher's estimate
    # of when there is room, in whole seconds (docs/reliability.md).
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after is not None else None
    if request.content_type == native.CONTENT_TYPE:
        return web.Response(
            status=status,
            body=native.encode_error(message, code, info.request_id if info is not None else None),
            content_type=native.CONTENT_TYPE,
            headers=headers,
        )
    return web.Response(
        status=status,
        text=json.dumps(
            {"error": message, "code": code}
            | ({"request_id": info.request_id} if info is not None else {})
        ),
        content_type="application/json",
        headers=headers,
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def log_error(
    request: web.Request, status: int, code: str, message: str, exc: BaseException
) -> None:
    """One line per failed request (see the module's docstring)."""
    request.app[PLANE].log_failure(
        request.get(REQUEST_INFO),
        f"{request.method} {request.path}",
        status,
        code,
        message,
        exc,
        is_server_fault(code, status),
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except errors.TensorServeError as exc:
        status = STATUS.get(exc.code, 500)  # a code of its own (a model's subclass): 500
        log_error(request, status, exc.code, exc.message, exc)
        retry_after = exc.retry_after if isinstance(exc, errors.ServerBusy) else None
        return error_response(request, status, exc.message, exc.code, retry_after)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and exc.text != exc.reason else exc.reason
        if exc.status == 413:
            message = f"request body too large: {exc.text}"
        log_error(request, exc.status, "http_error", message, exc)
        return error_response(request, exc.status, message, "http_error")
    except Exception as exc:  # noqa: BLE001 - any bug: a 500 that says what, not a reset
        message = f"internal error: {type(exc).__name__}: {exc}"
        log_error(request, 500, "internal", message, exc)
        return error_response(request, 500, message, "internal")
