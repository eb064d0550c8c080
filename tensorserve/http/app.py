"""The aiohttp application factory. Each start-up step is paired with its
shutdown in ``cleanup_ctx``: models load after the socket is bound (so
liveness answers while they load) and are drained and closed on exit."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from tensorserve.http import handlers, infer, repository
from tensorserve.http.errors import error_middleware
from tensorserve.http.keys import LOG_LIMIT, METRICS, REGISTRY, SETTINGS, TRACING
from tensorserve.http.logs import RateLimit, install_request_ids
from tensorserve.http.observe import observe_middleware
from tensorserve.metrics import CONTENT_TYPE, Metrics
from tensorserve.serving.registry import ModelRegistry
from tensorserve.settings import Settings
from tensorserve.tracing import configure as configure_tracing

log = logging.getLogger(__name__)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].exposition(), headers={"Content-Type": CONTENT_TYPE})


def _routes(app: web.Application) -> None:
    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    r = app.router
    r.add_get("/v2", handlers.server_metadata)
    r.add_get("/v2/health/live", handlers.live)
    r.add_get("/v2/health/ready", handlers.ready)
    r.add_get("/v2/models", handlers.list_models)
    r.add_get("/v2/models/stats", handlers.all_model_stats)  # before /v2/models/{model}
    r.add_post("/v2/repository/index", repository.index)
    r.add_post("/v2/repository/models/{model}/load", repository.load)
    r.add_post("/v2/repository/models/{model}/unload", repository.unload)
    r.add_get("/metrics", _metrics)
    for base in (model, versioned):
        r.add_get(base, handlers.metadata)
        r.add_get(base + "/ready", handlers.model_ready)
        r.add_get(base + "/config", handlers.model_config)
        r.add_get(base + "/stats", handlers.model_stats)
        r.add_post(base + "/infer", infer.infer)


def create_app(settings: Settings | None = None, *, wait_for_models: bool = False) -> web.Application:
    """Build the server. With ``wait_for_models`` start-up returns only once
    every model has loaded (tests use this); otherwise loading runs in the
    background and ``/v2/health/ready`` tells when it is done."""
    settings = settings or Settings()
    install_request_ids()  # every log record carries the request id (http/logs.py)
    app = web.Application(
        client_max_size=settings.max_request_bytes,
        # observe (request id, metrics, access log) sees what error_middleware answered.
        middlewares=[observe_middleware, error_middleware],
        # Bodies are decompressed by http/bodies.py, bounded by max_request_bytes.
        handler_args={"auto_decompress": False},
    )
    tracer = configure_tracing(settings)  # None unless an OTLP endpoint is set
    registry = ModelRegistry(
        settings.model_repository,
        settings.model_overrides(),
        intra_op_threads=settings.intra_op_threads,
        batch_tracer=tracer.batch_tracer if tracer is not None else None,
    )
    app[SETTINGS] = settings
    app[REGISTRY] = registry
    app[METRICS] = Metrics(registry)
    app[LOG_LIMIT] = RateLimit()
    app[TRACING] = tracer
    _routes(app)

    async def models(app: web.Application) -> AsyncIterator[None]:
        loading = asyncio.create_task(registry.load_all())
        if wait_for_models:
            await loading
        yield
        if not loading.done():
            loading.cancel()
        await asyncio.gather(loading, return_exceptions=True)
        await registry.close()
        if tracer is not None:  # the last batches' spans are exported before exit
            await asyncio.to_thread(tracer.shutdown)

    app.cleanup_ctx.append(models)
    return app
