"""Recovery: start here. A batch that failed as a whole: what to answer now
and what to run again, so that a fault stays with the items that cause it.

The flow, and where each step lives:

    a batch ends    Scheduler._completed, on the scheduler's loop: its
                    instance's ``done`` (a result or an error). A worker that
                    died (WorkerCrashed) is repaired first, off the loop
                    (Scheduler._repair -> executor.repair on the control pool;
                    runtime/isolated.py: the standby worker takes its place)
    hung            the watchdog (watchdog.py) aborts a batch past its limit
                    (a worker killed: it ends as a crash, above) or has the
                    scheduler give up on a thread's (Scheduler.give_up)
    plan            Recovery.conclude (below): the one way a completed batch
                    leaves the scheduler. A batch that ran is un-padded and
                    recorded (results.py BatchResults); a failed one is
                    planned (Recovery.plan, the table below; culprit.py sizes
                    a crash's trials from the learnt cost and the restart time;
                    ceiling.py lowers the memory ceiling)
    act             Scheduler._finish runs the Plan: its outcomes are answered
                    (delivery.settle), its retries and trials wait in Reruns,
                    its cleared items rejoin the queue's head
    run again       formation.next_batch takes Reruns first (Reruns.first/instead)

    the model raised RowErrors      those rows fail; the other rows run again
    the worker died before running  its items go back to the queue's head and
      it (a batch queued behind     ride with new items (at most MAX_RERUNS
      the one that killed it)       times per item); a trial runs again as a trial
    out of memory                   the memory ceiling drops, the batch runs again
                                    in halves; an item that does not fit alone fails
                                    with OutOfMemory (its padded size, the ceiling)
    the CUDA context is lost        every item of the batch fails, none runs again:
      (a sticky CUDA error in a     nothing can run on CUDA in this process again;
      thread of this process)       readiness and liveness fail (runtime/device.py).
                                    In a worker process the worker exits instead, and
                                    its batch is a crash like the next row's
    the worker died running it      its items are suspects, searched one trial at a
      (a crash, the watchdog)       time (``Trial``: a few suspects alone, between
                                    ordinary batches; batching.culprit sizes it).
                                    A trial that runs answers its items; one that
                                    crashes clears the crash's other suspects, which
                                    go back to the queue's head. Only an item that
                                    kills its worker alone fails (a lone item whose
                                    worker died runs once more: it may not be the cause).
      a batch launched behind the   a suspect too (a CUDA worker holds two batches), but
      one the worker was running    the crash is not counted against its items
                                    (``WorkerCrashed.behind``); behind a batch the
                                    watchdog killed, it never ran (second row)
    anything else: a poisoned item  the batch runs again in halves, until every
                                    failure is pinned on an item that fails alone

Suspects of different crashes never share a trial: each crash is searched on
its own assumption of one culprit. A second killer cleared by that
assumption only crashes an ordinary batch later, whose items then become
suspects of a crash of their own (``Pending.crashes`` counts each item's).

Splitting in halves costs about 2*log2(B) extra runs for one bad item in a
batch of B (each level runs two halves, one of which is good). With the
per-model switch ``[faults] split_failed_batches = false`` the whole batch
fails, as every other batching server does.

This module only plans: no threads, no futures. The scheduler runs what
``Reruns`` hands it (the retries before any new batch, a trial every other
batch), puts cleared items back at its queue's head, and settles the outcomes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorserve.batching import culprit
from tensorserve.batching.admission import Outcome, Pending
from tensorserve.batching.batch import Batch
from tensorserve.batching.ceiling import MemoryCeiling
from tensorserve.batching.policy import BatchCostModel
from tensorserve.batching.results import BatchResults
from tensorserve.batching.stats import BatchStats
from tensorserve.errors import (
    BatchOutOfMemory,
    DeviceLost,
    MemoryTight,
    ModelFailure,
    OutOfMemory,
    RowErrors,
    WorkerCrashed,
)

log = logging.getLogger("tensorserve.batching.results")  # where these lines were logged

# A batch whose worker died before running it goes back to the queue; an item
# caught in that more often than this fails (a worker that keeps dying). The
# evidence: with a worker killer every second on the flat 100 ms probe
# (benchmarks/crash_probe.py --killer-every-s 1.0 --rounds 2, 2026-11-28,
# 2-core VM: 60 killers, 30 batches sent again), the most times one innocent
# item was sent again was 2 (stats' ``most_reruns``), and no good caller
# failed. 3 is one more than that; a worker that keeps dying with no item at
# fault crashes ordinary batches too, whose items the crash search ends.
MAX_RERUNS = 3


@dataclass(eq=False)
class Trial:
    """Suspects of one crash run in a batch of their own (nothing else in it,
    nothing queued behind it). ``rest``: the crash's other suspects, whose
    fate it decides: cleared if the trial crashes, searched next if it runs."""

    suspects: list[Pending]
    rest: list[Pending] = field(default_factory=list)


@dataclass
class Plan:
    outcomes: list[Outcome] = field(default_factory=list)  # settle these now
    retries: list[list[Pending]] = field(default_factory=list)  # run each again, alone, first
    trials: list[Trial] = field(default_factory=list)  # search a crash's suspects
    cleared: list[Pending] = field(default_factory=list)  # back to the queue's head

    def __add__(self, other: Plan) -> Plan:
        return Plan(
            self.outcomes + other.outcomes,
            self.retries + other.retries,
            self.trials + other.trials,
            self.cleared + other.cleared,
        )


class Reruns:
    """What recovery has the scheduler run besides its queue, and when: the
    parts of a poisoned batch first, before any new batch; a crash's trials
    every other batch (the slot after a trial serves the queue, so a search
    costs the queue one slot a trial: with a worker killer every second on
    the flat 100 ms probe, good callers kept 81-84% of their clean goodput,
    against 58-66% when the search ran before any new batch;
    ``benchmarks/crash_probe.py --killer-every-s 1.0``). Either goes alone, on
    an idle instance: it may fail again, and a batch sent behind it would
    only come back unrun. The scheduler's loop's alone."""

    def __init__(self) -> None:
        self.retries: deque[list[Pending]] = deque()
        self.trials: deque[Trial] = deque()
        self.tried_last = False  # the last batch dispatched was a trial

    def __bool__(self) -> bool:
        return bool(self.retries or self.trials)

    def add(self, plan: Plan) -> None:
        self.retries.extend(plan.retries)
        self.trials.extend(plan.trials)

    def first(self, ahead: bool) -> tuple[list[Pending], list[Pending] | None] | None:
        """What goes before the queue's next batch on an instance (``ahead``:
        one that holds a batch already): entries, and for a trial the rest of
        its suspects (``Batch.rest``); ``[]``: nothing now; None: the queue's turn."""
        if self.retries:
            return ([] if ahead else self.retries.popleft()), None
        if self.trials and (ahead or not self.tried_last):
            return self.instead(ahead)
        return None

    def instead(self, ahead: bool) -> tuple[list[Pending], list[Pending] | None]:
        """When the queue has no batch due: a trial need not wait."""
        if ahead or not self.trials:
            return [], None
        trial = self.trials.popleft()
        return trial.suspects, trial.rest

    def drain(self) -> list[Pending]:
        """Every entry waiting here, which leaves (the scheduler answers them)."""
        entries = [entry for part in self.retries for entry in part]
        entries += [entry for trial in self.trials for entry in (*trial.suspects, *trial.rest)]
        self.retries.clear()
        self.trials.clear()
        return entries


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

    def conclude(self, batch: Batch, results: BatchResults) -> Plan:
        """A finished batch's answers, and the parts of a failed one to run
        again: the one way a completed batch leaves the scheduler
        (``Scheduler._finish``). Whatever goes wrong here, every caller gets
        an answer."""
        name = self.name
        try:
            plan = self.plan(batch)
            if plan is not None:
                # It ran, so it counts, with the items that failed for good.
                results.record(batch, plan.outcomes)
            else:
                plan = self.ended(batch, results.outcomes(batch))
                fit = batch.padded.padded_elements if batch.padded is not None else 0
                if batch.error is None and self.ceiling.fitted(fit):
                    log.info(
                        "model %s: trying batches of up to %d padded elements again",
                        name,
                        self.ceiling.limit,
                    )
        except BaseException as exc:  # a bug in un-padding, stats or the cost model
            log.exception("batcher %s: finishing a batch failed", name)
            error = ModelFailure(f"model {name!r}: finishing the batch failed: {exc!r}")
            every = [*batch.entries, *(batch.rest or ())]
            return self.answer([(entry, error, True) for entry in every])
        parts = [*plan.retries, *(trial.suspects for trial in plan.trials)]
        if batch.error is not None and (parts or plan.cleared):
            log.warning(
                "model %s: a batch of %d failed (%s); running it again as %s; %d back to the queue",
                name,
                len(batch.entries),
                batch.error,
                " + ".join(str(len(part)) for part in parts) or "-",
                len(plan.cleared),
            )
        return plan

    def plan(self, batch: Batch) -> Plan | None:
        """None: the batch ends as usual (``BatchResults.outcomes``, then ``ended``)."""
        if batch.error is None:
            return None
        plan = self._failed(batch)
        return None if plan is None else plan + self._after_trial(batch)

    def ended(self, batch: Batch, outcomes: list[Outcome]) -> Plan:
        """A batch that ended as usual answers ``outcomes``; a trial that ran
        leaves the culprit among the rest of its suspects."""
        return Plan(outcomes) + self._after_trial(batch)

    def answer(self, outcomes: list[Outcome]) -> Plan:
        """Only answers (a batch whose planning failed)."""
        return Plan(outcomes)

    def search(self, suspects: list[Pending]) -> Trial:
        """The first trial of a crash's suspects (a crashed batch's, or a trial's)."""
        if len(suspects) == 1:
            return Trial(suspects)
        size = self.trial_size(suspects)
        self.stats.record_recovery("halves" if size > 1 else "singles")
        return Trial(suspects[:size], suspects[size:])

    def _failed(self, batch: Batch) -> Plan | None:
        error, entries = batch.error, batch.entries
        if isinstance(error, DeviceLost):
            return Plan([(entry, error, True) for entry in entries])
        if isinstance(error, RowErrors):
            return self._rows(entries, error)
        if isinstance(error, WorkerCrashed) and not error.ran:
            return self._rerun(entries, error, batch.rest)
        if isinstance(error, BatchOutOfMemory):
            padded = batch.padded.padded_elements if batch.padded is not None else 0
            transient = self.ceiling.ran_out(padded)
            for entry in entries:
                entry.out_of_memory += 1
            # Alone from the start (not the last of a split, whose siblings of
            # its size fit: the item itself is the cause) and as large as a
            # batch that fit: memory is tight now, not too small.
            if len(entries) == 1 and transient and entries[0].out_of_memory == 1:
                tight = MemoryTight(
                    f"model {self.name!r}: the device's memory was too tight for this item just "
                    f"now: it pads to {padded} elements, and a batch at least as large fit "
                    f"since memory last ran out ({error}); retry"
                )
                return Plan([(entries[0], tight, True)])
            if len(entries) == 1:
                alone = OutOfMemory(
                    f"model {self.name!r}: this item does not fit in memory even alone: it "
                    f"pads to {padded} elements, and batches now form under "
                    f"{self.ceiling.limit} elements ({error}); send a smaller item"
                )
                return Plan([(entries[0], alone, True)])
        if isinstance(error, WorkerCrashed) and error.behind:
            return self._behind(entries, batch.rest)
        if isinstance(error, WorkerCrashed):
            for entry in entries:
                entry.crashes += 1
            if len(entries) == 1:
                return self._crashed_alone(entries[0], error)
            if self.split:
                return Plan(trials=[self.search(entries)])
        if len(entries) == 1 or not self.split:
            return None  # the model's own error: for this item alone, or the whole batch
        half = len(entries) // 2
        self.stats.record_recovery("oom" if isinstance(error, BatchOutOfMemory) else "split")
        return Plan(retries=[entries[:half], entries[half:]])

    def _after_trial(self, batch: Batch) -> Plan:
        """Where a trial sends the rest of its crash's suspects."""
        rest, error = batch.rest, batch.error
        if not rest or (isinstance(error, WorkerCrashed) and (not error.ran or error.behind)):
            # An ordinary batch; or a trial that never ran, or ran behind the
            # crash: it runs again (_rerun, _behind).
            return Plan()
        if isinstance(error, WorkerCrashed):
            return Plan(cleared=rest)  # the trial held the culprit
        return Plan(trials=[self.search(rest)])  # it ran: the culprit is among the rest

    def trial_size(self, suspects: list[Pending]) -> int:
        """How many of a crash's suspects to try next (batching.culprit): one
        until both the cost model and a restart's time have been measured, as
        one at a time kills the fewest workers."""
        cost, restart_s = self.cost, self.restart_s()
        if cost is None or not cost.fitted or restart_s is None:
            return 1
        longest = max(entry.volume for entry in suspects)
        forward = lambda size: float(cost.cost(size, longest))
        return culprit.next_trial(len(suspects), forward, restart_s)

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

    def _rerun(
        self, entries: list[Pending], error: WorkerCrashed, rest: list[Pending] | None
    ) -> Plan:
        """Items that never ran are no suspects: back to the queue's head; a
        trial that never ran runs again as the same trial (``rest``: its crash's
        other suspects; a list, possibly empty, for a trial, None otherwise)."""
        for entry in entries:
            entry.reruns += 1
        self.stats.record_reruns(max((entry.reruns for entry in entries), default=0))
        spent = [(entry, error, True) for entry in entries if entry.reruns > MAX_RERUNS]
        again = [entry for entry in entries if entry.reruns <= MAX_RERUNS]
        if again:
            self.stats.record_recovery("rerun")
        if rest is None:
            return Plan(spent, cleared=again)
        if again:
            return Plan(spent, trials=[Trial(again, rest)])
        return Plan(spent, trials=[self.search(rest)] if rest else [])

    def _behind(self, entries: list[Pending], rest: list[Pending] | None) -> Plan | None:
        """The worker died while this batch waited behind the one it was
        running (a CUDA worker holds two, ``WorkerCrashed.behind``): it may
        have run and caused the crash, so its items are searched as suspects,
        but the crash is not counted against them (``Pending.crashes``): an
        innocent item queued behind a killer again and again must not fail
        for it. A culprit is counted when its own trial crashes. A trial runs
        again as the same trial. None: the whole batch fails (no splitting)."""
        if rest is not None:
            return Plan(trials=[Trial(entries, rest)])
        if len(entries) == 1:
            self.stats.record_recovery("rerun")
            return Plan(trials=[Trial(entries)])
        if self.split:
            return Plan(trials=[self.search(entries)])
        return None

    def _crashed_alone(self, entry: Pending, error: WorkerCrashed) -> Plan:
        """A worker died running this item alone. The first time (a lone
        request: the worker may have died of something else) it runs once
        more; an item already in two crashed batches is the cause."""
        if entry.crashes < 2:
            self.stats.record_recovery("rerun")
            return Plan(trials=[Trial([entry])])
        why = (
            f"alone ran longer than the watchdog allows, so its worker process was killed "
            f"({error.message})"
            if error.watchdog
            else f"crashed the model's worker process ({error.message}); it is not retried"
        )
        return Plan([(entry, ModelFailure(f"model {self.name!r}: this item {why}"), True)])
