"""Triton's model repository extension: list, load (or reload) and unload
models of the repository at run time, without restarting the server.

    POST /v2/repository/index                  [{name, version?, state, reason?}]
    POST /v2/repository/models/{model}/load    load, or reload a served model
    POST /v2/repository/models/{model}/unload  queued and in-flight requests finish first

Bodies are optional JSON objects (tritonclient sends ``{}`` or nothing).
Load and unload run only with ``model_control_mode`` explicit (http/access.py);
the index is always readable.
"""

from __future__ import annotations

from aiohttp import web

from tensorserve.errors import InvalidInput
from tensorserve.http.access import require_model_control
from tensorserve.http.bodies import read_json_object
from tensorserve.http.keys import REGISTRY, SETTINGS
from tensorserve.serving.registry import ModelState
from tensorserve.wire import triton


async def index(request: web.Request) -> web.Response:
    body = await read_json_object(request, "repository index request")
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidInput("'ready' must be a boolean")
    return web.json_response(triton.repository_index(request.app[REGISTRY].index(), ready))


async def load(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    require_model_control(request.app[SETTINGS], "load", name)
    body = await read_json_object(request, "load request")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    overrides = sorted(k for k in parameters if k == "config" or k.startswith("file:"))
    if overrides:
        raise InvalidInput(
            f"load parameters {', '.join(overrides)} are not supported: tensorserve loads "
            f"models from the repository only"
        )
    registry = request.app[REGISTRY]
    before = registry.entries.get(name)
    previous = before.served if before is not None else None
    entry = await registry.load(name)  # unknown name: ModelNotFound (404)
    if entry.state is ModelState.FAILED:
        raise InvalidInput(f"failed to load model {name!r}: {entry.reason}")
    if previous is not None and entry.served is previous:
        # The registry keeps serving the old version when a reload fails.
        raise InvalidInput(
            f"failed to reload model {name!r}; still serving version {entry.version} "
            f"(the server log has the reason)"
        )
    return web.json_response(entry.describe())


async def unload(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    require_model_control(request.app[SETTINGS], "unload", name)
    body = await read_json_object(request, "unload request")
    if not isinstance(body.get("parameters", {}), dict):
        raise InvalidInput("'parameters' must be a JSON object")
    registry = request.app[REGISTRY]
    await registry.unload(name)  # returns once its queued requests have finished
    return web.json_response(registry.get(name).describe())
