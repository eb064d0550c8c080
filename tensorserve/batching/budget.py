"""The padded-volume budget a model's batches keep to when nobody set one
(``max_batch_tokens = "auto"``, the default), learnt from what its batches
cost. No clocks: the batcher tells it what each batch cost.

Why a budget at all: on a CPU, a batch much bigger than the caches costs more
per element than a middling one (the bundled tagger: 6-8 us per element in
batches of 384-1024 padded tokens, 11 us in batches of 4096), and attention
pays the square of its length; a recurrent model, on the other hand, gets
cheaper per item the more rows share each step. A fixed budget is right for
one model and wrong for the next (1024 served the tagger 1.1-1.2x and the GRU
tagger 0.9x of no budget), so the batcher measures it instead:

* padded volumes fall in buckets by powers of two (513-1024 is bucket 10);
* each bucket keeps a moving average of what its batches cost per *real*
  element (the work callers sent: padding only adds cost);
* the budget is the top of the smallest bucket that costs at most
  ``TOLERANCE`` (20%) more per element than the cheapest, or none when that
  is the largest bucket known (bigger batches may be cheaper still):
  a smaller batch costs its callers less waiting, and lets the next batch
  form while it runs;
* after every ``EXPLORE_EVERY``-th batch that ran, the next explores: by
  turns one bucket over the budget, one under it, one over, and none at all;
  so the buckets around the budget are measured again and it moves when
  their costs changed (a quieter machine; longer items, which a recurrent
  model serves cheaper together than one by one). With no budget yet, it
  explores under the biggest bucket known: a loaded server whose batches
  are all full would otherwise never measure a second bucket;
* a bucket no batch has fallen in for ``FORGET_AFTER`` batches is forgotten:
  its cost was measured on traffic that is gone.

A bucket counts once it has ``MIN_BATCHES`` batches, and a budget needs two
such buckets: until then there is none, and the full batches of a loaded
server measure the big buckets. A model with no variable axis has an item
volume of 1, so its budget is a learnt batch size.

Written by the scheduler's loop as each batch ends and read as it forms the
next; ``observe`` holds a lock and ``limit`` reads whole values, so a reader
elsewhere (the stats) sees a consistent budget.
"""

from __future__ import annotations

import threading


class LearntBudget:
    """One model's learnt budget (see the module's docstring)."""

    ALPHA = 0.1  # weight of the newest batch in a bucket's average
    MIN_BATCHES = 4
    EXPLORE_EVERY = 16  # each of the four kinds of exploring comes every 64 batches
    FORGET_AFTER = 256  # > 4 * EXPLORE_EVERY: the explored buckets stay known
    # The smallest bucket within this of the cheapest wins: on 2 cores a
    # tolerance of 0.2 served the GRU tagger 0.97-0.98x of no budget where the
    # cheapest bucket alone (0) served it 0.83-0.97x, the tagger 1.40x/1.40x of
    # the old defaults (0: 1.23x/1.41x), the attention tagger 1.65x/1.43x
    # (0: 1.74x/1.52x). Smaller batches pipeline better with the event loop
    # than the forward's cost alone tells (benchmarks/results/HISTORY.md, "Defaults").
    TOLERANCE = 0.2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self._per_element: dict[int, float] = {}  # bucket -> seconds per real element
        self._batches: dict[int, int] = {}  # bucket -> batches it has seen
        self._last_seen: dict[int, int] = {}  # bucket -> the batch it last saw
        self._observed = 0
        self._limit: int | None = None  # the learnt budget
        self._next: int | None = None  # the next batch's: the learnt one, or exploring

    def observe(self, padded_volume: int, real_volume: int, seconds: float) -> None:
        """What one batch that ran cost."""
        if padded_volume < 1 or real_volume < 1 or seconds <= 0:
            return
        bucket = max(0, padded_volume - 1).bit_length()  # 2**(b-1) < volume <= 2**b
        cost = seconds / real_volume
        with self._lock:
            self._observed += 1
            old = self._per_element.get(bucket)
            self._per_element[bucket] = cost if old is None else old + self.ALPHA * (cost - old)
            self._batches[bucket] = self._batches.get(bucket, 0) + 1
            self._last_seen[bucket] = self._observed
            self._forget_stale()
            self._limit = self._choose()
            self._next = self._next_limit(self._limit)

    def _next_limit(self, limit: int | None) -> int | None:
        """The learnt budget, or after every ``EXPLORE_EVERY``-th batch, by turns,
        one bucket over it, one under, one over, and none (why: the module's docstring)."""
        if self._observed % self.EXPLORE_EVERY:
            return limit
        turn = self._observed // self.EXPLORE_EVERY % 4
        if turn == 0:
            return None
        if turn == 2:
            return (limit or 1 << max(self._per_element)) // 2 or None
        return limit * 2 if limit else None

    def _forget_stale(self) -> None:
        for bucket, seen in list(self._last_seen.items()):
            if self._observed - seen > self.FORGET_AFTER:
                del self._per_element[bucket], self._batches[bucket], self._last_seen[bucket]

    def _choose(self) -> int | None:
        known = {b: c for b, c in self._per_element.items() if self._batches[b] >= self.MIN_BATCHES}
        if len(known) < 2:
            return None
        cheapest = min(known.values())
        within = min(b for b, c in known.items() if c <= cheapest * (1 + self.TOLERANCE))
        return None if within == max(known) else 1 << within

    def reset(self) -> None:
        """Forget everything (after warm-up: a model's first runs are slow)."""
        with self._lock:
            self._clear()

    @property
    def learnt(self) -> int | None:
        """The budget learnt so far (``None``: no budget)."""
        return self._limit

    def limit(self) -> int | None:
        """The budget for the next batch, the learnt one or one exploring
        (decided by ``observe``, so that forming a batch, which may be done
        and thrown away, changes nothing)."""
        return self._next

    def costs(self) -> dict[int, float]:
        """Seconds per real element by bucket top (2**bucket), for the stats."""
        with self._lock:
            return {1 << b: c for b, c in sorted(self._per_element.items())}
