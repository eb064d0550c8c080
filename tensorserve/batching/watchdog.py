"""The watchdog: no caller waits forever on a forward that never returns.

A timer on the scheduler's loop looks at the batch each instance is
running, a few times a second. A batch counts from when its instance
started on it: for a batch queued behind another, from when the one before
it came back. The watchdog only detects: the scheduler, whose loop it runs
on, answers the callers.

Past the limit (``[faults] watchdog_ms``; "auto" is 50x the slowest batch
so far, at least ``AUTO_MIN_S``):

- an executor that can abort (a worker process) kills the worker; the batch
  fails as a crash and is retried split (batching.recovery), so only an
  item that hangs alone fails;
- a forward in a thread cannot be killed: the batch's callers are answered
  at once and the instance is ``stuck``; once every instance is, the model
  is not ready and refuses new items until a forward comes back. Liveness
  (``serving/liveness.py``) fails once one has been stuck longer than
  ``--liveness-stall-s``: only a restart of the process frees the thread.

Before the limit, ``health`` tells readiness a batch has stalled: run far
longer than any before it (a frozen worker, a device that stopped answering).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tensorserve.batching.admission import Outcome, Pending
from tensorserve.batching.batch import Batch
from tensorserve.errors import ModelFailure, ModelNotReady

log = logging.getLogger(__name__)

# The "auto" limit picks an outcome (a worker killed, a thread's callers
# answered 500), so it errs late. Why these two numbers:
# - AUTO_FACTOR: it multiplies the slowest recent *real* batch, the largest
#   that traffic formed, not a typical one. What still slows such a batch on
#   a healthy model is the host (a neighbour, a container's CPU quota, a GC
#   pause), by small factors: across the five bundled models under 32
#   callers, no batch took more than 1.65x the slowest before it, with a
#   neighbour spinning on every CPU as well (load average 5.5 on 2 CPUs;
#   benchmarks/batch_time_spread.py, 2026-11-28, 2-core VM). 50x is 30 times
#   that. It errs so far late because of the asymmetry, also measured: a
#   false kill costs a worker restart and a crash search (35 ms to the next
#   answer and the re-runs, benchmarks/worker_crash.py), a late one only the
#   hung callers' wait.
# - AUTO_MIN_S: a first batch of a new shape compiles kernels or grows the
#   allocator (seconds on a GPU); below 30 s "auto" would kill those. A
#   number in [faults] watchdog_ms replaces both for a model that knows.
AUTO_MIN_S = 30.0
AUTO_FACTOR = 50.0
# "The slowest batch so far" halves every this many seconds without a batch as
# slow: one slow batch (a cold cache, a pause of the host) sets the auto limit
# and the stall threshold for minutes, not for the process's life. It only
# lowers a limit at least AUTO_MIN_S long: a model whose batches really are
# slow sets it again with every such batch.
SLOWEST_HALF_LIFE_S = 600.0
# Readiness (a stall is reversible: the model is ready again when the batch
# returns): stalled once a batch has run STALL_FACTOR times the slowest so
# far, and at least STALL_MIN_S. 4x is 2.4 times the worst a healthy batch
# was measured to reach (1.65x, the same run as AUTO_FACTOR's evidence); the
# 1 s floor covers the first batches, while the slowest so far still grows.
STALL_FACTOR = 4.0
STALL_MIN_S = 1.0
CHECK_EVERY_S = 0.1


def abandoned(
    name: str, limit: float, hung: Batch, held: list[Batch], stranded: list[Pending]
) -> list[Outcome]:
    """The answers when the scheduler gives up on ``hung`` (a forward in a
    thread past ``limit``): its callers; those of the batches ``held`` with
    it on its instance, queued behind it; and ``stranded``, the queue's once
    every instance is stuck."""
    error = ModelFailure(
        f"model {name!r}: the batch ran longer than the watchdog's {limit:g} s and was "
        f"abandoned; the model is not ready while every instance is stuck"
    )
    behind = ModelFailure(
        f"model {name!r}: this item's batch was queued behind one that ran longer "
        f"than the watchdog's {limit:g} s on the same instance, and was abandoned with it"
    )
    stuck = ModelNotReady(f"model {name!r} is not ready: every instance is stuck in a batch")
    return [
        (entry, error if batch is hung else behind, True)
        for batch in held
        for entry in batch.entries
    ] + [(entry, stuck, True) for entry in stranded]


class SlowestBatch:
    """The slowest batch seen, decaying (``SLOWEST_HALF_LIFE_S``); warm-up
    batches are forgotten (``forget``): a model's first runs compile and
    allocate, and one 10 s warm-up batch would set a 500 s auto limit."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seconds = 0.0
        self._at = clock()

    def seconds(self) -> float:
        elapsed = max(0.0, self._clock() - self._at)
        return self._seconds * 0.5 ** (elapsed / SLOWEST_HALF_LIFE_S)

    def observe(self, seconds: float) -> None:
        now = self.seconds()
        if seconds >= now:
            self._seconds, self._at = seconds, self._clock()

    def forget(self) -> None:
        self._seconds = 0.0


class Abortable(Protocol):
    def abort(self, launched: Any, because: str) -> bool: ...


class Watched(Protocol):
    """What the watchdog reads of the scheduler it watches, and the one thing
    it asks of it (``give_up``); the scheduler is the one implementation."""

    @property
    def name(self) -> str: ...
    @property
    def slowest_s(self) -> float: ...
    @property
    def accepting(self) -> bool: ...
    @property
    def running(self) -> Sequence[Sequence[Batch]]: ...
    @property
    def hung(self) -> Sequence[Batch | None]: ...
    @property
    def free_at(self) -> Sequence[float]: ...
    @property
    def instances(self) -> Abortable: ...

    def give_up(self, batch: Batch, limit: float) -> None: ...


class Watchdog:
    def __init__(self, scheduler: Watched, limit_s: float | str | None) -> None:
        self.scheduler = scheduler
        self.setting = limit_s  # seconds, "auto", or None / 0: off
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def limit_s(self) -> float | None:
        if self.setting == "auto":
            return max(AUTO_MIN_S, AUTO_FACTOR * self.scheduler.slowest_s)
        return float(self.setting) if self.setting else None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Look every ``CHECK_EVERY_S`` (from any thread)."""
        self._loop = loop
        loop.call_soon_threadsafe(self._schedule)

    def stop(self) -> None:
        """On the loop."""
        self._loop = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        if self._loop is not None:
            self._timer = self._loop.call_later(CHECK_EVERY_S, self._check)

    def _check(self) -> None:
        try:
            limit = self.limit_s
            if limit is not None:
                for batch, ran_s in self.running(time.perf_counter()):
                    if ran_s > limit and not batch.overdue:
                        self._expire(batch, ran_s, limit)
        except Exception:  # pragma: no cover - the watchdog must not die
            log.exception("model %s: the watchdog failed", self.scheduler.name)
        self._schedule()

    def running(self, now: float) -> list[tuple[Batch, float]]:
        """The batch each instance is running, and for how long (from any
        thread: it reads a copy of each instance's list). A batch queued
        behind it is covered with it: past the limit, an abort fails both (a
        worker's death) and ``Scheduler.give_up`` answers both."""
        s = self.scheduler
        found = []
        for instance, batches in enumerate(s.running):
            oldest = next((b for b in list(batches) if b.started), None)
            if oldest is not None:
                found.append((oldest, now - max(oldest.started, s.free_at[instance])))
        return found

    def health(self) -> str | None:
        """Why no batch can run now (None: one can): every instance is stuck,
        or a batch has stalled."""
        if self._every_instance_hung():
            return "every instance is stuck in a batch past the watchdog's limit"
        stall = max(STALL_MIN_S, STALL_FACTOR * self.scheduler.slowest_s)
        limit = self.limit_s
        if limit is not None:
            stall = min(stall, limit)
        for batch, ran_s in self.running(time.perf_counter()):
            if ran_s > stall:
                return (
                    f"instance {batch.instance} has been running one batch for {ran_s:.1f} s "
                    f"(the slowest batch so far took {self.scheduler.slowest_s:.3f} s)"
                )
        return None

    @property
    def can_admit(self) -> bool:
        """Accepting, and some instance can run a batch (a hint, unlocked:
        admission itself checks under the lock)."""
        return self.scheduler.accepting and not self._every_instance_hung()

    def refuse_if_hung(self) -> None:
        """No instance can run a batch: answer now instead of queueing."""
        if self._every_instance_hung():
            raise ModelNotReady(
                f"model {self.scheduler.name!r} is not ready: every instance is stuck in a "
                f"batch that ran past the watchdog's limit"
            )

    def _every_instance_hung(self) -> bool:
        return self._loop is not None and all(self.scheduler.hung)

    def stuck(self) -> list[tuple[int, float]]:
        """Each instance whose forward the watchdog gave up on and could not
        stop (a thread), with how long it has been running that batch. A
        forward that comes back clears it (``Scheduler._completed``)."""
        s, now = self.scheduler, time.perf_counter()
        return [
            (instance, now - max(b.started, s.free_at[instance]))
            for instance, b in enumerate(list(s.hung))
            if b is not None
        ]

    def _expire(self, batch: Batch, ran_s: float, limit: float) -> None:
        """On the loop: abort the batch, or tell the scheduler to give up on
        the instance, which answers the callers."""
        s = self.scheduler
        batch.overdue = True
        log.error(
            "model %s: a batch of %d has run %.1f s on instance %d, past the watchdog's %.1f s",
            s.name,
            len(batch.entries),
            ran_s,
            batch.instance,
            limit,
        )
        because = f"the batch ran longer than {limit:g} s"
        if batch.launched is not None and s.instances.abort(batch.launched, because):
            return  # the worker is killed: the batch fails as a crash and is retried split
        s.give_up(batch, limit)
