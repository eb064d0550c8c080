"""Thin HTTP handlers: parse the route, call the registry / model, encode.

Inference lives in ``infer.py``, the repository extension in ``repository.py``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tensorserve import __version__
from tensorserve.batching.policy import budget_report
from tensorserve.errors import ModelNotReady
from tensorserve.http.keys import REGISTRY
from tensorserve.http.lifecycle import SHUTTING_DOWN, draining
from tensorserve.serving import ServedModel
from tensorserve.serving.registry import ModelState
from tensorserve.wire import triton
from tensorserve.wire.metadata import model_metadata

# What Triton clients may rely on (KServe v2 server metadata "extensions").
EXTENSIONS = [
    "binary_tensor_data",
    "model_configuration",
    "model_repository",
    "statistics",
    "tensorserve_padding",
]


def _model(request: web.Request) -> tuple[str, str | None]:
    return request.match_info["model"], request.match_info.get("version")


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "tensorserve", "version": __version__, "extensions": EXTENSIONS})


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    if draining(request.app):  # shutting down: load balancers, stop sending
        return web.json_response({"ready": False, "reason": SHUTTING_DOWN}, status=503)
    # 200 while every model meant to serve can run a batch now; else 503
    # naming the models that cannot, and why.
    problems = request.app[REGISTRY].not_ready()
    if not problems:
        return web.json_response({"ready": True})
    return web.json_response({"ready": False, "not_ready": problems}, status=503)


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"models": request.app[REGISTRY].index()})


async def metadata(request: web.Request) -> web.Response:
    entry = request.app[REGISTRY].get(*_model(request))
    return web.json_response(
        model_metadata(entry.name, entry.version, entry.state.value, entry.reason, entry.config)
    )


async def model_ready(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    entry = registry.get(*_model(request))
    why = SHUTTING_DOWN if draining(request.app) else registry.health(entry)
    body = {"name": entry.name, "ready": why is None, "state": entry.state.value}
    if why is not None:
        body["reason"] = entry.reason or why
    return web.json_response(body, status=200 if why is None else 503)


async def model_config(request: web.Request) -> web.Response:
    entry = request.app[REGISTRY].get(*_model(request))
    if entry.config is None:
        raise ModelNotReady(f"model {entry.name!r} has no valid config: {entry.reason}")
    return web.json_response(triton.model_config(entry.name, entry.config))


def _stat(served: ServedModel) -> dict[str, Any]:
    snapshot = served.stats.snapshot(served.batcher.queue_depth)
    snapshot["budget"] = budget_report(served.batcher.options.policy)
    return triton.model_stat(served.name, str(served.version), snapshot)


async def model_stats(request: web.Request) -> web.Response:
    """tensorserve's ``batching`` object at top level, and Triton's
    ``model_stats`` list (which repeats it) for Triton clients."""
    entry = request.app[REGISTRY].get(*_model(request))
    stat = _stat(request.app[REGISTRY].ready_model(entry.name))
    body = {"name": entry.name, "version": stat["version"], "batching": stat["batching"]}
    return web.json_response({**body, "model_stats": [stat]})


async def all_model_stats(request: web.Request) -> web.Response:
    """Every served model, as Triton's ``GET /v2/models/stats``."""
    entries = sorted(request.app[REGISTRY].entries.values(), key=lambda e: e.name)
    stats = [_stat(e.served) for e in entries if e.state is ModelState.READY and e.served]
    return web.json_response({"model_stats": stats})
