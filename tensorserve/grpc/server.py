"""The gRPC front end: a ``grpc.aio`` server on the server's event loop,
serving ``InferenceService`` beside the HTTP front end, on the same data
plane (so its calls join the same batches, metrics and shutdown).

Its largest message is ``max_request_bytes``, the HTTP body limit: a larger
one fails with RESOURCE_EXHAUSTED before any handler runs.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from grpc import aio

from tensorserve.dataplane import DataPlane
from tensorserve.dataplane.frontend import StartupError
from tensorserve.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from tensorserve.grpc.service import InferenceService, RawInferRequest

log = logging.getLogger(__name__)

OFF = -1  # --grpc-port -1: no gRPC front end


class _RawModelInfer:
    """Registers the generated handlers on ``server``, ModelInfer's taking the
    message unparsed (``RawInferRequest``): its fields are counted before
    protobuf builds them (``grpc/scan.py``)."""

    def __init__(self, server: aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come to add_registered_method_handlers next

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        infer = handlers["ModelInfer"]
        handlers = {**handlers, "ModelInfer": infer._replace(request_deserializer=RawInferRequest)}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, handlers),)
        )
        self.server.add_registered_method_handlers(service, handlers)


class GrpcFrontEnd:
    """One ``grpc.aio.Server``, owned by the server's run (``http/server.py``)."""

    def __init__(self, plane: DataPlane, reuse_port: bool = False) -> None:
        self.plane = plane
        # One of the front ends' servers on the same port (--frontends N):
        # the scheduler process has reserved it, and checked it was free.
        self.reuse_port = reuse_port
        self.port: int | None = None  # the bound port, once started (0 asks for any free one)
        self._server: aio.Server | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        settings = self.plane.settings
        limit = settings.max_request_bytes
        server = aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", -1),  # replies: as large as the model made them
                # A port in use is a start-up error, as for HTTP, not a shared port.
                ("grpc.so_reuseport", int(self.reuse_port)),
            ],
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceService(self.plane), _RawModelInfer(server)
        )
        address = f"{settings.host}:{settings.grpc_port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartupError(
                f"cannot listen for gRPC on {address}: the port is already in use or the "
                f"address cannot be bound ({exc})"
            ) from None
        if port == 0:  # older grpcio reports a failed bind as port 0
            raise StartupError(f"cannot listen for gRPC on {address}")
        await server.start()
        self._server, self.port = server, port
        log.info("serving %s on grpc://%s:%s", settings.model_repository, settings.host, port)

    async def stop_accepting(self) -> None:
        # grpc.aio has no "stop accepting" alone: stop() refuses new calls at
        # once and lets those in flight finish within the grace given; the
        # data plane's lifecycle answers those still waiting when its own
        # grace ends, before close() below.
        if self._server is not None and self._stopping is None:
            settings = self.plane.settings
            # Longer than the lifecycle's grace: it, not grpc, ends the calls.
            grace = settings.shutdown_grace_s + 5.0
            self._stopping = asyncio.create_task(self._server.stop(grace=grace))

    async def close(self) -> None:
        if self._server is None:
            return
        await self._server.stop(grace=0)  # the more restrictive grace wins
        if self._stopping is not None:
            await self._stopping
