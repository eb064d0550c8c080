"""The outermost middleware: a request id for every request, the request
metrics of inference calls, and the access log.

    observe_middleware          X-Request-ID in (or a new id) and out on every
      └─ error_middleware       response; REQUEST_ID set for the log lines;
           └─ handler           in-flight gauge; outcome, rejection and latency
                                metrics; one access-log line

A caller that disconnects cancels its handler (``handler_cancellation``): the
``CancelledError`` passes here on its way out and is counted as a
``disconnect``, then re-raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tensorserve.http.keys import (
    LOG_LIMIT,
    METRICS,
    REGISTRY,
    REQUEST_INFO,
    SETTINGS,
    TRACING,
    RequestInfo,
)
from tensorserve.http.logs import HEADER, REQUEST_ID, request_id_from
from tensorserve.metrics.requests import DISCONNECT, OK, UNKNOWN_MODEL
from tensorserve.tracing import RequestTracer
from tensorserve.tracing.http import outcome_attributes, request_attributes, span_name

access_log = logging.getLogger("tensorserve.access")
log = logging.getLogger("tensorserve.http")

PROBES = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics"})
DISCONNECT_STATUS = 499  # nginx's "client closed request", for the access log only

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _is_infer(request: web.Request) -> bool:
    return request.method == "POST" and request.path.endswith("/infer")


def _model_label(request: web.Request, info: RequestInfo) -> tuple[str, str]:
    """(model, version) labels: the served model's, or the route's name when
    the registry knows it (not ready), else ``_unknown``."""
    if info.model is not None:
        return info.model, info.version
    name = request.match_info.get("model")
    return (name, "") if name in request.app[REGISTRY].entries else (UNKNOWN_MODEL, "")


def _start_span(tracer: RequestTracer, request: web.Request, info: RequestInfo) -> Any:
    """The inference request's span (tensorserve/tracing/), current while it runs."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else None
    return tracer.start_request(
        request.headers, span_name(request, route), request_attributes(request, route, info.request_id)
    )


def _end_span(tracer: RequestTracer, span: Any, info: RequestInfo, status: int, code: str) -> None:
    if info.encode_seconds is not None:
        tracer.stage(span, "encode", info.encode_started, info.encode_seconds)
    attributes = outcome_attributes(status, code, info.model, info.version, info.items)
    tracer.finish_request(span, attributes, failed=status >= 500)


def _finished(
    request: web.Request, info: RequestInfo, status: int, code: str, nbytes: int, started: float,
    span: Any = None,
) -> None:
    """Metrics, the access-log line and the span of one finished (or abandoned) request."""
    seconds = time.perf_counter() - started
    if span is not None:
        _end_span(request.app[TRACING], span, info, status, code)  # type: ignore[arg-type]
    if _is_infer(request):
        model, version = _model_label(request, info)
        metrics = request.app[METRICS].requests
        metrics.observe(model, version, code, status, info.items, seconds)
        if info.encode_seconds is not None:
            metrics.encode.labels(model).observe(info.encode_seconds)
    settings = request.app[SETTINGS]
    if settings.access_log and (settings.log_probes or request.path not in PROBES):
        access_log.info(
            "%s %s %d %.2fms %dB", request.method, request.path, status, 1000 * seconds, nbytes,
            extra={
                "method": request.method, "path": request.path, "status": status,
                "latency_ms": round(1000 * seconds, 3), "bytes": nbytes, "code": code,
                "kserve_id": info.kserve_id, "remote": request.remote,
            },
        )


@web.middleware
async def observe_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    info = RequestInfo(request_id_from(request.headers.get(HEADER)))
    request[REQUEST_INFO] = info
    token = REQUEST_ID.set(info.request_id)
    started = time.perf_counter()
    in_flight = request.app[METRICS].requests.in_flight if _is_infer(request) else None
    tracer = request.app[TRACING]
    span = _start_span(tracer, request, info) if tracer is not None and in_flight is not None else None
    if in_flight is not None:
        in_flight.inc()
    try:
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            allowed, dropped = request.app[LOG_LIMIT].allow(DISCONNECT)
            if allowed:
                more = f" ({dropped} more since the last line)" if dropped else ""
                log.info("%s %s: the client disconnected before the answer%s",
                         request.method, request.path, more)
            _finished(request, info, DISCONNECT_STATUS, DISCONNECT, 0, started, span)
            raise
        except web.HTTPException as exc:  # below 400 (a redirect): passed on by error_middleware
            exc.headers[HEADER] = info.request_id
            _finished(request, info, exc.status, OK, 0, started, span)
            raise
        response.headers[HEADER] = info.request_id
        if span is not None:
            tracer.inject(span, response.headers)  # type: ignore[union-attr]
        nbytes = response.content_length or 0
        _finished(request, info, response.status, info.error_code or OK, nbytes, started, span)
        return response
    finally:
        if in_flight is not None:
            in_flight.dec()
        REQUEST_ID.reset(token)
