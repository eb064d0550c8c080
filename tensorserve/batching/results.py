"""A finished batch's outcome for each of its callers, and its record in the
stats: no threads, no futures (``Scheduler._finish`` delivers what this returns).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tensorserve.batching.admission import Outcome
from tensorserve.batching.batch import Batch
from tensorserve.batching.collate import Collator
from tensorserve.batching.policy import BatchCostModel, BatchPolicy
from tensorserve.batching.stats import BatchStats
from tensorserve.batching.target import LatencyTarget
from tensorserve.errors import ModelFailure, as_model_failure
from tensorserve.tensors.results import RowResult

log = logging.getLogger(__name__)


class BatchResults:
    """Turns a collected batch into one outcome per caller (un-padding the
    outputs), teaches the policy's cost model, and records the batch."""

    def __init__(
        self,
        collator: Collator,
        policy: BatchPolicy,
        stats: BatchStats,
        name: str,
        cost: BatchCostModel,
        target: LatencyTarget | None = None,
    ) -> None:
        self.collator = collator
        self.policy = policy
        self.cost = cost  # the policy's, or recovery's when the policy has none
        self.stats = stats
        self.name = name
        self.target = target  # told what each batch cost and what its callers waited

    def outcomes(self, batch: Batch) -> list[Outcome]:
        """One (entry, result or error, failed) per caller, in order."""
        entries = batch.entries
        if batch.error is None:
            try:
                started = time.perf_counter()
                rows = self._rows(batch)
                batch.unpad_started, batch.unpad_seconds = started, time.perf_counter() - started
            except BaseException as exc:  # noqa: BLE001 - un-padding failed: this batch only
                batch.error = exc
        if batch.error is not None:
            error = as_model_failure(batch.error, self.name)
            outcomes: list[Outcome] = [(entry, error, True) for entry in entries]
        elif batch.outputs is not None and batch.outputs.per_item is None:
            outcomes = [(entry, row, False) for entry, row in zip(entries, rows)]  # un-padded rows
        else:  # the model's own per-item results: any may be an exception
            outcomes = [
                (entry, as_model_failure(row, self.name), True)
                if isinstance(row, BaseException)
                else (entry, row, False)
                for entry, row in zip(entries, rows)
            ]
        self.record(batch, outcomes)
        return outcomes

    def _rows(self, batch: Batch) -> Sequence[Any]:
        """One result (or Exception) per entry."""
        outputs, size = batch.outputs, len(batch.entries)
        assert outputs is not None and batch.padded is not None
        if outputs.per_item is not None:
            if len(outputs.per_item) != size:
                raise ModelFailure(
                    f"batch function returned {len(outputs.per_item)} results for a batch of "
                    f"{size} items"
                )
            rows: Sequence[Any] = outputs.per_item
        else:
            assert outputs.batched is not None
            rows = self.collator.unpad(outputs.batched, batch.padded)
        parameters = outputs.parameters
        return rows if not parameters else _with_parameters(rows, parameters)

    def record(self, batch: Batch, outcomes: list[Outcome]) -> None:
        """Teach the policy what a batch of this padded volume cost (one that
        ran), tell the latency target, and count the batch in the stats."""
        entries = batch.entries
        # A batch that captured a CUDA graph took the capture's time: the
        # stats count it, the cost model and the latency target do not learn it.
        captured = batch.outputs is not None and batch.outputs.captured
        if batch.error is None and not captured:
            volumes = [e.volume for e in entries]
            longest = max(volumes)
            self.cost.observe(len(entries), longest, batch.seconds)
            if (budget := self.policy.budget) is not None:
                real = sum(volumes)  # a packed batch pads nothing: its volume is its real one
                volume = real if self.policy.packed else len(entries) * longest
                budget.observe(volume, real, batch.seconds)
            if self.target is not None:
                now = time.monotonic()
                self.target.observe(
                    len(entries), batch.seconds, [now - e.enqueued for e in entries]
                )
        padded = batch.padded
        real, elements = (padded.real_elements, padded.padded_elements) if padded else (0, 0)
        self.stats.record_batch(
            batch.seconds,
            real,
            elements,
            enqueued=[e.enqueued for e in entries],
            dispatched=batch.dispatched,
            pad_seconds=batch.pad_seconds,
            unpad_seconds=batch.unpad_seconds,
            padded_length=padded.longest if padded is not None else None,
            answered=outcomes,
        )


def _with_parameters(rows: Sequence[Any], columns: Mapping[str, Sequence[Any]]) -> list[Any]:
    """Each row's result with its own values of the model's output
    parameters (a failed row stays its exception)."""
    for name, values in columns.items():
        if len(values) != len(rows):
            raise ModelFailure(
                f"output parameter {name!r} has {len(values)} values for a batch of "
                f"{len(rows)} rows; give one per row"
            )
    return [
        row
        if isinstance(row, BaseException)
        else RowResult(row, {name: values[i] for name, values in columns.items()})
        for i, row in enumerate(rows)
    ]
