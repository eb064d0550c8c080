"""How fast one model's queue drains: the one estimate behind both the
``Retry-After`` of a refusal (batching.admission) and the latency target's
predicted wait (batching.target).

The rate is by the clock, while the queue has a backlog: the items each
batch took from the queue over the time since the previous batch was
taken, counted only when that previous take left items waiting. Between two
such takes everything that serves the queue was busy with it (the model,
and the padding, transfer and un-padding around it, on every instance), so
the rate is what a caller at the back of the queue will see. Time after a
take that emptied the queue is idle, not draining, and is not counted.

The queue (``AdmissionQueue``) is the only writer, its lock held; readers
without the lock see a matching pair (the sums are one tuple, replaced
whole). No clock of its own: the queue passes ``now``, so it is unit-tested
with made-up times (tests/test_admission.py, tests/test_target.py).
"""

from __future__ import annotations


class DrainRate:
    # Weight kept by the older batches at each new one: ~20 batches, enough to
    # average over the mix of lengths a queue holds.
    DECAY = 0.95

    def __init__(self) -> None:
        self._sums = (0.0, 0.0)  # decayed (items, seconds) drained from a backlog
        self._last_take: tuple[float, int] | None = None  # (when, items it left waiting)

    def taken(self, items: int, now: float, left: int) -> None:
        """A batch of ``items`` left the queue at ``now``, ``left`` still waiting."""
        last = self._last_take
        if last is not None and last[1] > 0 and now > last[0]:
            elapsed = now - last[0]
            self._sums = (self.DECAY * self._sums[0] + items, self.DECAY * self._sums[1] + elapsed)
        self._last_take = (now, left)

    def emptied(self) -> None:
        """Nothing waits any more, though the last take left items waiting
        (they were withdrawn or expired): the time until the next take is
        idle, not draining."""
        if self._last_take is not None:
            self._last_take = (self._last_take[0], 0)

    def items_per_s(self) -> float | None:
        """Items a second the queue drained from a backlog; None until one was seen."""
        items, seconds = self._sums
        return items / seconds if items else None

    def seconds_for(self, items: int) -> float | None:
        """When ``items`` more will have left the queue at the measured rate
        (None: not yet measured)."""
        rate = self.items_per_s()
        return None if rate is None else items / rate
