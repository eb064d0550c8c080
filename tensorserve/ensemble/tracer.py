"""The tracing contract an ensemble needs, declared here so the ensemble
never imports a tracing library (as ``batching/tracer.py`` declares the
batcher's). ``tensorserve/tracing/ensemble.py`` implements it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class StepTracer(Protocol):
    """Spans of one ensemble's steps."""

    def step(self, label: str, model: str) -> AbstractContextManager[Any]:
        """A span of one step of the current request, current while the step
        runs (so the step model's batches hang under it), ended when the
        step ends, as an error when it raised."""
        ...
