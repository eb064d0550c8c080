"""The spans of an ensemble's steps (``ensemble/tracer.py StepTracer``).

Each step of a sampled request is a span under the request's, current while
the step runs: the step model's items carry it, so that model's batch
spans (``batches.py``) hang under the step that queued them. An unsampled
request's steps make no span.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode


class EnsembleStepTracer:
    def __init__(self, tracer: trace.Tracer, ensemble: str, version: int) -> None:
        self.tracer = tracer
        self.ensemble, self.version = ensemble, str(version)

    @contextlib.contextmanager
    def step(self, label: str, model: str) -> Iterator[None]:
        # Sampled, not recording: with --frontends N the request's span is a
        # front end's, current here as its (sampled, non-recording) context.
        if not trace.get_current_span().get_span_context().trace_flags.sampled:
            yield
            return
        attributes = {
            "tensorserve.model": self.ensemble,
            "tensorserve.model.version": self.version,
            "tensorserve.ensemble.step": label,
            "tensorserve.ensemble.step_model": model,
        }
        # The step's error is the request's: recorded there, not twice.
        with self.tracer.start_as_current_span(
            f"step {label}", attributes=attributes, record_exception=False
        ) as span:
            try:
                yield
            except BaseException as exc:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise
