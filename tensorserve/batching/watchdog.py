"""The watchdog: no caller waits forever on a forward that never returns.

One thread per model looks at the batch each instance is running, a few
times a second (a hand-written loop: it is ten lines, and a timer per batch
would cost the hot path a thread hand-off). A batch counts from when its
instance started on it: for a batch launched ahead of time, from when the
one before it came back.

Past the limit (``[faults] watchdog_ms``; "auto" is 50x the slowest batch
so far, at least ``AUTO_MIN_S``):

- an executor that can abort (a worker process) kills the worker; the batch
  fails as a crash and is retried split (batching.recovery), so only an
  item that hangs alone fails;
- model threads cannot be killed: the batch's callers are answered at once,
  the instance counts as stuck, and once every instance is stuck the model
  is not ready and refuses new items until a forward comes back. Such an
  instance is ``stuck``: the server's liveness (``serving/liveness.py``)
  fails once one has been stuck longer than ``--liveness-stall-s``, so that
  the process is restarted, since nothing else can free the thread.

Before the limit, ``stalled`` tells readiness a batch has run far longer
than any before it (a frozen worker, a device that stopped answering), so
a model is not reported ready while it cannot run a batch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from tensorserve.batching.delivery import settle
from tensorserve.errors import ModelFailure, ModelNotReady

if TYPE_CHECKING:
    from tensorserve.batching.pipeline import Pipeline
    from tensorserve.batching.results import Batch

log = logging.getLogger(__name__)

AUTO_MIN_S = 30.0
AUTO_FACTOR = 50.0
# Readiness: stalled once a batch has run this many times the slowest so far
# (and at least STALL_MIN_S).
STALL_FACTOR = 4.0
STALL_MIN_S = 1.0
CHECK_EVERY_S = 0.1


class Watchdog:
    def __init__(self, pipeline: Pipeline, limit_s: float | str | None) -> None:
        self.pipeline = pipeline
        self.setting = limit_s  # seconds, "auto", or None / 0: off
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def limit_s(self) -> float | None:
        if self.setting == "auto":
            return max(AUTO_MIN_S, AUTO_FACTOR * self.pipeline.slowest_s)
        return float(self.setting) if self.setting else None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, name=f"{self.pipeline.name}-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            limit = self.limit_s
            if limit is None:
                continue
            for batch, ran_s in self.running(time.perf_counter()):
                if ran_s > limit and not batch.overdue:
                    try:
                        self._expire(batch, ran_s, limit)
                    except Exception:  # pragma: no cover - the watchdog must not die
                        log.exception("model %s: the watchdog failed", self.pipeline.name)

    def running(self, now: float) -> list[tuple[Batch, float]]:
        """The batch each instance is running, and for how long."""
        p = self.pipeline
        with p.lock:
            oldest: dict[int, Batch] = {}
            for batch in p.in_flight:
                if batch.started and not batch.ran:
                    first = oldest.get(batch.instance)
                    if first is None or batch.started < first.started:
                        oldest[batch.instance] = batch
            return [(b, now - max(b.started, p.free_at[b.instance])) for b in oldest.values()]

    def stalled(self) -> str | None:
        """Why the model cannot run a batch now, if a batch has stalled."""
        stall = max(STALL_MIN_S, STALL_FACTOR * self.pipeline.slowest_s)
        limit = self.limit_s
        if limit is not None:
            stall = min(stall, limit)
        for batch, ran_s in self.running(time.perf_counter()):
            if ran_s > stall:
                return (
                    f"instance {batch.instance} has been running one batch for {ran_s:.1f} s "
                    f"(the slowest batch so far took {self.pipeline.slowest_s:.3f} s)"
                )
        return None

    def stuck(self) -> list[tuple[int, float]]:
        """Each instance whose forward the watchdog gave up on and could not
        stop (a model thread), with how long it has been running that batch.
        A forward that comes back clears it (``Pipeline.finish``)."""
        p = self.pipeline
        running = self.running(time.perf_counter())
        with p.lock:
            return [(b.instance, ran_s) for b, ran_s in running if p.hung[b.instance] is b]

    def _expire(self, batch: Batch, ran_s: float, limit: float) -> None:
        p = self.pipeline
        batch.overdue = True
        log.error(
            "model %s: a batch of %d has run %.1f s on instance %d, past the watchdog's %.1f s",
            p.name,
            len(batch.entries),
            ran_s,
            batch.instance,
            limit,
        )
        launched = batch.launched
        if launched is not None and p.executor.abort(
            launched, f"the batch ran longer than {limit:g} s"
        ):
            return  # the worker is killed: the batch fails as a crash and is retried split
        error = ModelFailure(
            f"model {p.name!r}: the batch ran longer than the watchdog's {limit:g} s and was "
            f"abandoned; the model is not ready while every instance is stuck"
        )
        with p.cond:
            p.hung[batch.instance] = batch
            stranded = p.queue.drain() if all(p.hung) else []
        settle([(entry, error, True) for entry in batch.entries])
        stuck = ModelNotReady(f"model {p.name!r} is not ready: every instance is stuck in a batch")
        settle([(entry, stuck, True) for entry in stranded])
