"""``POST /v2/models/{model}[/versions/{version}]/infer``: both protocols on
one route, chosen by Content-Type.

    application/msgpack          the native protocol (wire/native.py)
    anything else, or none       the Open Inference Protocol (wire/oip.py):
                                 JSON, or JSON + binary tensors

Each path is decode -> ``ServedModel.infer_many`` -> encode; the batcher
never sees which protocol an item came in on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from tensorserve.errors import InvalidInput
from tensorserve.http.bodies import read_body
from tensorserve.http.keys import METRICS, REGISTRY, SETTINGS
from tensorserve.serving import ServedModel
from tensorserve.wire import native, oip

T = TypeVar("T")

# Above this much JSON to parse or write, the codec runs in a worker thread so
# one large JSON request does not stall every other connection.
_OFFLOAD_BYTES = 256 << 10
_OFFLOAD_ELEMENTS = 32 << 10


async def _maybe_in_thread(heavy: bool, fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args) if heavy else fn(*args)


async def infer(request: web.Request) -> web.Response:
    registry, settings = request.app[REGISTRY], request.app[SETTINGS]
    served = registry.ready(request.match_info["model"], request.match_info.get("version"))
    started = time.perf_counter()
    body = await read_body(request)
    if request.content_type == native.CONTENT_TYPE:
        response = await _infer_native(served, body, settings.max_items_per_request)
    else:
        header_length = request.headers.get(oip.HEADER_LENGTH)
        response = await _infer_oip(served, body, header_length, settings.max_items_per_request)
    request.app[METRICS].observe_request(served.name, time.perf_counter() - started)
    return response


async def _infer_native(served: ServedModel, body: bytes, max_items: int) -> web.Response:
    message = native.decode_request(body, max_items)
    timeout = message.parameters.get("timeout_ms")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise InvalidInput("parameters.timeout_ms must be a positive number")
    results = await served.infer_many(message.items, timeout=timeout and timeout / 1000)
    encoded = native.encode_response(
        served.name,
        str(served.version),
        message.id,
        results,
        {spec.name: spec.dtype for spec in served.config.output},
    )
    return web.Response(body=encoded, content_type=native.CONTENT_TYPE)


async def _infer_oip(
    served: ServedModel, body: bytes, header_length: str | None, max_items: int
) -> web.Response:
    config = served.config
    message = await _maybe_in_thread(
        len(body) > _OFFLOAD_BYTES, oip.decode_request, body, header_length, config, max_items
    )
    # parameters.priority is accepted but not acted on: the batcher serves in
    # its policy's order and has no priority levels.
    results = await served.infer_many(message.items, timeout=message.timeout)
    dtypes = {spec.name: spec.dt for spec in config.output}
    outputs = [
        (wanted, dtypes[wanted.name], oip.stack_rows(results, wanted.name, config.batching))
        for wanted in message.outputs
    ]
    json_elements = sum(array.size for wanted, _, array in outputs if not wanted.binary)
    chunks, json_length = await _maybe_in_thread(
        json_elements > _OFFLOAD_ELEMENTS,
        oip.encode_response,
        served.name,
        str(served.version),
        message.id,
        outputs,
    )
    if json_length is None:
        return web.Response(body=chunks[0], content_type=oip.JSON_CONTENT_TYPE)
    return web.Response(
        body=b"".join(chunks),
        content_type=oip.BINARY_CONTENT_TYPE,
        headers={oip.HEADER_LENGTH: str(json_length)},
    )
