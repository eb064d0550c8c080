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
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Waiting:
    """What a policy may know of a queued item."""

    volume: int  # padded-size proxy: product of the item's variable extents
    overdue: bool


class BatchPolicy(Protocol):
    name: str
    cost: BatchCostModel | None

    def select(self, waiting: Sequence[Waiting], max_batch_size: int) -> list[int]:
        """Indices (into ``waiting``) of the next batch; never empty if waiting isn't."""
        ...


@dataclass(frozen=True)
class FifoPolicy:
    """Arrival order: the oldest ``max_batch_size`` items (within the budget)."""

    max_batch_tokens: int | None = None
    name: str = "fifo"
    cost: None = None  # arrival order needs no cost model

    def select(self, waiting: Sequence[Waiting], max_batch_size: int) -> list[int]:
        chosen: list[int] = []
        longest = 0
        for index, item in enumerate(waiting[:max_batch_size]):
            longest = max(longest, item.volume)
            if chosen and self.max_batch_tokens and (len(chosen) + 1) * longest > self.max_batch_tokens:
                break
            chosen.append(index)
        return chosen


class BatchCostModel:
    """What a batch costs, learnt from the batches the model ran:
    ``seconds ~ fixed + per_volume * padded_volume`` (least squares with
    exponential forgetting, so it follows a model whose speed changes).

    ``overhead`` is the fixed cost in units of padded volume (``fixed /
    per_volume``): on a CPU, where time grows with every padded element, it is
    small and short, tight batches win; on a GPU, where a launch costs as much
    as many elements, it is large and big batches win. Until enough batches
    with different volumes were seen it is ``inf`` (prefer the biggest batch).
    Thread-safe enough: the finisher thread writes, the dispatcher reads a float.
    """

    MIN_BATCHES = 4

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._count = 0
        self.overhead = math.inf

    def observe(self, padded_volume: float, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1
        self._x = d * self._x + padded_volume
        self._y = d * self._y + seconds
        self._xx = d * self._xx + padded_volume * padded_volume
        self._xy = d * self._xy + padded_volume * seconds
        self._count += 1
        if self._count < self.MIN_BATCHES:
            return
        spread = self._w * self._xx - self._x * self._x
        if spread <= 1e-9 * self._xx * self._w:
            return  # every batch had the same volume: slope unknown
        slope = (self._w * self._xy - self._x * self._y) / spread
        fixed = (self._y - slope * self._x) / self._w
        if slope <= 0:
            self.overhead = math.inf  # bigger batches cost nothing more: fill them
        else:
            self.overhead = max(0.0, fixed / slope)


@dataclass(frozen=True)
class LengthAwarePolicy:
    """Batches of similar padded size, as infinity does: sort the waiting
    items by size and take a run of neighbours.

    Of all runs (every length up to ``max_batch_size``, within the budget) it
    takes the one that does the most real work per unit of cost,
    ``real volume / (overhead + batch size x longest)``, with ``overhead``
    from the ``BatchCostModel``. With an infinite overhead (nothing learnt
    yet) that is the longest run that wastes the least padding. When the
    oldest item is overdue, only runs that contain it are allowed.
    """

    max_batch_tokens: int | None = None
    cost: BatchCostModel = field(default_factory=BatchCostModel, compare=False)
    name: str = "length_aware"

    def select(self, waiting: Sequence[Waiting], max_batch_size: int) -> list[int]:
        n = len(waiting)
        if n == 0:
            return []
        volumes = np.fromiter((w.volume for w in waiting), dtype=np.int64, count=n)
        order = np.argsort(volumes, kind="stable")
        ranked = volumes[order].astype(np.float64)
        prefix = np.concatenate(([0.0], np.cumsum(ranked)))
        forced = int(np.flatnonzero(order == 0)[0]) if waiting[0].overdue else None
        overhead = self.cost.overhead
        best: tuple[float, float, int, int] | None = None  # (score, -size, start, size)
        for size in range(1, min(max_batch_size, n) + 1):
            # Candidate runs ranked[start : start + size].
            first = 0 if forced is None else max(0, forced - size + 1)
            last = n - size if forced is None else min(forced, n - size)
            starts = np.arange(first, last + 1)
            padded = size * ranked[starts + size - 1]
            if self.max_batch_tokens and size > 1:
                fits = padded <= self.max_batch_tokens
                if not fits.any():
                    break  # longer runs only get bigger
                starts, padded = starts[fits], padded[fits]
            real = prefix[starts + size] - prefix[starts]
            if math.isinf(overhead):
                # Most items first, then least waste.
                scores = size * 1e18 - (padded - real)
            else:
                scores = real / (overhead + padded)
            i = int(np.argmax(scores))
            candidate = (float(scores[i]), -size, int(starts[i]), size)
            if best is None or candidate[:2] > best[:2]:
                best = candidate
        assert best is not None  # a run of one always exists
        _, _, start, size = best
        return sorted(int(i) for i in order[start : start + size])


def make_policy(name: str, max_batch_tokens: int | None) -> BatchPolicy:
    if name == "fifo":
        return FifoPolicy(max_batch_tokens)
    if name == "length_aware":
        return LengthAwarePolicy(max_batch_tokens)
    raise ValueError(f"unknown batching policy {name!r}")
