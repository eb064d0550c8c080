"""``GrpcTarget``: a running tensorserve spoken to over KServe v2 gRPC
(``ModelInfer``, raw tensor bytes), beside ``HttpTarget``. Its model's
inputs and batching counters are read over HTTP, as ``HttpTarget`` reads
them; only the measured ``send`` goes over gRPC (``grpc/loadclient.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorserve.bench.items import Item
from tensorserve.bench.targets import REFUSED_CODES, HttpTarget, RequestFailed


class GrpcTarget(HttpTarget):
    kind = "grpc"

    def __init__(self, url: str, grpc_address: str, model: str, *, timeout: float = 60.0) -> None:
        super().__init__(url, model, timeout=timeout, protocol="msgpack")
        self.protocol = "grpc"
        self.grpc_address = grpc_address
        self._channel: Any = None

    async def open(self) -> None:
        from tensorserve.grpc.loadclient import RawInferChannel  # grpcio: only when used

        await super().open()
        self._channel = RawInferChannel(self.grpc_address)

    def encode(self, items: Sequence[Item]) -> bytes:
        from tensorserve.grpc.loadclient import infer_request

        dtypes = {s.name: s.dtype for s in self.specs}
        return infer_request(self.model, items, dtypes, batched=self.batched)

    async def send(self, payload: bytes) -> None:
        assert self._channel is not None, "open() first"
        failure = await self._channel.infer(payload, self.timeout)
        if failure is not None:
            # "gRPC UNAVAILABLE <tensorserve code>: <details>" (loadclient.RawInferChannel)
            code = failure.split(":", 1)[0].split()[-1]
            raise RequestFailed(failure, refused=failure.startswith("gRPC UNAVAILABLE ")
                                and code in REFUSED_CODES)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "grpc_address": self.grpc_address}

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        await super().aclose()
