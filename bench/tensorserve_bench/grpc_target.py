"""``GrpcTarget``: a running tensorserve spoken to over KServe v2 gRPC
(``ModelInfer``, raw tensor bytes), beside ``HttpTarget``. Its model's
inputs and batching counters are read over HTTP, as ``HttpTarget`` reads
them; only the measured ``send`` goes over gRPC, through the cheapest caller
we have: ``RawInferChannel``, with requests serialised before the clock
starts and replies left as bytes (as ``rawhttp.py`` is for HTTP).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from grpc import aio

from tensorserve.grpc.errors import CODE_KEY
from tensorserve.grpc.generated import grpc_service_pb2 as pb
from tensorserve.tensors.dtypes import dtype
from tensorserve_bench.items import Item
from tensorserve_bench.targets import REFUSED_CODES, HttpTarget, RequestFailed

INFER = "/inference.GRPCInferenceService/ModelInfer"


def infer_request(
    model: str,
    items: Sequence[Mapping[str, np.ndarray]],
    dtypes: Mapping[str, str],
    *,
    batched: bool = True,
) -> bytes:
    """One serialised ``ModelInferRequest`` of ``items`` (which share their
    shapes), each input cast to its declared dtype, in ``raw_input_contents``."""
    request = pb.ModelInferRequest(model_name=model)
    for name in items[0]:
        dt = dtype(dtypes[name])
        arrays = [np.ascontiguousarray(item[name], dt.numpy) for item in items]
        shape = [len(arrays), *arrays[0].shape] if batched else list(arrays[0].shape)
        request.inputs.add(name=name, datatype=dt.v2, shape=shape)
        request.raw_input_contents.append(b"".join(a.tobytes() for a in arrays))
    return request.SerializeToString()


class RawInferChannel:
    """One channel to ``address`` (``host:port``); ``infer`` sends bytes."""

    def __init__(self, address: str) -> None:
        self._channel = aio.insecure_channel(
            address, options=[("grpc.max_receive_message_length", -1)]
        )
        # No serialisers: the request is bytes already, the reply stays bytes.
        self._infer = self._channel.unary_unary(INFER)

    async def infer(self, payload: bytes, timeout: float | None) -> str | None:
        """None on success, else the status and the server's error code."""
        try:
            await self._infer(payload, timeout=timeout)
        except aio.AioRpcError as exc:
            trailing = dict(exc.trailing_metadata() or ())
            return f"gRPC {exc.code().name} {trailing.get(CODE_KEY, '')}: {exc.details()}"
        return None

    async def close(self) -> None:
        await self._channel.close()


class GrpcTarget(HttpTarget):
    kind = "grpc"

    def __init__(self, url: str, grpc_address: str, model: str, *, timeout: float = 60.0) -> None:
        super().__init__(url, model, timeout=timeout, protocol="msgpack")
        self.protocol = "grpc"
        self.grpc_address = grpc_address
        self._channel: Any = None

    async def open(self) -> None:
        await super().open()
        self._channel = RawInferChannel(self.grpc_address)

    def encode(self, items: Sequence[Item]) -> bytes:
        dtypes = {s.name: s.dtype for s in self.specs}
        return infer_request(self.model, items, dtypes, batched=self.batched)

    async def send(self, payload: bytes) -> None:
        assert self._channel is not None, "open() first"
        failure = await self._channel.infer(payload, self.timeout)
        if failure is not None:
            # "gRPC UNAVAILABLE <tensorserve code>: <details>" (RawInferChannel.infer)
            code = failure.split(":", 1)[0].split()[-1]
            raise RequestFailed(
                failure, refused=failure.startswith("gRPC UNAVAILABLE ") and code in REFUSED_CODES
            )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "grpc_address": self.grpc_address}

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        await super().aclose()
