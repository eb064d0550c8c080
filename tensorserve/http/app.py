"""The aiohttp application factory. Each start-up step is paired with its
shutdown in ``cleanup_ctx``: models load after the socket is bound (so
liveness answers while they load) and are drained and closed on exit."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from tensorserve.dataplane import DataPlane, models
from tensorserve.dataplane.logs import install_request_ids
from tensorserve.http import handlers, infer, repository
from tensorserve.http.access import restricted_api_middleware
from tensorserve.http.errors import Handler, error_middleware
from tensorserve.http.keys import METRICS, PLANE, REGISTRY, SETTINGS
from tensorserve.http.observe import observe_middleware
from tensorserve.metrics import CONTENT_TYPE
from tensorserve.settings import Settings

log = logging.getLogger(__name__)


async def _metrics(request: web.Request) -> web.Response:
    body = await models.answer(request.app[PLANE], "metrics")  # the whole server's
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _routes() -> list[tuple[str, str, Handler, str | None]]:
    """Every endpoint: (method, path, handler, the API it belongs to, for
    ``restricted_api``; None: never restricted). The APIs are Triton's."""
    routes: list[tuple[str, str, Handler, str | None]] = [
        ("GET", "/v2", handlers.server_metadata, "metadata"),
        ("GET", "/v2/health/live", handlers.live, "health"),
        ("GET", "/v2/health/ready", handlers.ready, "health"),
        ("GET", "/v2/models", handlers.list_models, "metadata"),
        # Before /v2/models/{model}, which would match it too.
        ("GET", "/v2/models/stats", handlers.all_model_stats, "statistics"),
        ("POST", "/v2/repository/index", repository.index, "model-repository"),
        ("POST", "/v2/repository/models/{model}/load", repository.load, "model-repository"),
        ("POST", "/v2/repository/models/{model}/unload", repository.unload, "model-repository"),
        # Scraped by Prometheus, which Triton serves on a port of its own: keep
        # it from untrusted callers with the network, not a header.
        ("GET", "/metrics", _metrics, None),
    ]
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            ("GET", base, handlers.metadata, "metadata"),
            ("GET", base + "/ready", handlers.model_ready, "health"),
            ("GET", base + "/config", handlers.model_config, "model-config"),
            ("GET", base + "/stats", handlers.model_stats, "statistics"),
            ("POST", base + "/infer", infer.infer, "inference"),
        ]
    return routes


ROUTES = _routes()
# Each route's path pattern -> its API (a restricted API's middleware reads it).
API_OF_PATH = {path: api for _, path, _, api in ROUTES if api is not None}


# What ``create_app`` builds, named for the modules outside ``http/`` that
# hold one (a front-end process): only this package imports aiohttp.
App = web.Application


def create_app(
    settings: Settings | None = None,
    *,
    wait_for_models: bool = False,
    plane: DataPlane | None = None,
    lifespan: Callable[[], AsyncIterator[None]] | None = None,
) -> App:
    """Build the HTTP front end and its data plane (``app[PLANE]``), whose
    models load and close with the app. With ``wait_for_models`` start-up returns only once
    every model has loaded (tests use this); otherwise loading runs in the
    background and ``/v2/health/ready`` tells when it is done. A front-end
    process (``--frontends N``) gives its own ``plane``, whose models live
    in the scheduler process: nothing loads here; and its ``lifespan``, an
    async generator run as the app starts (up to its ``yield``) and after
    every request has been answered (the rest)."""
    settings = settings or Settings()
    install_request_ids()  # every log record carries the request id (dataplane/logs.py)
    # observe (request id, metrics, access log) sees what error_middleware answered;
    # error_middleware answers a restricted API's refusal.
    middlewares: list[Middleware] = [observe_middleware, error_middleware]
    restrictions = settings.restrictions()
    if restrictions:
        middlewares.append(restricted_api_middleware(restrictions, API_OF_PATH))
    app = web.Application(
        client_max_size=settings.max_request_bytes,
        middlewares=middlewares,
        # Bodies are decompressed by http/bodies.py, bounded by max_request_bytes.
        handler_args={"auto_decompress": False},
    )
    app[SETTINGS] = settings
    if plane is None:
        # Here, not at the top: a front-end process's app (``plane`` given)
        # runs no model and never imports the registry, the runtime or torch.
        from tensorserve.dataplane.assembly import build_plane, models_served

        plane, loop_lag = build_plane(settings)
        app[REGISTRY], app[METRICS] = plane.registry, plane.local_metrics

        async def models(app: web.Application) -> AsyncIterator[None]:
            assert plane is not None
            async with models_served(plane, loop_lag, wait_for_models):
                yield

        app.cleanup_ctx.append(models)
    if lifespan is not None:
        app.cleanup_ctx.append(lambda _: lifespan())
    app[PLANE] = plane  # what the gRPC front end, when there is one, shares (http/server.py)
    for method, path, handler, _ in ROUTES:
        if method == "GET":
            app.router.add_get(path, handler)  # HEAD too: some probes send it
        else:
            app.router.add_route(method, path, handler)
    return app
