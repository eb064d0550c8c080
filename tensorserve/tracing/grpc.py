"""A gRPC call's span name and attributes, as OpenTelemetry's RPC semantic
conventions name them (``rpc.system`` grpc, ``rpc.service``, ``rpc.method``,
``rpc.grpc.status_code``).

Takes the call's metadata and peer as plain values, so tracing imports no
grpcio: a call's status is read from the one table (``errors.CODES``: each
code's ``grpc_status``), as ``grpc/errors.py`` reads it to end the call."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tensorserve import errors
from tensorserve.tracing.attributes import Attributes

# gRPC's status codes by name (grpc/status.h; stable across versions).
STATUS_CODES = {
    name: number
    for number, name in enumerate(
        (
            "OK",
            "CANCELLED",
            "UNKNOWN",
            "INVALID_ARGUMENT",
            "DEADLINE_EXCEEDED",
            "NOT_FOUND",
            "ALREADY_EXISTS",
            "PERMISSION_DENIED",
            "RESOURCE_EXHAUSTED",
            "FAILED_PRECONDITION",
            "ABORTED",
            "OUT_OF_RANGE",
            "UNIMPLEMENTED",
            "INTERNAL",
            "UNAVAILABLE",
            "DATA_LOSS",
            "UNAUTHENTICATED",
        )
    )
}
OUTCOME_STATUS = {"ok": "OK", "disconnect": "CANCELLED"}  # outcomes that are not errors


def status_code(code: str) -> int:
    """The gRPC status a call with this outcome ends with (a code the table
    does not know, a model's own, is INTERNAL, as ``grpc/errors.py`` says)."""
    name = OUTCOME_STATUS.get(code)
    if name is None:
        cls = errors.CODES.get(code)
        name = cls.grpc_status if cls is not None else "INTERNAL"
    return STATUS_CODES[name]


class GrpcOrigin:
    """A gRPC call (the tracing's ``CallOrigin``): ``service`` is the full
    service name (``inference.GRPCInferenceService``), ``metadata`` the call's
    invocation metadata, ``peer`` grpc's ``ipv4:127.0.0.1:5000`` form."""

    __slots__ = ("carrier", "method", "peer", "service")

    def __init__(
        self, service: str, method: str, metadata: Iterable[tuple[str, Any]] | None, peer: str
    ) -> None:
        self.service, self.method, self.peer = service, method, peer
        # Text metadata only ("-bin" keys carry bytes); gRPC keys are lower case.
        self.carrier: Mapping[str, str] = {
            key: value for key, value in metadata or () if isinstance(value, str)
        }

    def span_name(self) -> str:
        return f"{self.service}/{self.method}"

    def attributes(self, request_id: str) -> Attributes:
        attributes: dict[str, Any] = {
            "rpc.system": "grpc",
            "rpc.service": self.service,
            "rpc.method": self.method,
            "tensorserve.request_id": request_id,
        }
        family, _, address = self.peer.partition(":")
        if family in ("ipv4", "ipv6") and address:
            host, _, port = address.rpartition(":")
            attributes["network.peer.address"] = host.strip("[]")
            if port.isdigit():
                attributes["network.peer.port"] = int(port)
        return attributes

    def outcome(self, code: str, status: int) -> Attributes:
        return {"rpc.grpc.status_code": status_code(code)}
