"""An ensemble's counters: the whole ensemble's requests (Triton's
statistics) and each step's (calls, items, failures, seconds), kept as
plain numbers and read at scrape time, as ``batching/stats.py`` does for a
model (``metrics/ensemble.py`` turns them into Prometheus families).

The runner observes on the event loop's thread; a scrape or a statistics
request may read from another, so one lock guards each object.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensorserve.histograms import SECONDS_BUCKETS, Buckets
from tensorserve.wire.triton import TritonCounts


@dataclass
class StepCounts:
    calls: int = 0  # one per request that ran the step
    items: int = 0  # items of the calls that succeeded
    failures: int = 0  # calls that failed in the step


class EnsembleStats:
    def __init__(self, steps: Sequence[tuple[str, str]]) -> None:
        """``steps``: each step's (label, model), in the config's order."""
        self._lock = threading.Lock()
        self.steps = list(steps)
        self.counts = {label: StepCounts() for label, _ in steps}
        self.seconds = {label: Buckets(SECONDS_BUCKETS) for label, _ in steps}
        self.success, self.success_ns = 0, 0
        self.fail, self.fail_ns = 0, 0
        self.items = 0
        self.last_inference_ms = 0

    def step_done(self, label: str, items: int, seconds: float, failed: bool) -> None:
        with self._lock:
            counts = self.counts[label]
            counts.calls += 1
            if failed:
                counts.failures += 1
            else:
                counts.items += items
                self.seconds[label].observe(seconds)

    def request_done(self, items: int, seconds: float, failed: bool, now_ms: int) -> None:
        with self._lock:
            if failed:
                self.fail += 1
                self.fail_ns += int(seconds * 1e9)
                return
            self.success += 1
            self.success_ns += int(seconds * 1e9)
            self.items += items
            self.last_inference_ms = now_ms

    def snapshot(self) -> dict[str, Any]:
        """Every counter now, copies that later observations leave alone."""
        with self._lock:
            return {
                "success": (self.success, self.success_ns),
                "fail": (self.fail, self.fail_ns),
                "items": self.items,
                "last_inference_ms": self.last_inference_ms,
                "steps": [
                    (
                        label,
                        model,
                        StepCounts(**vars(self.counts[label])),
                        self.seconds[label].copy(),
                    )
                    for label, model in self.steps
                ],
            }

    def triton_counts(self) -> TritonCounts:
        """Triton's statistics of the ensemble itself: its requests and
        items; its time is all compute (its steps' models report their own
        queues and batches)."""
        with self._lock:
            return TritonCounts(
                success=self.success,
                success_ns=self.success_ns,
                fail=self.fail,
                fail_ns=self.fail_ns,
                queue_ns=0,
                compute_input_ns=0,
                compute_infer_ns=self.success_ns,
                compute_output_ns=0,
                inferences=self.items,
                executions=0,
                batch_sizes={},
                last_inference_ms=self.last_inference_ms,
            )

    def report(self) -> dict[str, Any]:
        """tensorserve's own statistics of an ensemble: each step's calls,
        items, failures and mean seconds of the calls that succeeded."""
        steps = []
        for label, model, counts, seconds in self.snapshot()["steps"]:
            mean_ms = seconds.total / seconds.count * 1000 if seconds.count else None
            steps.append({"step": label, "model": model, **vars(counts), "mean_ms": mean_ms})
        return {"steps": steps}
