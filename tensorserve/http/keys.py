"""Typed application state (aiohttp ``AppKey``s), and the data plane's
``Call`` of each request (``REQUEST_INFO``), set by the observing
middleware."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from tensorserve.dataplane import Call, DataPlane
from tensorserve.metrics import Metrics
from tensorserve.settings import Settings

if TYPE_CHECKING:  # a front-end process has no registry (nor torch)
    from tensorserve.serving.registry import ModelRegistry

# The data plane owns the registry, the settings and the metrics; the other
# keys name the same objects, for handlers and tests that need only one.
PLANE = web.AppKey("plane", DataPlane)
SETTINGS = web.AppKey("settings", Settings)
REGISTRY: web.AppKey[ModelRegistry] = web.AppKey("registry")
METRICS = web.AppKey("metrics", Metrics)

RequestInfo = Call  # what the handlers and middlewares know a request as

# web.RequestKey since aiohttp 3.12 (a string key there warns); a string before.
REQUEST_INFO: Any = (
    web.RequestKey("request_info", Call)
    if hasattr(web, "RequestKey")
    else "tensorserve.request_info"
)
