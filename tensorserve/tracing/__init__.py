"""Tracing: OpenTelemetry spans of each request and of the batches it ran in.

Off unless ``otlp_endpoint`` is set; then ``configure`` imports the
OpenTelemetry SDK (the ``otel`` extra) and nothing else ever does, so
``import tensorserve`` and a server without tracing never load it.

    __init__.py   this file: the hook API a front end calls (``RequestTracer``),
                  ``configure`` and the SDK check; imports no OpenTelemetry
    attributes.py ``Attributes``, a span's attributes, as every module here types them
    otel.py       the SDK's tracer provider, the OTLP/HTTP exporter, the
                  request span (``OtelTracer``)
    batches.py    the spans of a finished batch (``ModelBatchTracer``, the
                  ``batching/tracer.py`` contract)
    ensemble.py   the span of each step of an ensemble (``EnsembleStepTracer``,
                  the ``ensemble/tracer.py`` contract)
    http.py       an HTTP request as OpenTelemetry's conventions name it
                  (``HttpOrigin``)
    grpc.py       a gRPC call as they name it (``GrpcOrigin``)

The data plane (``dataplane/plane.py``) calls, per traced infer call, given
the ``CallOrigin`` its front end describes it with:

    span = tracer.start_request(carrier, name, attributes)  # headers or metadata
    ... the request is served; its items carry the span's context ...
    tracer.inject(span, response_headers)                   # traceparent back
    tracer.stage(span, "encode", started, seconds)          # a stage it timed
    tracer.finish_request(span, attributes, failed)
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

from tensorserve.tracing.attributes import Attributes

if TYPE_CHECKING:
    from tensorserve.batching.tracer import BatchTracer
    from tensorserve.ensemble.tracer import StepTracer
    from tensorserve.settings import Settings

# A command that works from a fresh clone (tensorserve is on no package index).
INSTALL = "from the repository's root: pip install -e '.[otel]'"


class CallOrigin(Protocol):
    """A traced call in its transport's terms, built by a front end only when
    tracing is on: where its trace context comes from, and what its span is
    called and says (``http.py``, ``grpc.py``)."""

    @property
    def carrier(self) -> Mapping[str, str]:
        """The caller's HTTP headers or gRPC metadata (``traceparent``)."""
        ...

    def span_name(self) -> str: ...

    def attributes(self, request_id: str) -> Attributes:
        """The span's attributes when the call starts."""
        ...

    def outcome(self, code: str, status: int) -> Attributes:
        """The transport's own attributes of the outcome: ``code`` is the
        tensorserve code (``ok``, ``disconnect``, an error's), ``status`` the
        HTTP status the outcome has (for gRPC: the one its code has)."""
        ...


def outcome_attributes(
    code: str, failed: bool, model: str | None, version: str, items: int
) -> dict[str, Any]:
    """Every call's outcome, whatever its transport: ``error.type`` when it
    failed on the server's side (a 5xx, as the conventions ask of a server
    span), the error code for every outcome."""
    attributes: dict[str, Any] = {"tensorserve.outcome": code, "tensorserve.items": items}
    if model is not None:
        attributes["tensorserve.model"] = model
        attributes["tensorserve.model.version"] = version
    if failed:
        attributes["error.type"] = code
    return attributes


class RequestTracer(Protocol):
    """What a front end calls; the span objects are opaque to it."""

    def start_request(self, carrier: Mapping[str, str], name: str, attributes: Attributes) -> Any:
        """Start the request's server span, continuing the caller's trace when
        ``carrier`` (HTTP headers, gRPC metadata) holds a ``traceparent``, and
        make it current, so the items queued by this task carry it."""
        ...

    def inject(self, span: Any, headers: MutableMapping[str, str]) -> None:
        """Write the span's ``traceparent`` into the response's headers."""
        ...

    def stage(self, span: Any, name: str, started: float, seconds: float) -> None:
        """A child span of the request for a stage the front end timed
        (``time.perf_counter()`` start, seconds)."""
        ...

    def recording(self, span: Any) -> bool:
        """Whether the span is sampled (else its outcome need not be built)."""
        ...

    def finish_request(self, span: Any, attributes: Attributes, failed: bool) -> None:
        """End the span with its outcome; it stops being current."""
        ...

    def batch_tracer(self, model: str, version: int) -> BatchTracer:
        """The tracer of one model's batches (the registry installs it)."""
        ...

    def current_traceparent(self) -> str | None:
        """The current request span's ``traceparent`` when it is sampled: what
        a front-end process sends with the request's items (``--frontends N``)."""
        ...

    def request_context(self, traceparent: str) -> contextvars.Context:
        """A context in which a request whose span lives in a front-end
        process is the current span: its items queued, or its ensemble run,
        in this context carry it, as in the process that started it."""
        ...

    def ensemble_tracer(self, ensemble: str, version: int) -> StepTracer:
        """The tracer of one ensemble's steps (the registry installs it)."""
        ...

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        ...


def missing_sdk() -> str | None:
    """Why tracing cannot be configured here (None: it can)."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return f"--otlp-endpoint needs the OpenTelemetry SDK ({exc.name} is missing): {INSTALL}"
    return None


def configure(settings: Settings) -> RequestTracer | None:
    """The server's tracer, or None when tracing is off (no endpoint)."""
    if settings.otlp_endpoint is None:
        return None
    from tensorserve.tracing.otel import OtelTracer  # the SDK: only when tracing is on

    return OtelTracer(
        settings.otlp_endpoint, settings.trace_sample_ratio, settings.trace_service_name
    )
