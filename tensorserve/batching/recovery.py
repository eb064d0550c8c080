"""A batch that failed as a whole: what to answer now and what to run again,
so that a fault stays with the items that cause it.

    the model raised RowErrors      those rows fail; the other rows run again
    the worker died before running  the batch runs again whole, on the replacement
      it (a batch queued behind     (at most MAX_RERUNS times per item)
      the one that killed it)
    out of memory                   the memory ceiling drops, the batch runs again
                                    in halves; an item that does not fit alone fails
                                    with OutOfMemory (its padded size, the ceiling)
    the CUDA context is lost        every item of the batch fails, none runs again:
      (a sticky CUDA error in a     nothing can run on CUDA in this process again;
      thread of this process)       readiness and liveness fail (runtime/device.py).
                                    In a worker process the worker exits instead, and
                                    its batch is a crash like the next row's
    the worker died running it      the items run again in halves or one at a time,
      (a crash, the watchdog)       whichever the model's cost and the measured restart
                                    time make cheaper (batching.culprit): only the item
                                    that kills its worker alone fails (a lone item whose
                                    worker died runs once more: it may not be the cause)
    anything else: a poisoned item  the batch runs again in halves, until every
                                    failure is pinned on an item that fails alone

Splitting in halves costs about 2*log2(B) extra runs for one bad item in a
batch of B (each level runs two halves, one of which is good). With the
per-model switch ``[faults] split_failed_batches = false`` the whole batch
fails, as every other batching server does.

This module only plans: no threads, no futures. The scheduler runs the
retries before any new batch (``Scheduler.retries``) and settles the outcomes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tensorserve.batching import culprit
from tensorserve.batching.admission import Outcome, Pending
from tensorserve.batching.policy import BatchCostModel
from tensorserve.batching.results import Batch
from tensorserve.batching.stats import BatchStats
from tensorserve.errors import (
    BatchOutOfMemory,
    DeviceLost,
    ModelFailure,
    OutOfMemory,
    RowErrors,
    WorkerCrashed,
)

# A batch whose worker died before running it is sent again whole; an item
# caught in that more often than this fails (a worker that keeps dying).
MAX_RERUNS = 3


@dataclass
class Plan:
    outcomes: list[Outcome] = field(default_factory=list)  # settle these now
    retries: list[list[Pending]] = field(default_factory=list)  # run each again, alone


class MemoryCeiling:
    """A learned bound on one batch's padded elements: halved below a batch
    that ran out of memory, raised again slowly (by ``GROWTH`` after every
    ``GROW_AFTER`` batches that fit) so one bad moment does not shrink the
    model's batches forever. The queue forms batches under it.

    Where the executor can tell how much device memory is free (``free_bytes``:
    CUDA, in this process), the ceiling grows only once more is free than when
    the batch ran out: on a GPU that other processes share, growing blindly
    would run out again on purpose, over and over."""

    GROW_AFTER = 32
    GROWTH = 1.25

    def __init__(self, free_bytes: Callable[[], int | None] = lambda: None) -> None:
        self.limit: int | None = None  # None: nothing learned yet
        self._fitted = 0
        self._free_bytes = free_bytes
        self._free_when_out: int | None = None  # bytes free after the last batch ran out

    def ran_out(self, padded_elements: int) -> None:
        below = max(1, padded_elements // 2)
        self.limit = below if self.limit is None else min(self.limit, below)
        self._fitted = 0
        self._free_when_out = self._free_bytes()

    def fitted(self) -> bool:
        """A batch fit; True when the limit just went up."""
        if self.limit is None:
            return False
        self._fitted += 1
        if self._fitted < self.GROW_AFTER:
            return False
        self._fitted = 0
        if self._free_when_out is not None:
            free = self._free_bytes()
            if free is not None and free < self._free_when_out * self.GROWTH:
                return False  # no more room than when it ran out
        self.limit = int(self.limit * self.GROWTH) + 1
        return True


class Recovery:
    """Plans what failed batches become. ``cost`` is the model's learnt cost
    model (taught by ``BatchResults``, only read here); ``restart_s`` reads
    the executor's measured seconds to restart a worker (None: none yet);
    ``free_bytes`` its device's free memory (None: unknown)."""

    def __init__(
        self,
        name: str,
        split: bool,
        stats: BatchStats,
        cost: BatchCostModel | None,
        restart_s: Callable[[], float | None],
        free_bytes: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.name = name
        self.split = split
        self.stats = stats
        self.cost = cost
        self.restart_s = restart_s
        self.ceiling = MemoryCeiling(free_bytes)

    def plan(self, batch: Batch) -> Plan | None:
        """None: the batch ends as usual (``BatchResults.outcomes``)."""
        error, entries = batch.error, batch.entries
        if error is None:
            return None
        if isinstance(error, DeviceLost):
            return Plan([(entry, error, True) for entry in entries])
        if isinstance(error, RowErrors):
            return self._rows(entries, error)
        if isinstance(error, WorkerCrashed) and not error.ran:
            return self._rerun(entries, error)
        if isinstance(error, BatchOutOfMemory):
            padded = batch.padded.padded_elements if batch.padded is not None else 0
            self.ceiling.ran_out(padded)
            if len(entries) == 1:
                alone = OutOfMemory(
                    f"model {self.name!r}: this item does not fit in memory even alone: it "
                    f"pads to {padded} elements, and batches now form under "
                    f"{self.ceiling.limit} elements ({error}); send a smaller item"
                )
                return Plan([(entries[0], alone, True)])
        if isinstance(error, WorkerCrashed):
            for entry in entries:
                entry.crashes += 1
            if len(entries) == 1:
                return self._crashed_alone(entries[0], error)
        if len(entries) == 1 or not self.split:
            return None  # the model's own error: for this item alone, or the whole batch
        half = len(entries) // 2
        if isinstance(error, WorkerCrashed):
            search = self.crash_search(entries)
            self.stats.record_recovery(search)
            if search == "singles":
                return Plan(retries=[[entry] for entry in entries])
        else:
            self.stats.record_recovery("oom" if isinstance(error, BatchOutOfMemory) else "split")
        return Plan(retries=[entries[:half], entries[half:]])

    def crash_search(self, entries: list[Pending]) -> culprit.Search:
        """Halves or singles for a crashed batch (batching.culprit): singles
        until both the cost model and a restart's time have been measured, as
        singles kill the fewest workers."""
        cost, restart_s = self.cost, self.restart_s()
        if cost is None or not cost.fitted or restart_s is None:
            return "singles"
        longest = max(entry.volume for entry in entries)
        return culprit.choose(len(entries), lambda size: float(cost.cost(size, longest)), restart_s)

    def _rows(self, entries: list[Pending], error: RowErrors) -> Plan:
        bad = sorted(error.errors)
        if not bad or bad[0] < 0 or bad[-1] >= len(entries):
            failure = ModelFailure(
                f"model {self.name!r} raised RowErrors for rows {bad} of a batch of "
                f"{len(entries)} rows"
            )
            return Plan([(entry, failure, True) for entry in entries])
        self.stats.record_recovery("rows")
        why = error.errors
        failed = [
            (entry, ModelFailure(f"model {self.name!r} failed this item: {why[row]}"), True)
            for row, entry in enumerate(entries)
            if row in why
        ]
        rest = [entry for row, entry in enumerate(entries) if row not in why]
        return Plan(failed, [rest] if rest else [])

    def _rerun(self, entries: list[Pending], error: WorkerCrashed) -> Plan:
        for entry in entries:
            entry.reruns += 1
        spent = [(entry, error, True) for entry in entries if entry.reruns > MAX_RERUNS]
        again = [entry for entry in entries if entry.reruns <= MAX_RERUNS]
        if again:
            self.stats.record_recovery("rerun")
        return Plan(spent, [again] if again else [])

    def _crashed_alone(self, entry: Pending, error: WorkerCrashed) -> Plan:
        """A worker died running this item alone. The first time (a lone
        request: the worker may have died of something else) it runs once
        more; an item already in two crashed batches is the cause."""
        if entry.crashes < 2:
            self.stats.record_recovery("rerun")
            return Plan(retries=[[entry]])
        why = (
            f"alone ran longer than the watchdog allows, so its worker process was killed "
            f"({error.message})"
            if error.watchdog
            else f"crashed the model's worker process ({error.message}); it is not retried"
        )
        return Plan([(entry, ModelFailure(f"model {self.name!r}: this item {why}"), True)])
