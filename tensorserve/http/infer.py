"""``POST /v2/models/{model}[/versions/{version}]/infer``: both protocols on
one route, chosen by Content-Type.

    application/msgpack          the native protocol (wire/native.py)
    anything else, or none       the Open Inference Protocol (wire/oip.py):
                                 JSON, or JSON + binary tensors

The handler reads the route and hands the data plane an ``HttpCall`` (the
body, its codec); ``DataPlane.infer`` does decode -> ``infer_many`` ->
encode. Every codec decodes into the same ``InferRequest`` and encodes its
reply from it (wire/request.py), so the batcher never sees which protocol
(or transport) an item came in on.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from tensorserve.http.bodies import read_body
from tensorserve.http.keys import PLANE, REQUEST_INFO
from tensorserve.repository.config import ModelConfig
from tensorserve.wire import native, oip
from tensorserve.wire.request import Codec, EncodedResponse, InferRequest, Results

CODECS: dict[str, Codec] = {native.CONTENT_TYPE: native}
DEFAULT_CODEC: Codec = oip  # JSON, JSON + binary, or no Content-Type at all (tritonclient)


class HttpCall:
    """An infer request's body and codec (the data plane's ``WireCall``)."""

    __slots__ = ("_request", "body", "codec")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.codec = CODECS.get(request.content_type, DEFAULT_CODEC)
        self.body = b""

    async def receive(self) -> None:
        self.body = await read_body(self._request)  # size- and time-bounded, decompressed

    @property
    def headers(self) -> Mapping[str, str]:
        return self._request.headers

    def decode(self, config: ModelConfig, max_items: int) -> InferRequest:
        return self.codec.decode_request(self.body, self.headers, config, max_items)

    def decode_is_costly(self) -> bool:
        return self.codec.decode_is_costly(self.body)

    def encode(
        self, request: InferRequest, results: Results, name: str, version: str, config: ModelConfig
    ) -> EncodedResponse:
        return self.codec.encode_response(request, results, name, version, config)

    def encode_is_costly(self, request: InferRequest, results: Results) -> bool:
        return self.codec.encode_is_costly(request, results)


async def infer(request: web.Request) -> web.Response:
    encoded = await request.app[PLANE].infer(
        request[REQUEST_INFO],
        request.match_info["model"],
        request.match_info.get("version"),
        HttpCall(request),
    )
    return web.Response(
        body=encoded.body, content_type=encoded.content_type, headers=encoded.headers
    )
