"""The cheapest gRPC caller we have, for the bench (``bench/grpc_target.py``):
``ModelInfer`` with requests serialised before the clock starts and replies
left as bytes, as ``bench/rawhttp.py`` is for HTTP. It lives here because
only this package imports grpcio (pyproject's import contracts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from grpc import aio

from tensorserve.grpc.errors import CODE_KEY
from tensorserve.grpc.generated import grpc_service_pb2 as pb
from tensorserve.tensors.dtypes import dtype

INFER = "/inference.GRPCInferenceService/ModelInfer"


def infer_request(
    model: str, items: Sequence[Mapping[str, np.ndarray]], dtypes: Mapping[str, str],
    *, batched: bool = True,
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
