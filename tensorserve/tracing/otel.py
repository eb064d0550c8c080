"""The OpenTelemetry SDK behind ``RequestTracer``: one tracer provider per
server, spans sent by a ``BatchSpanProcessor`` (a background thread: an
export never blocks the event loop) to ``{endpoint}/v1/traces`` by OTLP/HTTP
in protobuf.

Configuration follows OpenTelemetry's own variables wherever tensorserve
sets nothing: ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (when
``trace_sample_ratio`` is unset), ``OTEL_PROPAGATORS`` (what a request's
headers are read as), ``OTEL_BSP_*`` (the processor's queue and delay) and
``OTEL_EXPORTER_OTLP_HEADERS`` / ``_TIMEOUT`` / ``_COMPRESSION``.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from opentelemetry import context, propagate, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tensorserve import __version__
from tensorserve.tracing.attributes import Attributes
from tensorserve.tracing.batches import ModelBatchTracer, WallClock
from tensorserve.tracing.ensemble import EnsembleStepTracer

SCOPE = "tensorserve"
DEFAULT_SERVICE = "tensorserve"
# The response carries the request span's context as W3C's traceparent,
# whatever OTEL_PROPAGATORS reads requests with.
RESPONSE_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(slots=True)
class RequestSpan:
    span: trace.Span
    token: object  # the context attached while the request runs


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP's path for traces under the collector's base URL."""
    return endpoint.rstrip("/") + "/v1/traces"


class OtelTracer:
    """``RequestTracer`` with the OpenTelemetry SDK."""

    def __init__(self, endpoint: str, ratio: float | None, service_name: str | None) -> None:
        # None: the SDK reads OTEL_TRACES_SAMPLER(_ARG); its default follows the
        # caller's flag and samples every new trace.
        sampler = None if ratio is None else ParentBased(TraceIdRatioBased(ratio))
        name = service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE
        resource = Resource.create({"service.name": name, "service.version": __version__})
        # shutdown_on_exit=False: the server shuts it down with the app
        # (flushing what is buffered), not an atexit hook after the loop is gone.
        self.provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(traces_url(endpoint))))
        self.tracer = self.provider.get_tracer(SCOPE, __version__)

    def start_request(
        self, carrier: Mapping[str, str], name: str, attributes: Attributes
    ) -> RequestSpan:
        parent = propagate.extract(carrier)
        span = self.tracer.start_span(name, parent, SpanKind.SERVER, attributes)
        return RequestSpan(span, context.attach(trace.set_span_in_context(span, parent)))

    def inject(self, span: RequestSpan, headers: MutableMapping[str, str]) -> None:
        RESPONSE_PROPAGATOR.inject(headers, trace.set_span_in_context(span.span))

    def stage(self, span: RequestSpan, name: str, started: float, seconds: float) -> None:
        if not span.span.is_recording():  # unsampled: its children would be dropped anyway
            return
        clock = WallClock()
        parent = trace.set_span_in_context(span.span)
        child = self.tracer.start_span(name, parent, start_time=clock.from_perf(started))
        child.end(clock.from_perf(started + seconds))

    def recording(self, span: RequestSpan) -> bool:
        return span.span.is_recording()

    def finish_request(self, span: RequestSpan, attributes: Attributes, failed: bool) -> None:
        try:
            if not span.span.is_recording():
                return
            span.span.set_attributes(attributes)
            if failed:  # a server span is an error for the server's faults only (5xx)
                span.span.set_status(Status(StatusCode.ERROR))
            span.span.end()
        finally:
            context.detach(span.token)  # type: ignore[arg-type]

    def current_traceparent(self) -> str | None:
        if not trace.get_current_span().get_span_context().trace_flags.sampled:
            return None
        carrier: dict[str, str] = {}
        RESPONSE_PROPAGATOR.inject(carrier)
        return carrier.get("traceparent")

    def request_context(self, traceparent: str) -> contextvars.Context:
        remote = RESPONSE_PROPAGATOR.extract({"traceparent": traceparent})
        copied = contextvars.copy_context()
        copied.run(context.attach, remote)
        return copied

    def batch_tracer(self, model: str, version: int) -> ModelBatchTracer:
        return ModelBatchTracer(self.tracer, model, version)

    def ensemble_tracer(self, ensemble: str, version: int) -> EnsembleStepTracer:
        return EnsembleStepTracer(self.tracer, ensemble, version)

    def shutdown(self) -> None:
        self.provider.shutdown()
