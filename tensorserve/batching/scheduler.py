"""The scheduler of one model: the one owner of every batch, as in Triton.

It runs on one event loop (the server's, or a private one on a thread of its
own) and is the only code that forms a batch, pads it, hands it to an
instance, receives its completion, un-pads it and answers its callers:

    admit (any thread) ─▶ queue ─▶ _pump: take ─▶ pad ─▶ instance.dispatch
                                                                  │
         caller ◀─ settle ◀─ un-pad ◀─ _completed ◀── done ◀──────┘
                                            │
                       retries (recovery) ◀─┘   the next batch: _pump

An instance only runs a padded batch and calls ``done``: a worker process
(``LoopExecutor``: its socket is written and read by this loop, never
blocking it) or a thread of this process (``instances.InstanceThreads``).
Each instance holds up to two batches where its executor overlaps (CUDA, a
worker), so the next one is padded and queued while one runs; a second
batch is formed only if it cannot grow any more (``AdmissionQueue.take``).

Who owns what: what ``__init__`` sets below ``lock`` is the loop's alone;
the queue is shared with admitting callers (any thread) under ``lock``; the
watchdog is a timer on this loop; statistics lock themselves. Failed batches
come back here too: their parts to run again go before any new batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from tensorserve.batching.admission import AdmissionQueue, BatcherOptions, Outcome, Pending
from tensorserve.batching.collate import Collator
from tensorserve.batching.delivery import settle
from tensorserve.batching.executor import BatchOutputs, Executor, LoopExecutor
from tensorserve.batching.instances import InstanceThreads
from tensorserve.batching.loop_thread import SchedulerLoop
from tensorserve.batching.policy import BatchCostModel
from tensorserve.batching.recovery import Recovery
from tensorserve.batching.results import Batch, BatchResults
from tensorserve.batching.stats import BatchStats
from tensorserve.batching.target import LatencyTarget
from tensorserve.batching.tracer import BatchTracer
from tensorserve.batching.watchdog import SlowestBatch, Watchdog
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
        self.recovery = Recovery(
            name,
            options.split_failed_batches,
            stats,
            cost,
            lambda: executor.restart_seconds,
            executor.free_memory_bytes,
        )
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
        self.retries: deque[list[Pending]] = deque()  # failed batches' parts, run first
        self.repairing: set[int] = set()  # instances being restored (a new worker)
        self.hung: list[Batch | None] = [None] * count  # forwards the watchdog gave up on
        self.free_at = [0.0] * count  # perf_counter() when each last finished a batch
        self.slowest = SlowestBatch()  # the longest recent batch (the watchdog's "auto")
        self.home: SchedulerLoop | None = None  # the loop it runs on (start)
        self.before_forming: Callable[[], None] | None = None  # as a batch ends (pacing.py)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    @property
    def slowest_s(self) -> float:
        return self.slowest.seconds()

    # ------------------------------------------------------------------ life cycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run on ``loop`` (the server's), or on a private loop of its own."""
        self.home = SchedulerLoop(loop, f"{self.name}-scheduler")
        self.instances.attach(self.home.loop)
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
        if self._timer is not None:
            self._timer.cancel()
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
                entries = self._next_entries(instance, cut_short)
                if not entries:
                    break
                self._dispatch(entries, instance)
                cut_short = True
        except BaseException as exc:  # noqa: BLE001 - a bug here must answer every caller
            self._fatal(exc)
        self._note_idle()

    def free_instance(self) -> int | None:
        """The least busy instance that can take a batch (None: none can)."""
        best, fewest = None, self.depth  # room: fewer than depth batches; hung: a Batch
        for instance, running in enumerate(self.running):
            if len(running) < fewest and not (instance in self.repairing or self.hung[instance]):
                best, fewest = instance, len(running)
        return best

    def _next_entries(self, instance: int, cut_short: bool) -> list[Pending]:
        ahead = bool(self.running[instance])
        if self.retries:
            # A part of a failed batch may fail again: one sent behind it
            # would only come back unrun. It goes alone, on an idle instance.
            return [] if ahead else self.retries.popleft()
        with self.lock:
            now = self.clock()
            due_in = self.queue.due_in(now, ahead=ahead, closing=self.closing)
            if ahead:  # only a batch that cannot grow goes behind a running one
                if due_in > 0 and not cut_short:
                    return []
                return self.queue.take(now, leave_growing=due_in > 0)
            if due_in > 0:
                self._arm_timer(due_in)
                return []
            return self.queue.take(now)

    def _arm_timer(self, due_in: float) -> None:
        """Come back when the oldest item's queue delay is up."""
        assert self.home is not None
        if due_in == math.inf:
            return
        loop = self.home.loop
        at = loop.time() + due_in
        if self._timer is not None:
            if self._timer_at <= at:
                return  # it comes back sooner already
            self._timer.cancel()
        self._timer_at = at
        self._timer = loop.call_at(at, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._pump()

    def _dispatch(self, entries: list[Pending], instance: int) -> None:
        """Drop the entries nobody waits for any more, pad the rest and hand
        them to the instance; a batch that fails before it runs ends here."""
        now = self.clock()
        live, expired = self.queue.expire(entries, now)
        settle(expired)
        if not live:
            return
        batch = Batch(live, now, instance=instance)
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
            if isinstance(error, WorkerCrashed) and instance not in self.repairing:
                self._repair(instance)
            if batch.abandoned:
                # Its callers were answered when the watchdog gave up on it:
                # nothing of it is answered, retried or learnt from again.
                log.warning(
                    "model %s: a batch of %d the watchdog gave up on came back after %.1f s "
                    "(%s); its callers were answered then, this outcome is dropped",
                    self.name, len(batch.entries), batch.seconds, error or "results",
                )  # fmt: skip
            else:
                if error is None:
                    self.slowest.observe(batch.seconds)
                self._finish(batch)
        except BaseException as exc:  # noqa: BLE001 - a bug here must answer every caller
            self._fatal(exc, batch.entries)
        if self.before_forming is not None:
            self.before_forming()
        self._pump()

    def _repair(self, instance: int) -> None:
        """Restore the instance (a new worker) off the loop; no batch goes to it meanwhile."""
        assert self.home is not None
        self.repairing.add(instance)
        restored = self.home.loop.run_in_executor(control_pool(), self.executor.repair, instance)

        def back(_: asyncio.Future[None]) -> None:
            self.repairing.discard(instance)
            self._pump()

        restored.add_done_callback(back)

    def _finish(self, batch: Batch) -> None:
        """Answer the batch's callers; a batch that failed as a whole may
        instead come back in parts (``BatchResults.conclude``), run first."""
        outcomes, retries = self.results.conclude(batch, self.recovery)
        self.retries.extend(retries)
        with self.lock:
            self.queue.memory_limit = self.recovery.ceiling.limit
        if self.tracer is not None:
            try:
                self.tracer.batch_finished(batch)
            except Exception:  # a span is never worth a caller's answer
                log.exception("model %s: recording a batch's spans failed", self.name)
        settle(outcomes)

    def _note_idle(self) -> None:
        busy = any(self.running) or bool(self.retries) or bool(self.repairing)
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
        error = ModelFailure(
            f"model {self.name!r}: the batch ran longer than the watchdog's {limit:g} s and was "
            f"abandoned; the model is not ready while every instance is stuck"
        )
        behind = ModelFailure(
            f"model {self.name!r}: this item's batch was queued behind one that ran longer "
            f"than the watchdog's {limit:g} s on the same instance, and was abandoned with it"
        )
        held, self.running[batch.instance] = self.running[batch.instance], []
        for each in held:
            each.abandoned = True
        self.hung[batch.instance] = batch
        with self.lock:
            stranded = self.queue.drain() if all(self.hung) else []
        stuck = ModelNotReady(
            f"model {self.name!r} is not ready: every instance is stuck in a batch"
        )
        settle(
            [(e, error if each is batch else behind, True) for each in held for e in each.entries]
            + [(e, stuck, True) for e in stranded]
        )

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
                stranded += batch.entries
            self.running[instance] = []
        stranded += [*holding, *(entry for part in self.retries for entry in part)]
        self.retries.clear()
        settle([(entry, error, True) for entry in stranded])
        self._note_idle()
        return len(stranded)
