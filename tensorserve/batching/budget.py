"""The padded-volume budget a model's batches keep to when nobody set one
(``max_batch_tokens = "auto"``, the default), learnt from what its batches
cost. Pure code: no threads, no clocks.

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
  is the largest bucket seen so far (bigger batches may be cheaper still):
  a smaller batch costs its callers less waiting, and lets the next batch
  form while it runs;
* every ``EXPLORE_EVERY``-th batch may go one bucket over the budget, so a
  bucket whose cost changed (the machine got quieter, a GPU was freed) is
  measured again and the budget climbs back.

A bucket counts once it has ``MIN_BATCHES`` batches, and a budget needs two
such buckets: until then there is none, and the full batches of a loaded
server measure the big buckets.
"""

from __future__ import annotations


class LearntBudget:
    """Written by the finisher thread (``observe``), read by the thread that
    forms batches (``limit``); each call reads or replaces whole values."""

    ALPHA = 0.1  # weight of the newest batch in a bucket's average
    MIN_BATCHES = 4
    EXPLORE_EVERY = 16
    # The smallest bucket within this of the cheapest wins: on 2 cores a
    # tolerance of 0.2 served the GRU tagger 0.97-0.98x of no budget where the
    # cheapest bucket alone (0) served it 0.83-0.97x, the tagger 1.40x/1.40x of
    # the old defaults (0: 1.23x/1.41x), the attention tagger 1.65x/1.43x
    # (0: 1.74x/1.52x). Smaller batches pipeline better with the event loop
    # than the forward's cost alone tells (docs/performance.md, "Defaults").
    TOLERANCE = 0.2

    def __init__(self) -> None:
        self._per_element: dict[int, float] = {}  # bucket -> seconds per real element
        self._batches: dict[int, int] = {}
        self._limit: int | None = None
        self._formed = 0

    @staticmethod
    def bucket(padded_volume: int) -> int:
        """The power of two a volume rounds up to: 2**(b-1) < volume <= 2**b."""
        return max(0, padded_volume - 1).bit_length()

    def observe(self, padded_volume: int, real_volume: int, seconds: float) -> None:
        """What one batch that ran cost."""
        if padded_volume < 1 or real_volume < 1 or seconds <= 0:
            return
        bucket = self.bucket(padded_volume)
        cost = seconds / real_volume
        old = self._per_element.get(bucket)
        self._per_element[bucket] = cost if old is None else old + self.ALPHA * (cost - old)
        self._batches[bucket] = self._batches.get(bucket, 0) + 1
        self._limit = self._choose()

    def _choose(self) -> int | None:
        known = {b: c for b, c in self._per_element.items() if self._batches[b] >= self.MIN_BATCHES}
        if len(known) < 2:
            return None
        cheapest = min(known.values())
        within = min(b for b, c in known.items() if c <= cheapest * (1 + self.TOLERANCE))
        return None if within == max(known) else 1 << within

    @property
    def learnt(self) -> int | None:
        """The budget learnt so far (``None``: no budget)."""
        return self._limit

    def limit(self) -> int | None:
        """The budget for the next batch (one bucket more when exploring)."""
        self._formed += 1
        if self._limit is not None and self._formed % self.EXPLORE_EVERY == 0:
            return self._limit * 2
        return self._limit

    def costs(self) -> dict[int, float]:
        """Seconds per real element by bucket top (2**bucket), for the stats."""
        return {1 << b: c for b, c in sorted(self._per_element.items())}
