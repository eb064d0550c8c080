"""Which waiting items form the next batch. Pure code: no threads, no clocks.

A policy sees the waiting items in arrival order (oldest first) and returns
the indices of the next batch. Two rules bind every policy:

* if the oldest item is overdue (it has waited ``max_queue_delay``), it is in
  the batch: no item starves beyond its deadline plus one batch;
* the batch's padded volume (batch size x padded item size) stays within
  ``max_batch_tokens`` when a budget is set (a lone item always fits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Waiting:
    """What a policy may know of a queued item."""

    volume: int  # padded-size proxy: product of the item's variable extents
    overdue: bool


class BatchPolicy(Protocol):
    name: str

    def select(self, waiting: Sequence[Waiting], max_batch_size: int) -> list[int]:
        """Indices (into ``waiting``) of the next batch; never empty if waiting isn't."""
        ...


@dataclass(frozen=True)
class FifoPolicy:
    """Arrival order: the oldest ``max_batch_size`` items (within the budget)."""

    max_batch_tokens: int | None = None
    name: str = "fifo"

    def select(self, waiting: Sequence[Waiting], max_batch_size: int) -> list[int]:
        chosen: list[int] = []
        longest = 0
        for index, item in enumerate(waiting[:max_batch_size]):
            longest = max(longest, item.volume)
            if chosen and self.max_batch_tokens and (len(chosen) + 1) * longest > self.max_batch_tokens:
                break
            chosen.append(index)
        return chosen


@dataclass(frozen=True)
class LengthAwarePolicy:
    """Batches of similar padded size, as infinity does: sort the waiting window
    by size and take the run of neighbours that wastes the least padding.

    The run is as long as possible (up to ``max_batch_size``, within the
    budget); among runs of that length it minimises padded-but-empty volume.
    When the oldest item is overdue, only runs that contain it are allowed.
    """

    max_batch_tokens: int | None = None
    name: str = "length_aware"

    def select(self, waiting: Sequence[Waiting], max_batch_size: int) -> list[int]:
        n = len(waiting)
        if n == 0:
            return []
        volumes = np.fromiter((w.volume for w in waiting), dtype=np.int64, count=n)
        order = np.argsort(volumes, kind="stable")
        ranked = volumes[order]
        prefix = np.concatenate(([0], np.cumsum(ranked)))
        forced = int(np.flatnonzero(order == 0)[0]) if waiting[0].overdue else None
        for size in range(min(max_batch_size, n), 0, -1):
            # Candidate runs ranked[start : start + size].
            first = 0 if forced is None else max(0, forced - size + 1)
            last = n - size if forced is None else min(forced, n - size)
            starts = np.arange(first, last + 1)
            longest = ranked[starts + size - 1]
            padded = size * longest
            fits = padded <= self.max_batch_tokens if self.max_batch_tokens else np.ones_like(starts, bool)
            if size == 1 or fits.any():
                waste = padded - (prefix[starts + size] - prefix[starts])
                waste = np.where(fits, waste, np.iinfo(np.int64).max) if size > 1 else waste
                start = int(starts[int(np.argmin(waste))])
                return sorted(int(i) for i in order[start : start + size])
        raise AssertionError("unreachable: a run of one always exists")


def make_policy(name: str, max_batch_tokens: int | None) -> BatchPolicy:
    if name == "fifo":
        return FifoPolicy(max_batch_tokens)
    if name == "length_aware":
        return LengthAwarePolicy(max_batch_tokens)
    raise ValueError(f"unknown batching policy {name!r}")
