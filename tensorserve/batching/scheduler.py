"""The scheduler of one model: the one owner of every batch, as in Triton.

It runs on one event loop (the server's, or a private one on a thread of its
own) and is the only code that forms a batch, pads it, hands it to an
instance, receives its completion, un-pads it and answers its callers:

    admit (any thread) ─▶ queue ─▶ _pump: next_batch ─▶ pad ─▶ instance.dispatch
                                                                  │
         caller ◀─ settle ◀─ un-pad ◀─ _completed ◀── done ◀──────┘
                                            │
     retries, trials, cleared (recovery) ◀─┘   the next batch: _pump

How a batch forms is walked in ``formation.py``; what a failed one becomes,
in ``recovery.py``. An instance only runs a padded batch and calls ``done``: a worker process
(``LoopExecutor``: its socket is written and read by this loop, never
blocking it) or a thread of this process (``instances.InstanceThreads``).
Each instance holds up to two batches where its executor overlaps (CUDA, a
worker), so the next one is padded and queued while one runs; a second
batch is formed only if it cannot grow any more (``AdmissionQueue.take``).

Who owns what: what ``__init__`` sets below ``lock`` is the loop's alone;
the queue is shared with admitting callers (any thread) under ``lock``; the
watchdog is a timer on this loop; statistics lock themselves. Failed batches
come back here too: what recovery plans runs first, or every other batch
(``recovery.Reruns``); items a crash's trial cleared rejoin the queue's head.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from tensorserve.batching.admission import AdmissionQueue, BatcherOptions, Outcome, Pending
from tensorserve.batching.batch import Batch
from tensorserve.batching.collate import Collator
from tensorserve.batching.delivery import settle
from tensorserve.batching.executor import BatchOutputs, Executor, LoopExecutor
from tensorserve.batching.formation import next_batch
from tensorserve.batching.instances import InstanceThreads
from tensorserve.batching.loop_thread import Alarm, SchedulerLoop
from tensorserve.batching.policy import BatchCostModel
from tensorserve.batching.recovery import Recovery, Reruns
from tensorserve.batching.results import BatchResults
from tensorserve.batching.stats import BatchStats
from tensorserve.batching.target import LatencyTarget
from tensorserve.batching.tracer import BatchTracer
from tensorserve.batching.watchdog import SlowestBatch, Watchdog, abandoned
from tensorserve.errors import ModelFailure, ModelNotReady, WorkerCrashed
from tensorserve.pools import control_pool

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        executor: Executor,
        collator: Collator,
        options: BatcherOptions,
        name: str,
        stats: BatchStats,
        on_fatal: Callable[[BaseException], None] | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.executor = executor
        self.clock = clock  # queue time (admission's and deadlines'); made up in tests
        self.instances: LoopExecutor | InstanceThreads = (
            executor if isinstance(executor, LoopExecutor)
            else InstanceThreads(executor, name)  # type: ignore[arg-type]
        )  # fmt: skip
        self.collator = collator
        self.name = name
        self._on_fatal = on_fatal
        count = executor.instance_count
        self.target = (
            None if options.target_p99_ms is None
            else LatencyTarget(options.target_p99_ms, options.max_batch_size,
                               options.max_queue_delay_ms, count)
        )  # fmt: skip
        self.queue = AdmissionQueue(
            options, collator.padded_elements, name, self.target, collator.largest_batch_elements
        )
        # The cost model the policy learns, or one of its own for a policy
        # that needs none: recovery reads it to choose how to find a culprit.
        cost = options.policy.cost or BatchCostModel()
        self.results = BatchResults(collator, options.policy, stats, name, cost, self.target)
        restart_s, free = (lambda: executor.restart_seconds), executor.free_memory_bytes
        self.recovery = Recovery(name, options.split_failed_batches, stats, cost, restart_s, free)
        self.watchdog = Watchdog(self, options.watchdog_s)
        self.tracer: BatchTracer | None = None  # set before start when tracing is on
        # Shared with admitting callers: the queue and these flags.
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # idle (wait_idle, close)
        self.accepting = False
        self.closing = False
        self._idle = True
        self._woken = False  # a wake-up from another thread is already on its way
        # The loop's alone (other threads only read a copy, for health).
        self.running: list[list[Batch]] = [[] for _ in range(count)]  # dispatched, oldest first
        self.depth = 2 if executor.overlaps else 1  # batches an instance may hold at once
        self.reruns = Reruns()  # failed batches' parts and crashes' trials (recovery)
        self.repairing: set[int] = set()  # instances being restored (a new worker)
        self.pinned: int | None = None  # only this instance takes batches (Batcher.pinned)
        self.hung: list[Batch | None] = [None] * count  # forwards the watchdog gave up on
        self.free_at = [0.0] * count  # perf_counter() when each last finished a batch
        self.slowest = SlowestBatch()  # the longest recent batch (the watchdog's "auto")
        self.home: SchedulerLoop | None = None  # the loop it runs on (start)
        self.before_forming: Callable[[], None] | None = None  # as a batch ends (pacing.py)
        self._alarm: Alarm | None = None  # when the oldest item's queue delay is up (start)

    @property
    def slowest_s(self) -> float:
        return self.slowest.seconds()

    # ------------------------------------------------------------------ life cycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run on ``loop`` (the server's), or on a private loop of its own."""
        self.home = SchedulerLoop(loop, f"{self.name}-scheduler")
        self._alarm = Alarm(self.home.loop, self._pump)
        self.instances.attach(self.home.loop, self._repair)
        self.accepting = True
        self.watchdog.start(self.home.loop)

    def close(self, timeout: float | None) -> None:
        """Refuse new items; what is queued still runs; then stop. From any
        thread but the loop's own (``RuntimeError`` there, unless idle)."""
        with self.lock:
            self.accepting = False
            self.closing = True
        if self.home is None:
            return
        self.wake()
        if self.home.here() and not self.wait_idle(0):
            raise RuntimeError(
                f"model {self.name!r}: close() on the scheduler's own event loop would wait "
                f"for itself; close it from another thread (asyncio.to_thread)"
            )
        self.wait_idle(timeout)  # at once on the loop's own thread: it is idle
        self.home.run(self._stop_on_loop)
        self.home.stop()

    def _stop_on_loop(self) -> None:
        self.watchdog.stop()
        if self._alarm is not None:
            self._alarm.cancel()
        self.instances.detach()
        # A close whose wait timed out: nothing will answer these any more.
        closed = ModelNotReady(f"model {self.name!r} closed before this item's batch finished")
        if left := self._answer_all(closed):
            log.error("model %s: closed with %d items unanswered", self.name, left)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once nothing is queued, running, to retry or being restored."""
        with self.lock:
            return self.changed.wait_for(lambda: self._idle and not len(self.queue), timeout)

    # ------------------------------------------------------------------ any thread
    def admit(self, entries: list[Pending], now: float, *, wake: bool = True) -> None:
        """Queue a request's entries (all or none: admission's errors are the
        caller's), then let the loop form batches (unless the caller wakes
        it once for several requests)."""
        expired: list[Outcome] = []
        try:
            with self.lock:
                if not self.accepting:
                    raise ModelNotReady(f"model {self.name!r} is not accepting requests (stopping)")
                self.watchdog.refuse_if_hung()
                expired = self.queue.make_room(len(entries), now)
                self.queue.admit(entries, now)
                self._idle = False
        finally:
            # Out of the queue, so no one else holds them: answered here, once.
            settle(expired)
        if wake:
            self.wake()

    def withdraw(self, entries: list[Pending]) -> None:
        with self.lock:
            self.queue.withdraw(entries)

    def wake(self) -> None:
        """Form batches now: on the loop's thread at once (a request's first
        item goes out before its handler returns), from elsewhere through one
        wake-up of the loop however many items arrive meanwhile."""
        assert self.home is not None
        if self.home.here():
            self._pump(cut_short=False)
            return
        with self.lock:
            if self._woken:
                return
            self._woken = True
        self.home.call_soon(self._pump_woken)

    # ------------------------------------------------------------------ forming batches
    def _pump_woken(self) -> None:
        with self.lock:
            self._woken = False
        self._pump(cut_short=False)

    def _pump(self, cut_short: bool = True) -> None:
        """Hand every instance that has room the batch that is due for it.
        ``cut_short``: also look for a batch the policy cuts short of what
        waits (a budget) to go behind a running one; that takes a policy
        selection, so an arriving item (False) only checks for a full one."""
        try:
            while (instance := self.free_instance()) is not None:
                entries, rest = self._next_entries(instance, cut_short)
                if not entries:
                    break
                self._dispatch(entries, instance, rest)
                cut_short = True
        except BaseException as exc:  # noqa: BLE001 - a bug here must answer every caller
            self._fatal(exc)
        self._note_idle()

    def free_instance(self) -> int | None:
        """The least busy instance that can take a batch (None: none can)."""
        best, fewest = None, self.depth  # room: fewer than depth batches; hung: a Batch
        for instance, running in enumerate(self.running):
            if self.pinned not in (None, instance) or (running and running[-1].rest is not None):
                continue  # pinned elsewhere (warm-up), or a crash's trial runs alone there
            if len(running) < fewest and not (instance in self.repairing or self.hung[instance]):
                best, fewest = instance, len(running)
        return best

    def _next_entries(
        self, instance: int, cut_short: bool
    ) -> tuple[list[Pending], list[Pending] | None]:
        """The next batch for the instance (``formation.next_batch``), and for
        a trial its crash's other suspects (``Batch.rest``)."""
        with self.lock:
            entries, rest, due_in = next_batch(
                self.queue, self.reruns, self.clock(),
                ahead=bool(self.running[instance]), cut_short=cut_short, closing=self.closing,
            )  # fmt: skip
        assert self._alarm is not None
        self._alarm.within(due_in)  # come back when the oldest item is due
        return entries, rest

    def _dispatch(self, entries: list[Pending], instance: int, rest: list[Pending] | None) -> None:
        """Drop the entries nobody waits for any more, pad the rest and hand
        them to the instance; a batch that fails before it runs ends here."""
        now = self.clock()
        live, expired = self.queue.expire(entries, now)
        settle(expired)
        if not live:
            if rest:  # a trial whose callers all left: the culprit may be among its rest
                self.reruns.trials.appendleft(self.recovery.search(rest))
            return
        self.reruns.tried_last = rest is not None
        batch = Batch(live, now, instance=instance, rest=rest)
        self.running[instance].append(batch)
        done = self._done(batch)
        try:
            pad_started = time.perf_counter()
            parameters = [e.parameters for e in live] if self.collator.parameter_names else ()
            padded = self.collator.pad([e.item for e in live], parameters)
            batch.padded, batch.started = padded, time.perf_counter()
            batch.pad_seconds = batch.started - pad_started
            batch.launched = self.instances.dispatch(
                padded.features, instance, padded.parameters, done
            )
        except BaseException as exc:  # noqa: BLE001 - padding or the hand-over failed: this batch
            done(None, exc)

    def _done(self, batch: Batch) -> Callable[[BatchOutputs | None, BaseException | None], None]:
        """The batch's completion, from any thread, handled on the loop: at
        once when it arrives there (a worker's reply, read by the loop), in a
        callback of its own from a thread or from inside ``_dispatch`` (a
        batch that failed before it ran: never inside the pump that sent it)."""
        home = self.home
        assert home is not None

        def done(outputs: BatchOutputs | None, error: BaseException | None) -> None:
            if batch.launched is not None and home.here():
                self._completed(batch, outputs, error)
            else:
                home.call_soon(self._completed, batch, outputs, error)

        return done

    # ------------------------------------------------------------------ completions
    def _completed(
        self, batch: Batch, outputs: BatchOutputs | None, error: BaseException | None
    ) -> None:
        try:
            instance = batch.instance
            if not batch.abandoned:
                self.running[instance].remove(batch)
            batch.outputs, batch.error, batch.launched = outputs, error, None
            now = time.perf_counter()
            batch.seconds = now - batch.started if batch.started else 0.0
            # A batch queued behind another waited for it: the executor's own
            # figure (CUDA events, the worker's clock) is the model's time.
            if outputs is not None and outputs.seconds is not None:
                batch.seconds = outputs.seconds
            self.free_at[instance] = now
            if self.hung[instance] is batch:
                self.hung[instance] = None  # the forward came back after all
            if isinstance(error, WorkerCrashed):
                self._repair(instance)
            if batch.abandoned:  # answered then: nothing of it is answered or learnt again
                log.warning(
                    "model %s: a batch of %d the watchdog gave up on came back after %.1f s "
                    "(%s); its callers were answered then, this outcome is dropped",
                    self.name, len(batch.entries), batch.seconds, error or "results",
                )  # fmt: skip
            else:
                if error is None and not (outputs and outputs.captured):  # no capture's time
                    self.slowest.observe(batch.seconds)
                self._finish(batch)
        except BaseException as exc:  # noqa: BLE001 - a bug here must answer every caller
            self._fatal(exc, [*batch.entries, *(batch.rest or ())])
        if self.before_forming is not None:
            self.before_forming()
        self._pump()

    def _repair(self, instance: int) -> None:
        """Restore the instance (a new worker) off the loop; no batch goes to it
        meanwhile. After a crashed batch, and from the executor (``attach``) as
        soon as a worker is seen dead, idle too: not when a batch finds it dead."""
        assert self.home is not None
        if instance in self.repairing:
            return
        self.repairing.add(instance)
        restored = self.home.loop.run_in_executor(control_pool(), self.executor.repair, instance)

        def back(_: asyncio.Future[None]) -> None:
            self.repairing.discard(instance)
            self._pump()

        restored.add_done_callback(back)

    def _finish(self, batch: Batch) -> None:
        """Answer the batch's callers, or plan its recovery (``Recovery.conclude``)."""
        plan = self.recovery.conclude(batch, self.results)
        self.reruns.add(plan)
        with self.lock:
            self.queue.requeue(plan.cleared)
            self.queue.memory_limit = self.recovery.ceiling.limit
        if self.tracer is not None:
            try:
                self.tracer.batch_finished(batch)
            except Exception:  # a span is never worth a caller's answer
                log.exception("model %s: recording a batch's spans failed", self.name)
        settle(plan.outcomes)

    def _note_idle(self) -> None:
        busy = any(self.running) or bool(self.reruns or self.repairing)
        with self.lock:
            self._idle = not busy
            if self._idle and not len(self.queue):
                self.changed.notify_all()

    def give_up(self, batch: Batch, limit: float) -> None:
        """The watchdog could not stop a forward past ``limit`` (a thread):
        answer its callers now, and those of every batch queued behind it on
        the instance (a second one, where the executor overlaps), which
        cannot run before it. They leave ``running`` at once: their late
        completions are dropped (``_completed``). The instance takes no batch
        until the forward returns, and once every instance is stuck the
        queue is answered too."""
        held, self.running[batch.instance] = self.running[batch.instance], []
        for each in held:
            each.abandoned = True
        self.hung[batch.instance] = batch
        with self.lock:  # a trial's other suspects never ran: they run elsewhere
            self.queue.requeue([entry for each in held for entry in each.rest or ()])
            stranded = self.queue.drain() if all(self.hung) else []
        settle(abandoned(self.name, limit, batch, held, stranded))

    def _fatal(self, exc: BaseException, holding: list[Pending] | None = None) -> None:
        """A bug in the scheduler: answer every caller, queued, running, to be
        retried, or in hand (``holding``), and stop accepting."""
        log.exception("batcher %s: internal scheduler failure", self.name, exc_info=exc)
        with self.lock:
            self.accepting = False
        error = ModelFailure(f"model {self.name!r}: internal batcher failure: {exc!r}")
        self._answer_all(error, tuple(holding or ()))
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _answer_all(self, error: Exception, holding: tuple[Pending, ...] = ()) -> int:
        """Fail every item queued, running, to be retried or in hand; how many."""
        with self.lock:
            stranded = self.queue.drain()
        for instance, running in enumerate(self.running):
            for batch in running:
                batch.abandoned = True  # answered here: a late completion is dropped
                stranded += [*batch.entries, *(batch.rest or ())]
            self.running[instance] = []
        stranded += [*holding, *self.reruns.drain()]
        settle([(entry, error, True) for entry in stranded])
        self._note_idle()
        return len(stranded)
