"""One call as the data plane sees it, whichever front end it came in on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tensorserve.repository.config import ModelConfig
from tensorserve.wire.request import InferRequest, Results

if TYPE_CHECKING:
    from tensorserve.tracing import CallOrigin

T_co = TypeVar("T_co", covariant=True)

HTTP = "http"
GRPC = "grpc"


@dataclass(slots=True)
class Call:
    """What the log lines and metrics of one call need, filled in as it goes:
    the id and protocol by its front end, the model and items by the data
    plane's infer path, the error code by the front end's error mapping."""

    request_id: str
    protocol: str  # HTTP or GRPC: a label of the request metrics
    model: str | None = None  # the served model's name, once the infer path found it
    version: str = ""
    items: int = 0
    kserve_id: str | None = None  # the request's own "id", when given
    error_code: str | None = None
    encode_seconds: float | None = None
    encode_started: float = 0.0  # perf_counter(), for the encode span
    # Its request span (tensorserve/tracing/) while it runs: None unless tracing
    # is on and its front end described it (DataPlane.begin's origin).
    span: Any = None  # opaque to all but the tracer
    origin: CallOrigin | None = None  # that description


class WireCall(Protocol[T_co]):
    """One infer call in its transport's terms: how to receive it, decode it
    into an ``InferRequest`` and encode the reply. HTTP wraps a body and a
    codec (``wire/native.py``, ``wire/oip.py``); gRPC a protobuf message."""

    async def receive(self) -> None:
        """Read what is still on its way (HTTP: the body, bounded); runs once
        the model is known to be ready."""
        ...

    def decode(self, config: ModelConfig, max_items: int) -> InferRequest: ...

    def decode_is_costly(self) -> bool:
        """Whether decoding would hold the event loop long enough to stall
        other connections (the data plane then decodes in a thread)."""
        ...

    def encode(
        self, request: InferRequest, results: Results, name: str, version: str, config: ModelConfig
    ) -> T_co: ...

    def encode_is_costly(self, request: InferRequest, results: Results) -> bool: ...
