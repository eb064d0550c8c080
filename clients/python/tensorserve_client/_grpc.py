"""Attempts over KServe v2 gRPC (``Client("grpc://host:8001")``): one
``grpc.aio`` channel (one HTTP/2 connection, calls multiplexed on it) on the
loop the client sends from, the same retry loop as HTTP (``Transport``).

Each call's ``op`` becomes the RPCs it needs; a success comes back as an
``Answer`` whose ``read()`` decodes the replies (on the caller's thread for
the blocking ``Client``), a failure as the error value its status and
``tensorserve-code`` stand for (``_grpc_codec.error_from_status``), with the
server's ``retry-after``. The attempt's timeout is the call's gRPC deadline.
Inference first asks the model's config once per client (is there a batch
dimension, which dtype casts a plain list) and keeps it; ``load`` forgets it.
Only imported for a grpc:// URL: grpcio is an optional extra.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from grpc import aio

from tensorserve_client import _grpc_codec as codec
from tensorserve_client._kserve import grpc_service_pb2 as pb
from tensorserve_client._ops import IndexOp, InferOp, ModelOp, Op, ReadyOp, RepositoryOp
from tensorserve_client._protocol import Answer, Call, Outcome
from tensorserve_client._transport import Transport
from tensorserve_client._version import __version__
from tensorserve_client.errors import TensorServeError

SERVICE = "/inference.GRPCInferenceService/"
# RPC name -> (request, response) message classes: the ones the client uses.
RPCS: dict[str, tuple[Any, Any]] = {
    "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse),
    "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
    "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
    "ModelConfig": (pb.ModelConfigRequest, pb.ModelConfigResponse),
    "ModelStatistics": (pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
    "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
    "RepositoryIndex": (pb.RepositoryIndexRequest, pb.RepositoryIndexResponse),
    "RepositoryModelLoad": (pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse),
    "RepositoryModelUnload": (pb.RepositoryModelUnloadRequest, pb.RepositoryModelUnloadResponse),
}
Read = Callable[[], Any]


class GrpcTransport(Transport):
    """Attempts over gRPC. ``max_connections`` does not apply: one channel
    carries every call concurrently."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.target = urlsplit(self.url).netloc
        # gRPC metadata keys are lower case; the user agent is a channel option.
        self.metadata = tuple(
            (key.lower(), value)
            for key, value in self.headers.items()
            if key.lower() != "user-agent"
        )
        self._channel: aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._stubs: dict[str, aio.UnaryUnaryMultiCallable] = {}
        self._inputs: dict[tuple[str, str | None], codec.ModelInputs] = {}

    def _channel_here(self) -> aio.Channel:
        # A grpc.aio channel belongs to the loop it was made on, as aiohttp's session.
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._channel is None:
            self._channel = aio.insecure_channel(
                self.target,
                options=[
                    ("grpc.max_receive_message_length", -1),  # the server bounds what it sends
                    ("grpc.max_send_message_length", -1),  # and what it takes (RESOURCE_EXHAUSTED)
                    ("grpc.primary_user_agent", f"tensorserve-client/{__version__}"),
                ],
            )
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                "an AsyncClient belongs to the event loop it first ran on; "
                "create one client per event loop (e.g. per asyncio.run)"
            )
        return self._channel

    async def _rpc(self, name: str, request: Any, deadline: float | None) -> Any:
        channel = self._channel_here()
        stub = self._stubs.get(name)
        if stub is None:
            request_cls, response_cls = RPCS[name]
            stub = self._stubs[name] = channel.unary_unary(
                SERVICE + name,
                request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString,
            )
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        return await stub(request, timeout=timeout, metadata=self.metadata)

    async def _send_once(self, call: Call[Any], remaining: float | None, attempts: int) -> Outcome:
        if call.op is None:
            raise TypeError(f"{call.method} {call.path} has no gRPC form")
        timeout = self._attempt_timeout(remaining)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            read = await self._ask(call.op, deadline)
        except aio.AioRpcError as exc:
            return codec.error_from_status(
                exc.code().name,
                exc.details() or "",
                tuple(exc.trailing_metadata() or ()),
                attempts,
                client_deadline=timeout is not None and timeout == self.timeout,
            )
        except TensorServeError as error:  # an item refused before sending (a list's values)
            error.attempts = attempts
            return error
        return Answer(read, attempts)

    async def _ask(self, op: Op, deadline: float | None) -> Read:
        if isinstance(op, InferOp):
            return await self._infer(op, deadline)
        if isinstance(op, ReadyOp):
            if op.model is None:
                server = await self._rpc("ServerReady", pb.ServerReadyRequest(), deadline)
                return lambda: bool(server.ready)
            request = pb.ModelReadyRequest(name=op.model, version=op.version or "")
            model = await self._rpc("ModelReady", request, deadline)
            return lambda: bool(model.ready)
        if isinstance(op, ModelOp):
            if op.what == "metadata":
                request = pb.ModelMetadataRequest(name=op.model, version=op.version or "")
                metadata = await self._rpc("ModelMetadata", request, deadline)
                return lambda: _metadata(metadata)
            stats_request = pb.ModelStatisticsRequest(name=op.model, version=op.version or "")
            stats = await self._rpc("ModelStatistics", stats_request, deadline)
            return lambda: _statistics(stats)
        if isinstance(op, IndexOp):
            index = await self._rpc("RepositoryIndex", pb.RepositoryIndexRequest(), deadline)
            return lambda: _index(index)
        if isinstance(op, RepositoryOp):
            return await self._repository(op, deadline)
        raise TypeError(f"no gRPC form for {op!r}")

    async def _infer(self, op: InferOp, deadline: float | None) -> Read:
        key = (op.model, op.version)
        inputs = self._inputs.get(key)
        if inputs is None:
            request = pb.ModelConfigRequest(name=op.model, version=op.version or "")
            config = await self._rpc("ModelConfig", request, deadline)
            inputs = self._inputs[key] = codec.ModelInputs.from_config(config)
        groups = codec.requests(op, inputs)
        sent = [asyncio.ensure_future(self._rpc("ModelInfer", g.request, deadline)) for g in groups]
        try:
            replies = await asyncio.gather(*sent)
        finally:  # one group failed: the others' answers no longer matter
            for task in sent:
                task.cancel()
        count, batches = len(op.items), inputs.batches
        return lambda: codec.results(count, groups, replies, batches, op.return_torch)

    async def _repository(self, op: RepositoryOp, deadline: float | None) -> Read:
        # HTTP answers with the model's index entry: so does this, from the index.
        if op.action == "load":
            load = pb.RepositoryModelLoadRequest(model_name=op.model)
            await self._rpc("RepositoryModelLoad", load, deadline)
        else:
            unload = pb.RepositoryModelUnloadRequest(model_name=op.model)
            await self._rpc("RepositoryModelUnload", unload, deadline)
        for key in [k for k in self._inputs if k[0] == op.model]:
            del self._inputs[key]  # a reload may change its inputs
        index = await self._rpc("RepositoryIndex", pb.RepositoryIndexRequest(), deadline)
        entries = [entry for entry in _index(index) if entry["name"] == op.model]
        return lambda: entries[0] if entries else {"name": op.model}

    async def aclose(self) -> None:
        if self._channel is not None and asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(
                "close an AsyncClient on the event loop it ran on: its connections live there"
            )
        self._closed = True
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()


# ----------------------------------------------------------------- replies as plain data
def _metadata(reply: pb.ModelMetadataResponse) -> dict[str, Any]:
    """KServe v2 metadata; tensorserve's own fields (state, dtype) are HTTP's only."""

    def tensors(listed: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in listed]

    return {
        "name": reply.name,
        "versions": list(reply.versions),
        "platform": reply.platform,
        "inputs": tensors(reply.inputs),
        "outputs": tensors(reply.outputs),
    }


def _statistics(reply: pb.ModelStatisticsResponse) -> dict[str, Any]:
    """Triton's ``model_stats`` (``inference_stats`` per request, ``batch_stats`` per
    batch size); the ``batching`` block is HTTP's only."""
    entries = []
    for stat in reply.model_stats:
        inference = {
            field.name: {"count": value.count, "ns": value.ns}
            for field, value in stat.inference_stats.ListFields()
        }
        entries.append(
            {
                "name": stat.name,
                "version": stat.version,
                "last_inference": stat.last_inference,
                "inference_count": stat.inference_count,
                "execution_count": stat.execution_count,
                "inference_stats": inference,
                "batch_stats": [
                    {
                        "batch_size": batch.batch_size,
                        **{
                            key: {"count": getattr(batch, key).count, "ns": getattr(batch, key).ns}
                            for key in ("compute_input", "compute_infer", "compute_output")
                        },
                    }
                    for batch in stat.batch_stats
                ],
            }
        )
    return {"model_stats": entries}


def _index(reply: pb.RepositoryIndexResponse) -> list[dict[str, Any]]:
    entries = []
    for model in reply.models:
        entry = {"name": model.name, "state": model.state}
        if model.version:
            entry["version"] = model.version
        if model.reason:
            entry["reason"] = model.reason
        entries.append(entry)
    return entries
