"""The spans of a finished batch, recorded after the fact from the timings
the batch already carries (``batching/results.py Batch``), so tracing adds
no clock reads to the stages themselves.

For each traced request in the batch, a ``queue`` span (its items' wait,
from admission to the batch leaving the queue) under the request's span.
For the batch, once: ``pad``, ``compute`` and ``unpad``. A batch serves
many requests, and a span has one parent: these hang under the first traced
request's span (for a lone request, the common case, its own trace shows
every stage), and ``compute`` links to every traced request in the batch,
so each trace leads to the batch that ran it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, Status, StatusCode

if TYPE_CHECKING:
    from tensorserve.batching.batch import Batch


class WallClock:
    """Converts the batcher's clocks (``time.monotonic()`` for admission and
    dispatch, ``time.perf_counter()`` for stage timings) to the epoch
    nanoseconds a span takes, read once per batch."""

    __slots__ = ("mono", "perf")

    def __init__(self) -> None:
        # Each clock against the next at one instant (``offset_ns``): a
        # thread descheduled between two plain reads would shift every span
        # of one clock against the others by that long (seen: 51 us, the
        # queue span ending after the pad span began).
        self.mono = offset_ns(time.time_ns, time.monotonic_ns)
        self.perf = self.mono + offset_ns(time.monotonic_ns, time.perf_counter_ns)

    def from_monotonic(self, seconds: float) -> int:
        return self.mono + int(seconds * 1e9)

    def from_perf(self, seconds: float) -> int:
        return self.perf + int(seconds * 1e9)


def offset_ns(reference: Callable[[], int], other: Callable[[], int], tries: int = 3) -> int:
    """``reference() - other()`` at one instant: a ``reference`` read
    bracketed by two ``other`` reads, the tightest bracket of ``tries`` (a
    try a preemption stretched loses to the others)."""
    best: tuple[int, int] | None = None
    for _ in range(tries):
        before = other()
        value = reference()
        after = other()
        if best is None or after - before < best[0]:
            best = (after - before, value - (before + after) // 2)
    assert best is not None
    return best[1]


class ModelBatchTracer:
    """``batching/tracer.py BatchTracer`` for one model version."""

    def __init__(self, tracer: trace.Tracer, model: str, version: int) -> None:
        self.tracer = tracer
        self.model, self.version = model, str(version)

    def current_request(self) -> SpanContext | None:
        """The current (request) span's context when it is sampled: an
        unsampled request's items need no spans."""
        span_context = trace.get_current_span().get_span_context()
        return span_context if span_context.trace_flags.sampled else None

    def batch_finished(self, batch: Batch) -> None:
        requests: dict[
            int, tuple[SpanContext, float, int]
        ] = {}  # span id -> (ctx, admitted, items)
        for entry in batch.entries:
            span_context = entry.trace
            if span_context is None:
                continue
            seen = requests.get(span_context.span_id)
            admitted, items = (entry.enqueued, 0) if seen is None else seen[1:]
            requests[span_context.span_id] = (
                span_context,
                min(admitted, entry.enqueued),
                items + 1,
            )
        if not requests:
            return
        clock = WallClock()
        model = {"tensorserve.model": self.model, "tensorserve.model.version": self.version}
        for span_context, admitted, items in requests.values():
            self._span(
                "queue",
                span_context,
                clock.from_monotonic(admitted),
                clock.from_monotonic(batch.dispatched),
                {**model, "tensorserve.items": items},
            )
        first = next(iter(requests.values()))[0]
        attributes: dict[str, Any] = {**model, "tensorserve.batch.size": len(batch.entries)}
        length = batch.padded.longest if batch.padded is not None else None
        if length is not None:
            attributes["tensorserve.batch.padded_length"] = length
        if batch.pad_seconds is not None and batch.started:
            start = clock.from_perf(batch.started - batch.pad_seconds)
            self._span("pad", first, start, clock.from_perf(batch.started), attributes)
        if batch.started:
            links = [Link(ctx, {"tensorserve.items": n}) for ctx, _, n in requests.values()]
            error = type(batch.error).__name__ if batch.error is not None else None
            self._span(
                "compute",
                first,
                clock.from_perf(batch.started),
                clock.from_perf(batch.started + batch.seconds),
                {**attributes, "error.type": error} if error else attributes,
                links,
                error,
            )
        if batch.unpad_seconds is not None:
            end = clock.from_perf(batch.unpad_started + batch.unpad_seconds)
            self._span("unpad", first, clock.from_perf(batch.unpad_started), end, attributes)

    def _span(
        self,
        name: str,
        parent: SpanContext,
        start: int,
        end: int,
        attributes: dict[str, Any],
        links: list[Link] | None = None,
        error: str | None = None,
    ) -> None:
        span = self.tracer.start_span(
            name,
            trace.set_span_in_context(NonRecordingSpan(parent)),
            attributes=attributes,
            links=links or (),
            start_time=start,
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end)
