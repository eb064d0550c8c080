"""Per-model batching counters: plain numbers under a lock, read by the stats
endpoint and by the Prometheus collector at scrape time (so the hot path
never touches a metrics library).

Histograms are kept as bucket counts (``tensorserve/histograms.py``). A short
window of recent items and batches (``WINDOW_S``) gives the stats endpoint
p50/p99 and padding efficiency over the last minute; Prometheus computes its
own windows from the cumulative counters.

Triton's statistics extension counts *requests* (``TritonCounts``): a request
is counted once, when its last item is answered, and charged the pad, run and
un-pad time of each batch its items finished in (as Triton charges every
request in a batch the batch's whole time). The one-item request, the common
case, needs no bookkeeping of its own; a request of several items shares a
``RequestTally`` between them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tensorserve.histograms import SECONDS_BUCKETS, Buckets
from tensorserve.percentiles import percentile
from tensorserve.wire.triton import TritonCounts

# Upper bounds of the executed-batch-size histogram buckets (65536: the
# largest max_batch_size allowed, so the +Inf bucket stays empty).
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 65536)
# Upper bounds of the padded-length histogram (the longest item's variable
# extent in a batch: the length every item of it is padded to).
LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536, 1 << 20)
# The stats endpoint's recent window, and the most items it remembers.
WINDOW_S = 60.0
WINDOW_ITEMS = 20_000


def _histograms() -> dict[str, Buckets]:
    return {
        "batch_size": Buckets(BATCH_SIZE_BUCKETS),  # per batch: its items
        "queue_wait_seconds": Buckets(SECONDS_BUCKETS),  # per item: submit -> taken
        "pad_seconds": Buckets(SECONDS_BUCKETS),  # per batch: collate.pad
        "compute_seconds": Buckets(SECONDS_BUCKETS),  # per batch: the model's run
        "unpad_seconds": Buckets(SECONDS_BUCKETS),  # per batch: un-pad into rows
        "padded_length": Buckets(LENGTH_BUCKETS),  # per batch
    }


class RequestTally:
    """What a request of several items has cost so far, until its last item is
    answered (``BatchStats`` reads and writes it under its lock only)."""

    __slots__ = (
        "failed",
        "infer_ns",
        "input_ns",
        "items",
        "last_batch",
        "left",
        "output_ns",
        "queue_s",
    )

    def __init__(self, items: int) -> None:
        self.items = items
        self.left = items  # items not yet answered
        self.failed = False
        self.queue_s = 0.0  # the longest wait of its items: until its last one left the queue
        self.input_ns = self.infer_ns = self.output_ns = 0
        self.last_batch = 0  # the batch last charged to it (BatchStats.total_batches)


class Answered(Protocol):
    """An item whose answer is final (``admission.Pending``)."""

    enqueued: float  # time.monotonic() at submit
    request: RequestTally | None  # None: a one-item request


@dataclass
class BatchStats:
    total_requests: int = 0
    total_items: int = 0
    total_batches: int = 0
    failed_items: int = 0
    batch_items: int = 0  # items that reached the model (sum of batch sizes)
    batch_seconds: float = 0.0  # time the model spent executing
    queue_seconds: float = 0.0  # sum over items of time from submit to dispatch
    # Each item charged its whole batch's pad, compute and un-pad time, summed:
    # Triton's per-request compute durations (metrics/triton.py).
    item_pad_seconds: float = 0.0
    item_compute_seconds: float = 0.0
    item_unpad_seconds: float = 0.0
    real_elements: int = 0
    padded_elements: int = 0
    histograms: dict[str, Buckets] = field(default_factory=_histograms)
    # Failed batches answered by batching.recovery, by what was done: split
    # (a poison, a crash, the watchdog), rows (RowErrors), rerun (a batch its
    # worker died before running), oom (split after running out of memory).
    recoveries: dict[str, int] = field(default_factory=dict)
    # The most times one item was sent again because its worker died before
    # running it: how close innocent items come to recovery.MAX_RERUNS.
    most_reruns: int = 0
    # (monotonic time finished, seconds from submit to outcome), per item
    recent_items: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=WINDOW_ITEMS)
    )
    # (monotonic time finished, real elements, padded elements), per batch
    recent_batches: deque[tuple[float, int, int]] = field(
        default_factory=lambda: deque(maxlen=WINDOW_ITEMS)
    )
    # Triton's request counters (``TritonCounts``).
    requests_ok: int = 0
    requests_ok_ns: int = 0
    requests_failed: int = 0
    requests_failed_ns: int = 0
    request_queue_ns: int = 0
    request_input_ns: int = 0
    request_infer_ns: int = 0
    request_output_ns: int = 0
    inferences: int = 0
    # batch size -> [batches, input ns, infer ns, output ns]
    batch_sizes: dict[int, list[int]] = field(default_factory=dict)
    last_inference_ms: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self) -> None:
        """Forget everything (e.g. the warm-up batches)."""
        with self._lock:
            for name, value in BatchStats().__dict__.items():
                if name != "_lock":
                    setattr(self, name, value)

    def record_requests(self, requests: int, items: int) -> None:
        with self._lock:
            self.total_requests += requests
            self.total_items += items

    def record_batch(
        self,
        seconds: float,
        real: int,
        padded: int,
        *,
        enqueued: Sequence[float],
        dispatched: float,
        pad_seconds: float | None = None,
        unpad_seconds: float | None = None,
        padded_length: int | None = None,
        answered: Sequence[tuple[Answered, Any, bool]] = (),
    ) -> None:
        """One finished batch. ``enqueued`` (each item's ``time.monotonic()``
        at submit) and ``dispatched`` (when the batch left the queue) give its
        size, its items' queue waits and the recent latency window.
        ``answered``: (item, result, failed) for each item whose answer is
        final (not those of a failed batch that run again), for the failed
        items and Triton's request counters."""
        now = time.monotonic()
        size = len(enqueued)
        durations_ns = (
            round(1e9 * pad_seconds) if pad_seconds is not None else 0,
            round(1e9 * seconds),
            round(1e9 * unpad_seconds) if unpad_seconds is not None else 0,
        )
        finished_ms = time.time_ns() // 1_000_000
        with self._lock:
            self.total_batches += 1
            # Triton's batch_stats (per batch size) and last_inference.
            row = self.batch_sizes.setdefault(size, [0, 0, 0, 0])
            row[0] += 1
            for column, ns in enumerate(durations_ns, 1):
                row[column] += ns
            self.last_inference_ms = max(self.last_inference_ms, finished_ms)
            if answered:
                self.failed_items += sum(failed for _, _, failed in answered)
                self._record_requests(answered, now, dispatched, durations_ns)
            self.batch_items += size
            self.batch_seconds += seconds
            self.real_elements += real
            self.padded_elements += padded
            h = self.histograms
            h["batch_size"].observe(size)
            h["compute_seconds"].observe(seconds)
            self.item_compute_seconds += size * seconds
            if pad_seconds is not None:
                h["pad_seconds"].observe(pad_seconds)
                self.item_pad_seconds += size * pad_seconds
            if unpad_seconds is not None:
                h["unpad_seconds"].observe(unpad_seconds)
                self.item_unpad_seconds += size * unpad_seconds
            if padded_length is not None:
                h["padded_length"].observe(padded_length)
            waits = [dispatched - submitted for submitted in enqueued]
            self.queue_seconds += sum(waits)
            h["queue_wait_seconds"].observe_many(waits)
            self.recent_items.extend([(now, now - submitted) for submitted in enqueued])
            self.recent_batches.append((now, real, padded))

    def _record_requests(
        self,
        answered: Sequence[tuple[Answered, Any, bool]],
        now: float,
        dispatched: float,
        durations_ns: tuple[int, int, int],
    ) -> None:
        """Triton's request counters for the items answered by one batch (the
        lock held): a one-item request ends here; a request of several ends
        with its last item, charged each batch its items finished in once."""
        batch = self.total_batches  # this batch's number, already counted
        ok = failed = 0
        ok_enqueued = failed_enqueued = 0.0  # sums of the one-item requests' submit times
        for item, _, item_failed in answered:
            tally = item.request
            if tally is None:
                if item_failed:
                    failed += 1
                    failed_enqueued += item.enqueued
                else:
                    ok += 1
                    ok_enqueued += item.enqueued
                continue
            if tally.last_batch != batch:
                tally.last_batch = batch
                tally.input_ns += durations_ns[0]
                tally.infer_ns += durations_ns[1]
                tally.output_ns += durations_ns[2]
            tally.queue_s = max(tally.queue_s, dispatched - item.enqueued)
            tally.failed = tally.failed or item_failed
            tally.left -= 1
            if tally.left:
                continue
            if tally.failed:
                self.requests_failed += 1
                self.requests_failed_ns += round(1e9 * (now - item.enqueued))
            else:
                self.requests_ok += 1
                self.requests_ok_ns += round(1e9 * (now - item.enqueued))
                self.request_queue_ns += round(1e9 * tally.queue_s)
                self.request_input_ns += tally.input_ns
                self.request_infer_ns += tally.infer_ns
                self.request_output_ns += tally.output_ns
                self.inferences += tally.items
        # The one-item requests: each charged the whole batch, as Triton charges
        # every request in a batch.
        self.requests_ok += ok
        self.requests_ok_ns += round(1e9 * (ok * now - ok_enqueued))
        self.requests_failed += failed
        self.requests_failed_ns += round(1e9 * (failed * now - failed_enqueued))
        self.request_queue_ns += round(1e9 * (ok * dispatched - ok_enqueued))
        self.request_input_ns += ok * durations_ns[0]
        self.request_infer_ns += ok * durations_ns[1]
        self.request_output_ns += ok * durations_ns[2]
        self.inferences += ok

    def triton_counts(self) -> TritonCounts:
        """A consistent copy of Triton's counters (``wire/triton.py``)."""
        with self._lock:
            return TritonCounts(
                success=self.requests_ok,
                success_ns=self.requests_ok_ns,
                fail=self.requests_failed,
                fail_ns=self.requests_failed_ns,
                queue_ns=self.request_queue_ns,
                compute_input_ns=self.request_input_ns,
                compute_infer_ns=self.request_infer_ns,
                compute_output_ns=self.request_output_ns,
                inferences=self.inferences,
                executions=self.total_batches,
                batch_sizes={
                    size: (row[0], row[1], row[2], row[3])
                    for size, row in sorted(self.batch_sizes.items())
                },
                last_inference_ms=self.last_inference_ms,
            )

    def record_recovery(self, kind: str) -> None:
        with self._lock:
            self.recoveries[kind] = self.recoveries.get(kind, 0) + 1

    def record_reruns(self, times: int) -> None:
        with self._lock:
            self.most_reruns = max(self.most_reruns, times)

    def histogram_snapshot(self) -> dict[str, Buckets]:
        """Copies of the histograms (for the Prometheus collector)."""
        with self._lock:
            return {name: buckets.copy() for name, buckets in self.histograms.items()}

    def snapshot(self, queue_depth: int, window: float = WINDOW_S) -> dict[str, Any]:
        """The ``batching`` object of the stats endpoint."""
        with self._lock:
            batches = self.total_batches
            since = time.monotonic() - window
            latencies = [s for t, s in self.recent_items if t >= since]
            recent = [(r, p) for t, r, p in self.recent_batches if t >= since]
            real, padded = sum(r for r, _ in recent), sum(p for _, p in recent)
            return {
                "total_batches": batches,
                "total_requests": self.total_requests,
                "total_items": self.total_items,
                "failed_items": self.failed_items,
                "avg_batch_size": self.batch_items / batches if batches else 0.0,
                "avg_batch_duration_ms": 1000 * self.batch_seconds / batches if batches else 0.0,
                "avg_queue_ms": 1000 * self.queue_seconds / self.batch_items
                if self.batch_items
                else 0.0,
                "queue_depth": queue_depth,
                # Raw counters, so a client can compute exact deltas between two reads.
                "batch_items": self.batch_items,
                "batch_seconds": self.batch_seconds,
                "real_elements": self.real_elements,
                "padded_elements": self.padded_elements,
                "padding_efficiency": (
                    self.real_elements / self.padded_elements if self.padded_elements else 1.0
                ),
                "recoveries": dict(self.recoveries),
                "most_reruns": self.most_reruns,
                "batch_size_histogram": {
                    str(bound): count
                    for bound, count in zip(
                        BATCH_SIZE_BUCKETS, self.histograms["batch_size"].counts
                    )
                    if count
                },
                # The last minute: what `tensorserve top` shows (0 ms when it saw
                # no item: the stats endpoint is JSON, which has no NaN).
                "recent": {
                    "window_s": window,
                    "items": len(latencies),
                    "batches": len(recent),
                    "p50_ms": 1000 * percentile(latencies, 50) if latencies else 0.0,
                    "p99_ms": 1000 * percentile(latencies, 99) if latencies else 0.0,
                    "padding_efficiency": real / padded if padded else 1.0,
                },
            }
