"""Thin HTTP handlers: parse the route, call the registry / model, encode."""

from __future__ import annotations

import time

from aiohttp import web

from tensorserve import __version__
from tensorserve.errors import InvalidInput, ModelNotReady
from tensorserve.http.keys import METRICS, REGISTRY, SETTINGS
from tensorserve.repository.registry import ModelState
from tensorserve.wire import native
from tensorserve.wire.metadata import model_metadata

EXTENSIONS = ["model_repository", "statistics", "binary_tensor_data", "tensorserve_padding"]


def _model(request: web.Request) -> tuple[str, str | None]:
    return request.match_info["model"], request.match_info.get("version")


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "tensorserve", "version": __version__, "extensions": EXTENSIONS})


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    is_ready = registry.all_ready
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"models": request.app[REGISTRY].index()})


async def metadata(request: web.Request) -> web.Response:
    entry = request.app[REGISTRY].get(*_model(request))
    return web.json_response(model_metadata(entry))


async def model_ready(request: web.Request) -> web.Response:
    entry = request.app[REGISTRY].get(*_model(request))
    is_ready = entry.state is ModelState.READY
    body = {"name": entry.name, "ready": is_ready, "state": entry.state.value}
    if entry.reason:
        body["reason"] = entry.reason
    return web.json_response(body, status=200 if is_ready else 503)


async def model_config(request: web.Request) -> web.Response:
    entry = request.app[REGISTRY].get(*_model(request))
    if entry.config is None:
        raise ModelNotReady(f"model {entry.name!r} has no valid config: {entry.reason}")
    return web.json_response({"name": entry.name, **entry.config.model_dump(mode="json")})


async def model_stats(request: web.Request) -> web.Response:
    entry = request.app[REGISTRY].get(*_model(request))
    served = request.app[REGISTRY].ready(entry.name)
    return web.json_response(
        {
            "name": entry.name,
            "version": str(entry.version),
            "batching": served.stats.snapshot(served.batcher.queue_depth),
        }
    )


async def infer(request: web.Request) -> web.Response:
    name, version = _model(request)
    served = request.app[REGISTRY].ready(name, version)
    settings = request.app[SETTINGS]
    if request.content_type != native.CONTENT_TYPE:
        raise InvalidInput(
            f"unsupported Content-Type {request.content_type!r}; send {native.CONTENT_TYPE}"
        )
    started = time.perf_counter()
    message = native.decode_request(await request.read(), settings.max_items_per_request)
    timeout = message.parameters.get("timeout_ms")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise InvalidInput("parameters.timeout_ms must be a positive number")
    results = await served.infer_many(message.items, timeout=timeout and timeout / 1000)
    body = native.encode_response(
        served.name,
        str(served.version),
        message.id,
        results,
        {spec.name: spec.dtype for spec in served.config.output},
    )
    request.app[METRICS].observe_request(served.name, time.perf_counter() - started)
    return web.Response(body=body, content_type=native.CONTENT_TYPE)
