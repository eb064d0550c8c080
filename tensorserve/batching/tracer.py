"""The tracing contract the batcher needs, declared here so batching never
imports a tracing library (as ``executor.py`` declares the runtime's).

``tensorserve/tracing/`` implements it with OpenTelemetry. With tracing off
a scheduler's ``tracer`` is None, and the batcher's only cost is that one
check, once per request and once per batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tensorserve.batching.batch import Batch


class BatchTracer(Protocol):
    """Spans of one model's batches."""

    def current_request(self) -> Any:
        """The calling request's trace context, kept on each of its queued
        items (``Pending.trace``); None when the request is not traced."""
        ...

    def batch_finished(self, batch: Batch) -> None:
        """Record a finished batch's stages (queue wait per request, pad,
        compute, un-pad) from the timings the batch already carries. Called
        by the scheduler on its event loop as the batch ends: it must
        not block (spans go to a background exporter)."""
        ...
