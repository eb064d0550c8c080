"""Per-model batching counters: plain numbers under a lock, read by the stats
endpoint and by the Prometheus collector at scrape time (so the hot path
never touches a metrics library)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

# Upper bounds of the executed-batch-size histogram buckets.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 65536)


@dataclass
class BatchStats:
    total_requests: int = 0
    total_items: int = 0
    total_batches: int = 0
    failed_items: int = 0
    batch_items: int = 0  # items that reached the model (sum of batch sizes)
    batch_seconds: float = 0.0  # time the model spent executing
    queue_seconds: float = 0.0  # sum over items of time from submit to dispatch
    real_elements: int = 0
    padded_elements: int = 0
    batch_size_counts: list[int] = field(default_factory=lambda: [0] * len(BATCH_SIZE_BUCKETS))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self) -> None:
        """Forget everything (e.g. the warm-up batches)."""
        with self._lock:
            for name, value in BatchStats().__dict__.items():
                if name != "_lock":
                    setattr(self, name, value)

    def record_request(self, items: int) -> None:
        with self._lock:
            self.total_requests += 1
            self.total_items += items

    def record_batch(
        self, size: int, seconds: float, queue_seconds: float, real: int, padded: int
    ) -> None:
        with self._lock:
            self.total_batches += 1
            self.batch_items += size
            self.batch_seconds += seconds
            self.queue_seconds += queue_seconds
            self.real_elements += real
            self.padded_elements += padded
            for index, bound in enumerate(BATCH_SIZE_BUCKETS):
                if size <= bound:
                    self.batch_size_counts[index] += 1
                    break

    def record_failures(self, items: int) -> None:
        with self._lock:
            self.failed_items += items

    def snapshot(self, queue_depth: int) -> dict[str, Any]:
        """The ``batching`` object of the stats endpoint."""
        with self._lock:
            batches = self.total_batches
            return {
                "total_batches": batches,
                "total_requests": self.total_requests,
                "total_items": self.total_items,
                "failed_items": self.failed_items,
                "avg_batch_size": self.batch_items / batches if batches else 0.0,
                "avg_batch_duration_ms": 1000 * self.batch_seconds / batches if batches else 0.0,
                "avg_queue_ms": 1000 * self.queue_seconds / self.batch_items if self.batch_items else 0.0,
                "queue_depth": queue_depth,
                # Raw counters, so a client can compute exact deltas between two reads.
                "batch_items": self.batch_items,
                "batch_seconds": self.batch_seconds,
                "real_elements": self.real_elements,
                "padded_elements": self.padded_elements,
                "padding_efficiency": (
                    self.real_elements / self.padded_elements if self.padded_elements else 1.0
                ),
                "batch_size_histogram": {
                    str(bound): count
                    for bound, count in zip(BATCH_SIZE_BUCKETS, self.batch_size_counts)
                    if count
                },
            }
