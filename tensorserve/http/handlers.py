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
    body = await models.answer(request.app[PLANE], "server_live")
    return web.json_response(body, status=200 if body["live"] else 503)


async def ready(request: web.Request) -> web.Response:
    # 200 while every model meant to serve can run a batch now; else 503
    # naming the models that cannot, and why (or that the server is shutting down).
    body = await models.answer(request.app[PLANE], "server_ready")
    return web.json_response(body, status=200 if body["ready"] else 503)


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"models": await models.answer(request.app[PLANE], "model_index")})


async def metadata(request: web.Request) -> web.Response:
    return web.json_response(await models.answer(request.app[PLANE], "metadata", *_model(request)))


async def model_ready(request: web.Request) -> web.Response:
    body = await models.answer(request.app[PLANE], "model_ready", *_model(request))
    return web.json_response(body, status=200 if body["ready"] else 503)


async def model_config(request: web.Request) -> web.Response:
    return web.json_response(await models.answer(request.app[PLANE], "config", *_model(request)))


async def model_stats(request: web.Request) -> web.Response:
    """tensorserve's ``batching`` object (an ensemble's ``ensemble``) at top
    level, and Triton's ``model_stats`` list (which repeats it) for Triton clients."""
    stat = await models.answer(request.app[PLANE], "model_stats", *_model(request))
    body = {k: stat[k] for k in ("name", "version", "batching", "ensemble") if k in stat}
    return web.json_response({**body, "model_stats": [stat]})


async def all_model_stats(request: web.Request) -> web.Response:
    """Every served model, as Triton's ``GET /v2/models/stats``."""
    return web.json_response(
        {"model_stats": await models.answer(request.app[PLANE], "all_model_stats")}
    )
