"""A latency target: the p99 a model's callers need, and the controller that
batches and admits to keep it (``[dynamic_batching] target_p99_ms``).

Without a target a queue fills to ``max_queue_size`` under overload and every
accepted item waits behind it: the p99 of what is served grows with the
queue, not with what callers need. With one, three rules, all from what the
model's batches were measured to cost (callers pass ``now``: unit-tested with
made-up times, tests/test_target.py):

1. **Admission by predicted wait.** A request is refused at once
   (``WouldMissTarget``: 503 + Retry-After) when

       safety * ((ahead + items) / rate + batch_s)  >  target

   ``ahead``: the items queued that would be served before it (at its
   priority or higher); ``rate``: the items per second the queue drains
   while it has a backlog, by the clock (``batching.drain``, as the
   Retry-After of a full queue). Not the model's own seconds per item: on a
   fast model the rest is the limit (the embedder at 1.5x: batches of
   1.1 ms, 4,700 items/s by its seconds, 2,450 by the clock). Not the rate
   of every recent batch: when few are admitted batches are small and slow
   per item, and judging a long queue by them admits fewer still (17% of
   capacity served at 1.5x load). Nor the best rate seen at each batch
   size: big batches form of short items, so per item they look faster
   than a queue of every length drains (the tagger: 4x too fast, p99 500 ms
   for a 150 ms target). Until a backlog was seen, the model's own rate
   (its items over its seconds, times the instances) stands in: then
   nothing waits. ``batch_s``: a recent batch's seconds, the one it may find
   running. Until a few batches were measured nothing is refused, nor is a
   request with nothing ahead (the model alone slower than the target:
   refusing would turn every slow answer into none).
2. **Batch size.** A batch longer than a quarter of the target leaves too
   little for the waits around it: the batch cap shrinks (x0.8) while recent
   batches take more than ``target / 4`` and grows back (+1, up to
   ``max_batch_size``) while they take less than ``target / 8``; between the
   two it stays (a bigger batch serves more items per second on every model
   measured here). The queue delay is at most a tenth of the target.
3. **Feedback.** The prediction is of a typical wait, and leaves out the
   front end, un-padding and the machine's noise; a p99 is a tail. So every
   ``ADJUST_EVERY`` served items ``safety`` grows x1.2 (up to 4) while the
   achieved p99 of the last ``WINDOW`` items is over ``AIM_HIGH`` of the
   target, and shrinks x0.95 (down to 0.5) while under ``AIM_LOW`` of it:
   below the target, as the controller sees the server's part only and
   corrects late (a window admitted under an older safety). The tagger at
   1.5x load: the wait at p99 was 1.5-2.5x the prediction, so a bound of 2
   left the server's p99 at the target and the callers' over it. Bounded:
   an unbounded factor refuses nearly everything once the model alone is
   slower than the target.

Latency here is the server's: from the item's admission to its batch's end
(queue wait + padding + forward + un-padding). Written by whichever thread
finished a batch, read by whichever admits: ``observe`` and ``report`` hold
a lock; ``predicted_s`` and the caps read whole values.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from tensorserve.batching.drain import DrainRate
from tensorserve.percentiles import percentile


class LatencyTarget:
    WINDOW = 1000  # served items whose latencies give the achieved p99
    ADJUST_EVERY = 100  # served items between two safety updates
    MIN_BATCHES = 4  # measured batches before anything is refused
    ALPHA = 0.2  # weight of the newest batch in the moving average of its seconds
    SAFETY = (0.5, 4.0)
    AIM_LOW, AIM_HIGH = 0.55, 0.8  # the band of the target the achieved p99 is kept in

    def __init__(
        self, target_ms: float, max_batch_size: int, max_queue_delay_ms: float, instances: int
    ):
        if target_ms <= 0:
            raise ValueError(f"target_p99_ms must be > 0, got {target_ms}")
        self.target_s = target_ms / 1000
        self.max_batch_size = max(1, max_batch_size)
        self.instances = max(1, instances)
        self.queue_delay_ms = min(max_queue_delay_ms, target_ms / 10)
        self.batch_cap = self.max_batch_size
        self.safety = 1.0
        self._lock = threading.Lock()
        self._latencies: deque[float] = deque(maxlen=self.WINDOW)
        self._batches = 0
        self._since_adjust = 0
        self._batch_s = 0.0  # moving average of a batch's seconds
        # How fast the queue drains from a backlog: the model's queue
        # (AdmissionQueue) writes it under its lock, as it takes batches.
        self.drain = DrainRate()
        # Decayed sums of (items, seconds) of the model's own batches
        # (``observe``): a tuple, replaced whole, so a reader without the
        # lock sees a matching pair.
        self._every = (0.0, 0.0)
        self.refused = 0

    # ------------------------------------------------------------------ measuring
    def observe(self, items: int, seconds: float, latencies: Sequence[float]) -> None:
        """One batch that ran: its items, its seconds, each item's latency."""
        if items < 1 or seconds <= 0:
            return
        with self._lock:
            # A moving average of a batch's seconds, from the first batch's own.
            self._batch_s += self.ALPHA * (seconds - self._batch_s) if self._batches else seconds
            self._batches += 1
            served, served_s = self._every  # decayed as the queue's drain rate (batching.drain)
            self._every = (DrainRate.DECAY * served + items, DrainRate.DECAY * served_s + seconds)
            self._latencies.extend(latencies)
            self._since_adjust += len(latencies)
            # Rule 2, the batch size; then rule 3, feedback (the module's docstring).
            if self._batch_s > self.target_s / 4 and self.batch_cap > 1:
                self.batch_cap = max(1, int(self.batch_cap * 0.8))
            elif self._batch_s < self.target_s / 8 and self.batch_cap < self.max_batch_size:
                self.batch_cap += 1
            if self._since_adjust >= self.ADJUST_EVERY:  # so _latencies is not empty
                self._since_adjust = 0
                p99, (low, high) = percentile(self._latencies, 99), self.SAFETY
                if p99 > self.AIM_HIGH * self.target_s:
                    self.safety = min(high, self.safety * 1.2)
                elif p99 < self.AIM_LOW * self.target_s:
                    self.safety = max(low, self.safety * 0.95)

    # ------------------------------------------------------------------ deciding
    def predicted_s(self, ahead: int, items: int) -> float | None:
        """Seconds until a request of ``items`` behind ``ahead`` queued items
        is answered (with the safety factor), or None while unmeasured."""
        if self._batches < self.MIN_BATCHES:
            return None
        return self.safety * ((ahead + items) / self.drain_rate() + self._batch_s)

    def drain_rate(self) -> float:
        """Items/s the queue drains (see the module's rule 1); called once
        batches were measured, so the model's own rate is never 0/0."""
        backlogged = self.drain.items_per_s()
        if backlogged is not None:
            return backlogged
        served, seconds = self._every
        return self.instances * served / seconds

    def would_miss(self, ahead: int, items: int, count: bool = True) -> float | None:
        """The predicted seconds if they exceed the target (refuse), else None.
        Nothing ahead: never refused. The model alone is then slower than
        the target, and refusing would only turn a slow answer into none.

        Nor is the event loop's lag counted (``dataplane/lag.py``), though a
        saturated front end makes callers late before the queue sees them:
        refusing on it was measured to cost more than it saves on a 2-core
        VM (the embedder at 1.5x its capacity: p99 260-370 ms against
        410-440 ms, for 40-65% of the items/s served), because a refusal
        costs the loop ~100 us against ~250 us for an answer. The lag is
        exported instead, the signal to add replicas on. ``count``: a refusal
        (False: only a question, as the front ends' publisher asks it)."""
        if ahead == 0:
            return None
        predicted = self.predicted_s(ahead, items)
        if predicted is None or predicted <= self.target_s:
            return None
        if count:
            self.count_refused(1)
        return predicted

    def count_refused(self, refusals: int) -> None:
        """Refusals made elsewhere on this target's word (a front-end process
        refuses on what the scheduler process last published)."""
        with self._lock:  # asked from the loop (before a body is read) and from submitters
            self.refused += refusals

    # ------------------------------------------------------------------ reporting
    def report(self) -> dict[str, Any]:
        """For the stats and the metrics: the target, what is achieved, the settings."""
        with self._lock:
            p99 = percentile(self._latencies, 99) if self._latencies else None
            rate_known = self.drain.items_per_s() is not None or self._every[1]
            return {
                "target_p99_ms": round(1000 * self.target_s, 3),
                "achieved_p99_ms": None if p99 is None else round(1000 * p99, 3),
                "window_items": len(self._latencies),
                "batch_cap": self.batch_cap,
                "queue_delay_ms": self.queue_delay_ms,
                "safety": round(self.safety, 3),
                "batch_ms": round(1000 * self._batch_s, 3),
                "drain_items_per_s": round(self.drain_rate(), 3) if rate_known else None,
                "refused": self.refused,
            }
