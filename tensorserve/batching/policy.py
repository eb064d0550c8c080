"""Which waiting items form the next batch. Pure code: no threads, no clocks.

A policy sees the waiting items in arrival order (oldest first) and returns
the indices of the next batch. Two rules bind every policy:

* if the oldest item is overdue (it has waited ``max_queue_delay``), it is in
  the batch: no item starves beyond its deadline plus one batch;
* the batch's padded volume (batch size x padded item size) stays within
  the budget: ``max_batch_tokens`` when one is set, else the one the
  ``LearntBudget`` measured (a lone item always fits). A ``packed`` model's
  batch pads nothing: its volume is the sum of its items' (batching/packing.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from tensorserve.batching.budget import LearntBudget


@dataclass(frozen=True)
class Waiting:
    """What a policy may know of the queue: each waiting item's volume (its
    padded-size proxy: the product of its variable extents), oldest first,
    and whether the oldest is overdue. One per batch formed, not one per
    item: an object per waiting item at every batch cost ~0.4 ms a batch
    with 190 waiting, most of it in the collector."""

    volumes: Sequence[int]
    oldest_overdue: bool = False

    def __len__(self) -> int:
        return len(self.volumes)


class BatchPolicy(Protocol):
    """``select``: indices (into ``waiting.volumes``) of the next batch, never
    empty if something waits. The batcher teaches the ``cost`` model and a
    learnt ``budget`` after every batch (None: the policy has none);
    ``max_batch_tokens`` is the fixed budget, if one was set."""

    @property
    def name(self) -> str: ...
    @property
    def cost(self) -> BatchCostModel | None: ...
    @property
    def max_batch_tokens(self) -> int | None: ...
    @property
    def budget(self) -> LearntBudget | None: ...
    @property
    def packed(self) -> bool: ...
    def select(self, waiting: Waiting, max_batch_size: int) -> list[int]: ...


@dataclass(frozen=True)
class FifoPolicy:
    """Arrival order: the oldest ``max_batch_size`` items (within the budget)."""

    max_batch_tokens: int | None = None
    budget: LearntBudget | None = field(default=None, compare=False)  # when no budget is set
    name: str = "fifo"
    cost: None = None  # arrival order needs no cost model
    packed: bool = False  # the budget counts summed volumes, not size x longest

    def select(self, waiting: Waiting, max_batch_size: int) -> list[int]:
        chosen: list[int] = []
        longest = 0
        limit = budget_for_next_batch(self)
        if self.packed and limit:  # a loop of its own: the padded one stays as it was
            return _first_within_sum(waiting.volumes[:max_batch_size], limit)
        for index, volume in enumerate(waiting.volumes[:max_batch_size]):
            longest = max(longest, volume)
            if chosen and limit and (len(chosen) + 1) * longest > limit:
                break
            chosen.append(index)
        return chosen


def _first_within_sum(volumes: Sequence[int], limit: int) -> list[int]:
    """The oldest items whose volumes sum within ``limit`` (at least one)."""
    total = 0
    for index, volume in enumerate(volumes):
        total += volume
        if index and total > limit:
            return list(range(index))
    return list(range(len(volumes)))


class BatchCostModel:
    """What a batch costs, learnt from the batches the model ran:

        seconds ~ fixed + per_element * size * longest + per_step * longest

    (least squares with exponential forgetting, so it follows a model whose
    speed changes). ``size * longest`` is the padded volume: a transformer on
    a CPU pays for every padded element. ``longest`` alone is what a
    recurrent model pays in sequential steps whatever the batch size; ``fixed``
    is a launch or Python overhead, large on a GPU. The policy weighs real work
    against this cost, so one mechanism serves all three kinds of model.
    Until enough batches of different shapes were seen, ``fitted`` is False.
    The scheduler's loop writes it as batches end and reads one tuple as
    it forms the next.
    """

    MIN_BATCHES = 4

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        # The normal equations, kept in plain floats: numpy's outer product
        # and solve cost ~20 us a batch, most of it per call; this is ~4 us.
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._count = 0
        self.coefficients: tuple[float, float, float] | None = None

    @property
    def fitted(self) -> bool:
        return self.coefficients is not None

    def observe(self, size: int, longest: int, seconds: float) -> None:
        x = (1.0, float(size * longest), float(longest))
        decay = self.decay
        for row, (xtx_row, xi) in enumerate(zip(self._xtx, x)):
            for col in range(3):
                xtx_row[col] = decay * xtx_row[col] + xi * x[col]
            self._xty[row] = decay * self._xty[row] + xi * seconds
        self._count += 1
        if self._count < self.MIN_BATCHES:
            return
        # A whisper of ridge keeps the solve stable when shapes barely vary.
        matrix = [
            [v + (1e-9 * v + 1e-18 if i == j else 0.0) for j, v in enumerate(row)]
            for i, row in enumerate(self._xtx)
        ]
        solution = _solve3(matrix, list(self._xty))
        if solution is None:
            return
        fixed, per_element, per_step = (max(0.0, v) for v in solution)
        # A flat cost (a GPU) fits as ``fixed`` alone: that is learnt too.
        if fixed + per_element + per_step > 0:
            self.coefficients = (fixed, per_element, per_step)

    def cost(self, size: int | np.ndarray, longest: int | np.ndarray) -> float | np.ndarray:
        """Predicted seconds of a batch of ``size`` items padded to ``longest``:
        elementwise over arrays (the policy's grid), one number for numbers."""
        assert self.coefficients is not None
        fixed, per_element, per_step = self.coefficients
        # Grouped as the policy's grid reads it: one product per cell, the same bits.
        return fixed + longest * (per_element * size + per_step)


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` for 3 x 3 ``a`` (overwritten), by Gaussian elimination with
    partial pivoting, as LAPACK's solve does; None if ``a`` is singular."""
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if a[pivot][col] == 0.0 or not math.isfinite(a[pivot][col]):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, 3):
            factor = a[r][col] / a[col][col]
            for c in range(col, 3):
                a[r][c] -= factor * a[col][c]
            b[r] -= factor * b[col]
    x = [0.0] * 3
    for r in (2, 1, 0):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, 3))) / a[r][r]
    return x


# Cells of one block of the length-aware grid (sizes x starts): 128 KB of float64, its
# temporaries in a 1 MB L2 (vs 64 KB: 12-15% faster at 140-512 waiting; 256 KB: 3x slower).
_GRID_CELLS = 16384


@functools.lru_cache(maxsize=32)
def _run_grid(n: int, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    """For the runs of sizes ``low + 1 .. high`` over ``n`` ranked items (rows
    by size, columns by start): each size, a float column, and whether the
    run lies inside the queue. They depend only on the shape, and building
    them was much of a small grid's cost."""
    sizes = np.arange(low + 1, high + 1, dtype=np.float64)[:, None]
    inside = np.arange(n) + sizes <= n
    sizes.flags.writeable = inside.flags.writeable = False  # shared by every call of this shape
    return sizes, inside


@dataclass(frozen=True)
class LengthAwarePolicy:
    """Batches of similar padded size, as infinity does: sort the waiting
    items by size and take a run of neighbours.

    Of all runs (every length up to ``max_batch_size``, within the budget) it
    takes the one that does the most real work per second the
    ``BatchCostModel`` predicts it to take. Until the model has learnt
    anything, it takes the longest run that wastes the least padding. When
    the oldest item is overdue, only runs that contain it are allowed.
    """

    max_batch_tokens: int | None = None
    budget: LearntBudget | None = field(default=None, compare=False)  # when no budget is set
    cost: BatchCostModel = field(default_factory=BatchCostModel, compare=False)
    name: str = "length_aware"
    packed: bool = False  # the budget counts summed volumes, not size x longest

    def select(self, waiting: Waiting, max_batch_size: int) -> list[int]:
        n = len(waiting)
        if n <= 1:  # a lone caller: no choice to make, and no numpy to pay for
            return list(range(n))
        limit, coefficients = budget_for_next_batch(self), self.cost.coefficients
        most = min(max_batch_size, n)
        shortcut = not limit and n <= 3 * most  # (past 3 batches numpy's sort and scan win, hot)
        if shortcut and (chosen := _run_of_most_if_none_shorter_wins(waiting, coefficients, most)):
            return chosen
        volumes = np.fromiter(waiting.volumes, dtype=np.int64, count=n)
        order = np.argsort(volumes, kind="stable")
        ranked = volumes[order].astype(np.float64)
        prefix = np.zeros(n + 1)  # prefix[i]: the volume of the i shortest
        np.cumsum(ranked, out=prefix[1:])
        forced = int(np.flatnonzero(order == 0)[0]) if waiting.oldest_overdue else None
        # Every candidate run ranked[start : start + size] at once, as a
        # (size, start) grid of zero-copy strided views, a block of sizes at
        # a time so that each block stays in cache: a few numpy passes
        # instead of a Python loop of numpy calls per size (~0.3 ms a batch at
        # 64 waiting, benchmarks/results/HISTORY.md). Runs that would reach
        # past the queue's end read repeats of its last item: masked out, but
        # for the learnt cost, where one holds no more than the run from its
        # start to the end at a size as dear, so never comes first. Row-major
        # argmax, strict across blocks, keeps that loop's choice: the best
        # score, then the fewest items, then the first start. With an overdue
        # item only the starts of runs that can hold it, at most ``most`` of
        # them, are columns (under load, the usual case: a grid 64 wide).
        lo, hi = (0, n) if forced is None else (max(0, forced - most + 1), forced + 1)
        width = hi - lo
        longest_all, ends_all = (  # ndarray(): as_strided's views, without its ~5 us a call
            np.ndarray(
                (most, width), np.float64, np.concatenate((a[lo:], np.full(most, a[-1]))), 0, (8, 8)
            )
            for a in (ranked, prefix[1:])
        )
        best = (-np.inf, 0, 0)  # (score, size, start)
        masked = forced is not None or bool(limit) or coefficients is None
        block = max(1, _GRID_CELLS // width)
        for low in range(0, most, block):
            sizes, inside = _run_grid(n, low, min(most, low + block))
            valid = inside[:, lo:hi]
            longest = longest_all[low : low + len(sizes)]
            real = ends_all[low : low + len(sizes)] - prefix[lo:hi]
            if forced is not None:  # only runs that hold it (each column starts at or before it)
                valid = valid & (forced < np.arange(lo, hi) + sizes)  # (<= most columns)
            if limit:
                volume = real if self.packed else sizes * longest
                valid = valid & ((volume <= limit) | (sizes == 1))
            if coefficients is not None:  # real / cost, as BatchCostModel.cost reads, in place
                fixed, per_element, per_step = coefficients
                scores = longest * (per_element * sizes + per_step)  # a column, then the grid
                scores += fixed
                if fixed < 1e-12:  # else every cost is at least that already
                    np.maximum(scores, 1e-12, out=scores)
                np.divide(real, scores, out=scores)
            else:  # most items first, then least waste
                scores = sizes * 1e18 - (sizes * longest - real)
            if masked:
                scores = np.where(valid, scores, -np.inf)
            row, first = divmod(int(np.argmax(scores)), width)
            if scores[row, first] > best[0]:
                best = (float(scores[row, first]), low + row + 1, lo + first)
            if limit and not valid[-1].any():
                break  # longer runs only get bigger
        _, size, start = best
        return np.sort(order[start : start + size]).tolist()


def _run_of_most_if_none_shorter_wins(
    waiting: Waiting, coefficients: tuple[float, float, float] | None, most: int
) -> list[int] | None:
    """The grid's choice if it is the best run of ``most`` (no budget), in plain Python: under a
    flat cost (a GPU's) this skips the grid's ~30 numpy calls, ~250 us a batch after the loop's idle
    wait. Runs of ``most`` are scored with the grid's float operations; none shorter wins if none
    could hold as much real volume (volumes >= 0) over as little cost. None: the grid decides."""
    n, volumes = len(waiting), waiting.volumes
    order = sorted(range(n), key=volumes.__getitem__)  # stable, as the grid's argsort
    ranked = [volumes[i] for i in order]
    prefix = [0, *itertools.accumulate(ranked)]
    if most * prefix[-1] >= 1 << 53:  # sums the grid's float64 would round, wastes near its 1e18
        return None
    forced = order.index(0) if waiting.oldest_overdue else None
    first = 0 if forced is None else max(0, forced - most + 1)
    last = n - most if forced is None else min(forced, n - most)
    ends = range(first + most, last + most + 1)  # each run's end, its longest at end - 1
    if coefficients is None:  # most items first, then least waste (1e18 outweighs any waste)
        scores = [
            most * 1e18 - (most * float(ranked[e - 1]) - (prefix[e] - prefix[e - most]))
            for e in ends
        ]
        start = first + scores.index(max(scores))
        return sorted(order[start : start + most])
    fixed, per_element, per_step = coefficients
    least = max(fixed, 1e-12)  # what any batch costs at least, as the grid counts
    step = per_element * most + per_step
    scores = [
        (prefix[e] - prefix[e - most]) / max(float(ranked[e - 1]) * step + fixed, least)
        for e in ends
    ]
    bar = (best := max(scores)) * (1 - 1e-9)  # a tie goes to fewer items; the margin: floats
    # A shorter run (holding the oldest, when it is overdue) holds at most the
    # real volume of the last such run of most - 1, and costs at least ``least``...
    end = n if forced is None else min(n, forced + most - 1)
    if most > 1 and (prefix[end] - prefix[end - most + 1]) / least >= bar:
        for size in range(1, most):  # ...else each size in turn
            end = n if forced is None else min(n, forced + size)
            longest = ranked[size - 1 if forced is None else max(forced, size - 1)]  # at least
            cost = max(float(longest) * (per_element * size + per_step) + fixed, least)
            if (prefix[end] - prefix[end - size]) / cost >= bar:
                return None
    start = first + scores.index(best)
    return sorted(order[start : start + most])


def budget_for_next_batch(policy: FifoPolicy | LengthAwarePolicy) -> int | None:
    """The padded volume the next batch may reach: the fixed budget, else the
    learnt one (which reads what the last batches taught it, changing nothing)."""
    if policy.max_batch_tokens:
        return policy.max_batch_tokens
    return policy.budget.limit() if policy.budget is not None else None


def make_policy(
    name: str, max_batch_tokens: int | Literal["auto"] | None, packed: bool = False
) -> BatchPolicy:
    """``max_batch_tokens``: a fixed budget, ``"auto"`` (learn one), or
    ``None``/0 (no budget); ``packed``: it counts the items' summed volumes."""
    fixed = max_batch_tokens if isinstance(max_batch_tokens, int) and max_batch_tokens > 0 else None
    budget = LearntBudget() if max_batch_tokens == "auto" else None
    if name == "fifo":
        return FifoPolicy(fixed, budget, packed=packed)
    if name == "length_aware":
        return LengthAwarePolicy(fixed, budget, packed=packed)
    raise ValueError(f"unknown batching policy {name!r}")


def budget_report(policy: BatchPolicy) -> dict[str, Any]:
    """The stats' view of a policy's budget: fixed, none, or learnt (with
    what each bucket of padded volume cost per real element)."""
    if policy.budget is None:
        fixed = policy.max_batch_tokens
        return {"mode": "fixed" if fixed else "none", "max_batch_tokens": fixed}
    return {
        "mode": "learnt",
        "max_batch_tokens": policy.budget.learnt,
        "us_per_element": {str(top): round(1e6 * c, 3) for top, c in policy.budget.costs().items()},
    }
