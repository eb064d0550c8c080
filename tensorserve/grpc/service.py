"""The KServe v2 / Triton ``GRPCInferenceService``: thin handlers that ask
the data plane and answer in messages.

Each RPC runs in its own task on the server's event loop (grpc.aio). Every
call gets a request id (the caller's ``x-request-id`` metadata when safe to
echo, else a new one), sent back in the initial metadata and on every log
line. ``ModelInfer`` goes through ``DataPlane.infer`` like an HTTP infer
request, so its items join the same queues and batches; the call's gRPC
deadline bounds its timeout, and a call the client cancels cancels its
task, which withdraws its queued items. Failures end the call with the
status from ``grpc/errors.py``. When tracing is on, a ``ModelInfer`` call's
``traceparent`` metadata starts its span (the data plane's, as for HTTP),
and its own ``traceparent`` goes back in the initial metadata. Shared
memory, Triton's trace settings and log settings are not served: their
RPCs answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from tensorserve.dataplane import DataPlane, models
from tensorserve.dataplane.calls import GRPC, Call
from tensorserve.dataplane.plane import is_server_fault
from tensorserve.errors import InvalidInput
from tensorserve.grpc import codec, messages, scan
from tensorserve.grpc.errors import Failure
from tensorserve.grpc.generated import grpc_service_pb2 as pb
from tensorserve.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from tensorserve.metrics.requests import DISCONNECT, OK
from tensorserve.repository.config import ModelConfig
from tensorserve.tracing.grpc import GrpcOrigin
from tensorserve.wire.request import InferRequest, Results

access_log = logging.getLogger("tensorserve.access")

R = TypeVar("R")
Handler = Callable[[Any, Any, aio.ServicerContext, Call], Awaitable[R]]
INFER = "ModelInfer"
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


class RawInferRequest:
    """A ``ModelInferRequest`` as grpc received it, not parsed yet: its
    fields are counted (``grpc/scan.py``) against the model before protobuf
    builds them (``server.py`` registers this as ModelInfer's deserializer)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    @property
    def model_name(self) -> str | None:
        """For the request metrics: None when the message says none."""
        try:
            return scan.model_name(self.data)[0] or None
        except InvalidInput:
            return None


class GrpcCall:
    """A serialized ``ModelInferRequest`` (the data plane's ``WireCall``)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def receive(self) -> None:
        return None  # grpc has read the whole message, bounded by max_request_bytes

    def decode(self, config: ModelConfig, max_items: int) -> InferRequest:
        scan.check(self.data, config, max_items)
        try:
            message = pb.ModelInferRequest.FromString(self.data)
        except DecodeError:
            raise InvalidInput("the ModelInferRequest is not a valid protobuf message") from None
        return codec.decode(message, config, max_items)

    def decode_is_costly(self) -> bool:
        return len(self.data) > codec.COSTLY_MESSAGE_BYTES

    def encode(
        self, request: InferRequest, results: Results, name: str, version: str, config: ModelConfig
    ) -> pb.ModelInferResponse:
        return codec.encode(request, results, name, version, config)

    def encode_is_costly(self, request: InferRequest, results: Results) -> bool:
        return False  # raw bytes, one copy per output


def _given_id(context: aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str):
            return value
    return None


def rpc(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R | None]]:
    """Request id, failure -> status, metrics (``ModelInfer``), access log."""
    name = method.__name__

    @functools.wraps(method)
    async def handle(
        self: InferenceService, request: Any, context: aio.ServicerContext
    ) -> R | None:
        plane = self.plane
        in_flight = plane.metrics.requests.in_flight if name == INFER else None
        origin = (
            GrpcOrigin(SERVICE, name, context.invocation_metadata(), context.peer())
            if plane.tracer is not None and in_flight is not None
            else None
        )
        call, token = plane.begin(GRPC, _given_id(context), origin)
        started = time.perf_counter()
        if in_flight is not None:
            in_flight.inc()
        code, status = OK, grpc.StatusCode.OK.name
        try:
            metadata: tuple[tuple[str, str], ...] = (("x-request-id", call.request_id),)
            if call.span is not None:  # traced: the call's traceparent, sent at once
                trace: dict[str, str] = {}
                plane.inject_trace(call, trace)
                metadata += tuple(trace.items())
            await context.send_initial_metadata(metadata)
            try:
                return await method(self, request, context, call)
            except asyncio.CancelledError:
                code, status = DISCONNECT, grpc.StatusCode.CANCELLED.name
                plane.log_disconnect(f"gRPC {name}")
                raise
            except Exception as exc:  # noqa: BLE001 - a tensorserve error, or a server fault: its status
                failure = Failure(exc)
                code, status = failure.code, failure.status.name
                call.error_code = code
                plane.log_failure(
                    call,
                    f"gRPC {name}",
                    status,
                    code,
                    failure.message,
                    exc,
                    is_server_fault(code, failure.http_status),
                )
                # Set, not ``context.abort``: abort raises an AbortError that
                # grpc keeps on the call's state, whose traceback holds this
                # frame, the context and so the call's state again: a cycle
                # that kept each refused request message (~45 MB for a 4 MiB
                # one of a million strings) until a full gc pass (issue #52).
                context.set_code(failure.status)
                context.set_details(failure.message)
                context.set_trailing_metadata(failure.trailing_metadata(call.request_id))
                return None  # grpc sends no message for a status that is not OK
        finally:
            if in_flight is not None:
                in_flight.dec()
                model = getattr(request, "model_name", None)
                cls_status = Failure.http_status_of(code)
                plane.observe_infer(call, model, code, cls_status, time.perf_counter() - started)
            if plane.settings.access_log:
                seconds = time.perf_counter() - started
                access_log.info(
                    "gRPC %s %s %.2fms",
                    name,
                    status,
                    1000 * seconds,
                    extra={
                        "method": "gRPC",
                        "path": name,
                        "status": status,
                        "code": code,
                        "latency_ms": round(1000 * seconds, 3),
                        "protocol": GRPC,
                        "kserve_id": call.kserve_id,
                        "remote": context.peer(),
                    },
                )
            plane.end(token)

    return handle


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    # -- health and metadata -----------------------------------------------------

    @rpc
    async def ServerLive(self, request: Any, context: Any, call: Call) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=(await models.answer(self.plane, "server_live"))["live"])

    @rpc
    async def ServerReady(self, request: Any, context: Any, call: Call) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(
            ready=(await models.answer(self.plane, "server_ready"))["ready"]
        )

    @rpc
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any, call: Call
    ) -> pb.ModelReadyResponse:
        body = await models.answer(self.plane, "model_ready", request.name, request.version or None)
        return pb.ModelReadyResponse(ready=body["ready"])

    @rpc
    async def ServerMetadata(
        self, request: Any, context: Any, call: Call
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**models.server_metadata())

    @rpc
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Any, call: Call
    ) -> pb.ModelMetadataResponse:
        data = await models.answer(self.plane, "metadata", request.name, request.version or None)
        return messages.model_metadata(data)

    @rpc
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Any, call: Call
    ) -> pb.ModelConfigResponse:
        return messages.model_config(
            await models.answer(self.plane, "config", request.name, request.version or None)
        )

    @rpc
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Any, call: Call
    ) -> pb.ModelStatisticsResponse:
        if not request.name:
            return messages.model_statistics(await models.answer(self.plane, "all_model_stats"))
        stat = await models.answer(self.plane, "model_stats", request.name, request.version or None)
        return messages.model_statistics([stat])

    # -- inference -----------------------------------------------------------------

    @rpc
    async def ModelInfer(
        self, request: RawInferRequest, context: aio.ServicerContext, call: Call
    ) -> pb.ModelInferResponse:
        name, version = scan.model_name(request.data)
        return await self.plane.infer(
            call,
            name,
            version or None,
            GrpcCall(request.data),
            transport_timeout_s=context.time_remaining(),
        )

    # -- the repository extension ------------------------------------------------

    @rpc
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Any, call: Call
    ) -> pb.RepositoryIndexResponse:
        if request.repository_name:
            raise InvalidInput("tensorserve serves one repository: leave repository_name empty")
        return messages.repository_index(
            await models.answer(self.plane, "repository_index", request.ready)
        )

    @rpc
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any, call: Call
    ) -> pb.RepositoryModelLoadResponse:
        parameters = {k: codec.parameter_value(v) for k, v in request.parameters.items()}
        await models.answer(self.plane, "load", request.model_name, parameters)
        return pb.RepositoryModelLoadResponse()

    @rpc
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any, call: Call
    ) -> pb.RepositoryModelUnloadResponse:
        await models.answer(self.plane, "unload", request.model_name)
        return pb.RepositoryModelUnloadResponse()
