"""Typed application state (aiohttp ``AppKey``s), and what a request carries
for the observing middleware (``REQUEST_INFO``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tensorserve.http.logs import RateLimit
from tensorserve.metrics import Metrics
from tensorserve.serving.registry import ModelRegistry
from tensorserve.settings import Settings
from tensorserve.tracing import RequestTracer

SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", ModelRegistry)
METRICS = web.AppKey("metrics", Metrics)
# Lines a client can cause (4xx, rejections, disconnects): per app, per code.
LOG_LIMIT = web.AppKey("log_limit", RateLimit)
# None unless tracing is configured (tensorserve/tracing/).
TRACING: web.AppKey[RequestTracer | None] = web.AppKey("tracing")


@dataclass(slots=True)
class RequestInfo:
    """What the log lines and metrics of one request need, filled in as it
    goes: the id by the middleware, the model and items by the handler,
    the error code by the error middleware."""

    request_id: str
    model: str | None = None  # the served model's name, once the handler found it
    version: str = ""
    items: int = 0
    kserve_id: str | None = None  # the OIP body's "id", when given
    error_code: str | None = None
    encode_seconds: float | None = None
    encode_started: float = 0.0  # perf_counter(), for the encode span


# web.RequestKey since aiohttp 3.12 (a string key there warns); a string before.
REQUEST_INFO: Any = (
    web.RequestKey("request_info", RequestInfo)
    if hasattr(web, "RequestKey")
    else "tensorserve.request_info"
)
