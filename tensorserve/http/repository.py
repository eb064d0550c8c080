"""Triton's model repository extension: list, load (or reload) and unload
models of the repository at run time, without restarting the server.

    POST /v2/repository/index                  [{name, version?, state, reason?}]
    POST /v2/repository/models/{model}/load    load, or reload a served model
    POST /v2/repository/models/{model}/unload  queued and in-flight requests finish first

Bodies are optional JSON objects (tritonclient sends ``{}`` or nothing).
Load and unload run only with ``model_control_mode`` explicit (the data
plane's rule, ``dataplane/models.py``); the index is always readable.
"""

from __future__ import annotations

from aiohttp import web

from tensorserve.dataplane import models
from tensorserve.errors import InvalidInput
from tensorserve.http.bodies import read_json_object
from tensorserve.http.keys import PLANE


async def index(request: web.Request) -> web.Response:
    body = await read_json_object(request, "repository index request")
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidInput("'ready' must be a boolean")
    return web.json_response(await models.answer(request.app[PLANE], "repository_index", ready))


async def load(request: web.Request) -> web.Response:
    body = await read_json_object(request, "load request")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    return web.json_response(
        await models.answer(request.app[PLANE], "load", request.match_info["model"], parameters)
    )


async def unload(request: web.Request) -> web.Response:
    body = await read_json_object(request, "unload request")
    if not isinstance(body.get("parameters", {}), dict):
        raise InvalidInput("'parameters' must be a JSON object")
    return web.json_response(
        await models.answer(request.app[PLANE], "unload", request.match_info["model"])
    )
