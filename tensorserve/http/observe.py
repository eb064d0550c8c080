"""The outermost middleware: a request id for every request, the request
metrics of inference calls, their traces, and the access log.

    observe_middleware          X-Request-ID in (or a new id) and out on every
      └─ error_middleware       response; the id on every log line; in-flight
           └─ handler           gauge; the data plane's outcome, rejection and
                                latency metrics; one access-log line. When
                                tracing is on, an infer request's headers
                                start its span (the data plane's) and its
                                traceparent goes back in a header.

A caller that disconnects cancels its handler (``handler_cancellation``): the
``CancelledError`` passes here on its way out and is counted as a
``disconnect``, then re-raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from tensorserve.dataplane import DataPlane
from tensorserve.dataplane.calls import HTTP
from tensorserve.dataplane.logs import HEADER
from tensorserve.http.keys import PLANE, REQUEST_INFO, RequestInfo
from tensorserve.metrics.requests import DISCONNECT, OK
from tensorserve.tracing.http import HttpOrigin

access_log = logging.getLogger("tensorserve.access")

PROBES = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics"})
DISCONNECT_STATUS = 499  # nginx's "client closed request", for the access log only

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _is_infer(request: web.Request) -> bool:
    return request.method == "POST" and request.path.endswith("/infer")


def _finished(
    plane: DataPlane,
    request: web.Request,
    info: RequestInfo,
    status: int,
    code: str,
    nbytes: int,
    started: float,
) -> None:
    """Metrics and the access-log line of one finished (or abandoned) request."""
    seconds = time.perf_counter() - started
    if _is_infer(request):
        plane.observe_infer(info, request.match_info.get("model"), code, status, seconds)
    settings = plane.settings
    if settings.access_log and (settings.log_probes or request.path not in PROBES):
        access_log.info(
            "%s %s %d %.2fms %dB",
            request.method,
            request.path,
            status,
            1000 * seconds,
            nbytes,
            extra={
                "method": request.method,
                "path": request.path,
                "status": status,
                "latency_ms": round(1000 * seconds, 3),
                "bytes": nbytes,
                "code": code,
                "kserve_id": info.kserve_id,
                "remote": request.remote,
                "protocol": HTTP,
            },
        )


def _origin(request: web.Request) -> HttpOrigin:
    """What a traced request's span says: its route's pattern, not its path."""
    resource = request.match_info.route.resource
    return HttpOrigin(request, resource.canonical if resource is not None else None)


@web.middleware
async def observe_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    plane = request.app[PLANE]
    in_flight = plane.metrics.requests.in_flight if _is_infer(request) else None
    origin = _origin(request) if plane.tracer is not None and in_flight is not None else None
    info, token = plane.begin(HTTP, request.headers.get(HEADER), origin)
    request[REQUEST_INFO] = info
    started = time.perf_counter()
    if in_flight is not None:
        in_flight.inc()
    try:
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            plane.log_disconnect(f"{request.method} {request.path}")
            _finished(plane, request, info, DISCONNECT_STATUS, DISCONNECT, 0, started)
            raise
        except web.HTTPException as exc:  # below 400 (a redirect): passed on by error_middleware
            exc.headers[HEADER] = info.request_id
            _finished(plane, request, info, exc.status, OK, 0, started)
            raise
        response.headers[HEADER] = info.request_id
        if info.span is not None:
            plane.inject_trace(info, response.headers)
        nbytes = response.content_length or 0
        _finished(plane, request, info, response.status, info.error_code or OK, nbytes, started)
        return response
    finally:
        if in_flight is not None:
            in_flight.dec()
        plane.end(token)
