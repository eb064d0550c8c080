"""Thin HTTP handlers: parse the route, ask the data plane
(``dataplane/models.py``), answer JSON.

Inference lives in ``infer.py``, the repository extension in ``repository.py``.
"""

from __future__ import annotations

from aiohttp import web

from tensorserve.dataplane import models
from tensorserve.http.keys import PLANE


def _model(request: web.Request) -> tuple[str, str | None]:
    return request.match_info["model"], request.match_info.get("version")


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response(models.server_metadata())


async def live(request: web.Request) -> web.Response:
    body = models.server_live(request.app[PLANE])
    return web.json_response(body, status=200 if body["live"] else 503)


async def ready(request: web.Request) -> web.Response:
    # 200 while every model meant to serve can run a batch now; else 503
    # naming the models that cannot, and why (or that the server is shutting down).
    body = models.server_ready(request.app[PLANE])
    return web.json_response(body, status=200 if body["ready"] else 503)


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"models": request.app[PLANE].registry.index()})


async def metadata(request: web.Request) -> web.Response:
    return web.json_response(models.metadata(request.app[PLANE], *_model(request)))


async def model_ready(request: web.Request) -> web.Response:
    body = models.model_ready(request.app[PLANE], *_model(request))
    return web.json_response(body, status=200 if body["ready"] else 503)


async def model_config(request: web.Request) -> web.Response:
    return web.json_response(models.config(request.app[PLANE], *_model(request)))


async def model_stats(request: web.Request) -> web.Response:
    """tensorserve's ``batching`` object (an ensemble's ``ensemble``) at top
    level, and Triton's ``model_stats`` list (which repeats it) for Triton clients."""
    stat = models.model_stats(request.app[PLANE], *_model(request))
    body = {k: stat[k] for k in ("name", "version", "batching", "ensemble") if k in stat}
    return web.json_response({**body, "model_stats": [stat]})


async def all_model_stats(request: web.Request) -> web.Response:
    """Every served model, as Triton's ``GET /v2/models/stats``."""
    return web.json_response({"model_stats": models.all_model_stats(request.app[PLANE])})
