"""``POST /v2/models/{model}[/versions/{version}]/infer``: both protocols on
one route, chosen by Content-Type.

    application/msgpack          the native protocol (wire/native.py)
    anything else, or none       the Open Inference Protocol (wire/oip.py):
                                 JSON, or JSON + binary tensors

decode -> ``ServedModel.infer_many`` -> encode, and nothing else: every codec
decodes into the same ``InferRequest`` and encodes its reply from it
(wire/request.py), so the batcher never sees which protocol an item came in
on, and what a protocol needs to know stays in its codec.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from tensorserve.http.bodies import read_body
from tensorserve.http.keys import REGISTRY, REQUEST_INFO, SETTINGS, RequestInfo
from tensorserve.http.lifecycle import track
from tensorserve.wire import native, oip
from tensorserve.wire.request import Codec, effective_timeout

T = TypeVar("T")

CODECS: dict[str, Codec] = {native.CONTENT_TYPE: native}
DEFAULT_CODEC: Codec = oip  # JSON, JSON + binary, or no Content-Type at all (tritonclient)


async def _maybe_in_thread(costly: bool, fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args) if costly else fn(*args)


async def infer(request: web.Request) -> web.Response:
    with track(request.app):  # in flight, for a shutdown's grace period
        return await _infer(request)


async def _infer(request: web.Request) -> web.Response:
    registry, settings = request.app[REGISTRY], request.app[SETTINGS]
    served = registry.ready_model(request.match_info["model"], request.match_info.get("version"))
    info: RequestInfo = request[REQUEST_INFO]  # for the metrics and log lines (observe.py)
    info.model, info.version = served.name, str(served.version)
    body = await read_body(request)
    codec = CODECS.get(request.content_type, DEFAULT_CODEC)
    config = served.config
    decoded = await _maybe_in_thread(
        codec.decode_is_costly(body),
        codec.decode_request,
        body,
        request.headers,
        config,
        settings.max_items_per_request,
    )
    info.items, info.kserve_id = len(decoded.items), decoded.id
    timeout = effective_timeout(  # the request's, the model's or the server's; at most the max
        decoded.timeout, config.default_timeout_ms, settings.default_timeout_ms,
        settings.max_timeout_ms,
    )
    results = await served.infer_many(
        decoded.items,
        timeout=timeout,
        priority=decoded.parameters.get("priority"),
        parameters=decoded.parameters,  # the model's declared ones reach its forward
    )
    encode_started = time.perf_counter()
    encoded = await _maybe_in_thread(
        codec.encode_is_costly(decoded, results),
        codec.encode_response,
        decoded,
        results,
        served.name,
        str(served.version),
        config,
    )
    info.encode_seconds = time.perf_counter() - encode_started
    return web.Response(
        body=encoded.body, content_type=encoded.content_type, headers=encoded.headers
    )
