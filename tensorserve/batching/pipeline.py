"""The execution pipeline of one model: the threads that run its batches.

One model thread per instance takes the next batch from the queue, pads it,
launches it and collects it. ``finish`` (un-pad, record, deliver) runs on the
finisher thread while more work waits, so the model thread goes straight to
its next batch; with nothing else waiting the model thread finishes the batch
itself (one hand-off less for a lone request). The thread that just finished
a batch forms the next one, so no hand-off sits between two batches on the
model's critical path. Where ``launch`` only queues the work
(``executor.overlaps``: CUDA, a worker process), a full next batch is padded
and launched while the current one runs.

Each instance is in one ``InstanceState``, changed under ``lock``; a device
or worker socket has one owner at a time: its model thread, or (DRIVEN) the
event loop running the batcher's direct path. Restoring an instance after a
failed batch (``Executor.repair``: a dead worker replaced) is always its
model thread's job; the loop asks for it through ``repairs``.
"""

from __future__ import annotations

import enum
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from tensorserve.batching.admission import AdmissionQueue, BatcherOptions, Pending
from tensorserve.batching.collate import Collator
from tensorserve.batching.delivery import settle
from tensorserve.batching.executor import BatchOutputs, Executor
from tensorserve.batching.policy import BatchCostModel
from tensorserve.batching.recovery import Recovery
from tensorserve.batching.results import Batch, BatchResults
from tensorserve.batching.stats import BatchStats
from tensorserve.batching.target import LatencyTarget
from tensorserve.batching.tracer import BatchTracer
from tensorserve.batching.watchdog import Watchdog
from tensorserve.errors import ModelFailure, ModelNotReady

log = logging.getLogger(__name__)

FORWARD_ALPHA = 0.1  # weight of the newest batch in ``recent_forward_s``
OFFER_WAIT_S = 0.05  # how long a model thread waits for a loop it offered a batch to


class InstanceState(enum.Enum):
    BUSY = "busy"  # its model thread owns it: forming, running or collecting a batch
    PARKED = "parked"  # its model thread waits for work, nothing on the device
    DRIVEN = "driven"  # an event loop runs a batch on it; its model thread waits


class Pipeline:
    """The queue, the instances' states and the threads; ``Batcher`` is its
    front. Every field below the lock is read and written under it."""

    def __init__(
        self,
        executor: Executor,
        collator: Collator,
        options: BatcherOptions,
        name: str,
        stats: BatchStats,
        on_fatal: Callable[[BaseException], None] | None,
    ) -> None:
        self.executor = executor
        self.collator = collator
        self.name = name
        self.stats = stats
        self._on_fatal = on_fatal
        instances = executor.instance_count
        self.target = (
            None if options.target_p99_ms is None
            else LatencyTarget(options.target_p99_ms, options.max_batch_size,
                               options.max_queue_delay_ms, instances)
        )  # fmt: skip
        self.queue = AdmissionQueue(options, collator.padded_elements, name, self.target)
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
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # work for the model threads
        self.parked = threading.Condition(self.lock)  # an instance was parked (wait_idle)
        self.accepting = False
        self.closing = False
        self.states = [InstanceState.BUSY] * instances
        self.in_flight: set[Batch] = set()  # left the queue, not yet finished
        # Parts of failed batches to run again (batching.recovery), before any
        # new batch: each list runs as a batch of its own.
        self.retries: deque[list[Pending]] = deque()
        self.free_at = [0.0] * instances  # perf_counter() when each last finished a batch
        self.slowest_s = 0.0  # the longest batch so far (the watchdog's "auto")
        # A moving average of a forward's seconds (the batcher's direct path reads it).
        self.recent_forward_s = 0.0
        # The batcher's offer to drive the next batch from its callers' event loop
        # instead of this instance's model thread (the lock held; True: offered,
        # so the model thread parks). ``loop_declined``: the loop would not take
        # it (a backlog, a batch too big): the model thread takes it, unoffered.
        self.offer_to_loop: Callable[[int], bool] | None = None
        self.loop_declined = False
        self.hung: list[Batch | None] = [None] * instances  # a thread the watchdog gave up on
        # Instances whose driven batch failed: their model thread restores them
        # (``Executor.repair``: a dead worker replaced), never the event loop.
        self.repairs: set[int] = set()
        self._to_finisher: queue.Queue[Batch | None] = queue.Queue(maxsize=instances + 1)
        self._threads: list[threading.Thread] = []
        self.tracer: BatchTracer | None = None  # set before start when tracing is on

    def start(self) -> None:
        threads = [
            threading.Thread(target=self._model_loop, args=(i,), name=f"{self.name}-model-{i}")
            for i in range(self.executor.instance_count)
        ]
        threads.append(threading.Thread(target=self._finish_loop, name=f"{self.name}-finish"))
        for thread in threads:
            thread.daemon = True
            thread.start()
        self._threads = threads
        self.watchdog.start()
        self.accepting = True

    def stop_accepting(self) -> None:
        """Refuse new items; the queued ones still run."""
        with self.cond:
            self.accepting = False
            self.closing = True
            self.cond.notify_all()

    def join(self, timeout: float | None) -> None:
        self.watchdog.stop()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
        self._threads = []

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running and every model thread is
        parked, waiting for work; False if that did not happen in time."""
        with self.lock:
            return self.parked.wait_for(
                lambda: (
                    not len(self.queue)
                    and not self.retries
                    and not self.repairs
                    and not self.in_flight
                    and all(state is InstanceState.PARKED for state in self.states)
                ),
                timeout,
            )

    def _model_loop(self, instance: int) -> None:
        entries: list[Pending] = []  # taken from the queue, maybe not yet in flight
        try:
            self.executor.start_instance(instance)
            on_device: Batch | None = None  # launched, not yet collected
            while True:
                entries = self._next_batch(instance, ahead=on_device is not None)
                if not entries and on_device is None:
                    break  # closing, and nothing is left
                launched = self._launch(entries, instance) if entries else None
                if on_device is not None:
                    self._collect(on_device)
                if launched is not None and not self.executor.overlaps:
                    self._collect(launched)  # on a CPU the batch already ran
                    launched = None
                on_device = launched
        except BaseException as exc:  # noqa: BLE001  # pragma: no cover - a bug: fail loudly
            self._fatal(exc, entries)
        finally:
            self._to_finisher.put(None)

    def _next_batch(self, instance: int, *, ahead: bool) -> list[Pending]:
        """The next batch's entries, taken from the queue.

        Blocks until a batch is due, and returns [] only once closing with
        nothing left. ``ahead`` (a batch still on the device): never blocks,
        and returns [] unless a batch that cannot grow is waiting."""
        with self.cond:
            while True:
                if self.states[instance] is InstanceState.DRIVEN:
                    self.cond.wait()  # an event loop runs a batch on this instance
                    continue
                if instance in self.repairs and not ahead and not self.closing:
                    self.repairs.discard(instance)
                    self.states[instance] = InstanceState.BUSY
                    self._repair_unlocked(instance)
                    continue
                if self.retries:
                    if ahead:
                        # A part of a failed batch may fail again: one sent
                        # behind it would only come back unrun.
                        return []
                    self.states[instance] = InstanceState.BUSY
                    return self.retries.popleft()
                now = time.monotonic()
                due_in = self.queue.due_in(now, ahead=ahead, closing=self.closing)
                if ahead:
                    return self.queue.take(now, leave_growing=due_in > 0)
                if self.closing and not len(self.queue):
                    return []
                if due_in > 0:
                    self.states[instance] = InstanceState.PARKED
                    self.parked.notify_all()
                    self.cond.wait(None if due_in == math.inf else due_in)
                    continue
                if self.loop_declined:
                    self.loop_declined = False
                elif self.offer_to_loop is not None and not self.closing:
                    self.states[instance] = InstanceState.PARKED
                    if self.offer_to_loop(instance):
                        self.parked.notify_all()
                        # The loop drives it (DRIVEN) or declines; bounded, so
                        # a loop that stopped meanwhile cannot strand the queue.
                        if not self.cond.wait(OFFER_WAIT_S):
                            self.loop_declined = True
                        continue
                self.states[instance] = InstanceState.BUSY
                return self.queue.take(now)

    def _repair_unlocked(self, instance: int) -> None:
        """``Executor.repair`` with the lock released (it may load a model);
        the instance is BUSY meanwhile, so no loop drives it."""
        self.lock.release()
        try:
            self.executor.repair(instance)
        finally:
            self.lock.acquire()

    def wake(self) -> None:
        """Wake a model thread for the queue (the lock held). A thread whose
        instance a loop drives would go back to sleep on a plain notify:
        then wake them all."""
        if InstanceState.DRIVEN in self.states:
            self.cond.notify_all()
        else:
            self.cond.notify()

    def begin(self, entries: list[Pending], instance: int) -> Batch | None:
        """Drop the entries nobody waits for any more, then pad the rest."""
        now = time.monotonic()
        live, expired = self.queue.expire(entries, now)
        settle(expired)
        if not live:
            return None
        batch = Batch(live, now, instance=instance)
        with self.cond:
            self.in_flight.add(batch)
        try:
            pad_started = time.perf_counter()
            batch.padded = self.collator.pad([e.item for e in live], [e.parameters for e in live])
            batch.pad_seconds = time.perf_counter() - pad_started
        except BaseException as exc:  # noqa: BLE001 - padding failed: this batch only
            batch.error, batch.ran = exc, True
        return batch

    def _launch(self, entries: list[Pending], instance: int) -> Batch | None:
        batch = self.begin(entries, instance)
        if batch is None or batch.error is not None:
            return batch
        assert batch.padded is not None
        try:
            batch.started = time.perf_counter()
            padded = batch.padded
            batch.launched = self.executor.launch(padded.features, instance, padded.parameters)
        except BaseException as exc:  # noqa: BLE001 - the model failed: this batch only
            batch.error, batch.ran = exc, True
        return batch

    def _collect(self, batch: Batch) -> None:
        if batch.error is None:
            try:
                self.collected(batch, self.executor.collect(batch.launched), None)
            except BaseException as exc:  # noqa: BLE001 - its callers get the failure
                self.collected(batch, None, exc)
                # The batch is over (the watchdog stops counting): now an
                # executor may restore the instance (a new worker process).
                self.executor.repair(batch.instance)
        if not len(self.queue) and self._to_finisher.empty():
            self.finish(batch)  # nothing to run next: the finisher would add a hand-off
        else:
            self._to_finisher.put(batch)

    def collected(
        self, batch: Batch, outputs: BatchOutputs | None, error: BaseException | None
    ) -> None:
        batch.outputs, batch.error = outputs, error
        batch.launched = None  # free device and socket buffers early
        now = time.perf_counter()
        batch.seconds = now - batch.started
        with self.lock:  # read by the watchdog
            batch.ran = True
            self.free_at[batch.instance] = now
        # A batch launched ahead waited for the one before it: prefer the
        # executor's own figure of the model's time, which the cost model learns.
        if outputs is not None and outputs.seconds is not None:
            batch.seconds = outputs.seconds
        if error is None:
            self.slowest_s = max(self.slowest_s, batch.seconds)
            self.recent_forward_s += FORWARD_ALPHA * (batch.seconds - self.recent_forward_s)

    # ------------------------------------------------------------------ finishing
    def _finish_loop(self) -> None:
        stops = 0
        while stops < self.executor.instance_count:
            batch = self._to_finisher.get()
            if batch is None:
                stops += 1
            else:
                self.finish(batch)

    def finish(self, batch: Batch) -> None:
        """The one place a batch ends: un-pad, record and deliver. Runs on the
        finisher thread, on the model thread when nothing else waits, or on
        the loop that drove it. Whatever goes wrong, every caller is answered.
        A batch that failed as a whole may instead go back in parts
        (batching.recovery): those run before any new batch."""
        retries: list[list[Pending]] = []
        try:
            plan = self.recovery.plan(batch)
            if plan is not None:
                outcomes, retries = plan.outcomes, plan.retries
                self.results.record_recovered(batch, outcomes)
            else:
                outcomes = self.results.outcomes(batch)
                if batch.error is None and self.recovery.ceiling.fitted():
                    log.info(
                        "model %s: trying batches of up to %d padded elements again",
                        self.name,
                        self.recovery.ceiling.limit,
                    )
        except BaseException as exc:  # a bug in un-padding, stats or the cost model
            log.exception("batcher %s: finishing a batch failed", self.name)
            error = ModelFailure(f"model {self.name!r}: finishing the batch failed: {exc!r}")
            outcomes, retries = [(entry, error, True) for entry in batch.entries], []
        if retries:
            log.warning(
                "model %s: a batch of %d failed (%s); running it again as %s",
                self.name,
                len(batch.entries),
                batch.error,
                " + ".join(str(len(part)) for part in retries),
            )
        with self.cond:
            self.in_flight.discard(batch)
            if self.hung[batch.instance] is batch:
                self.hung[batch.instance] = None  # the forward came back after all
            self.queue.memory_limit = self.recovery.ceiling.limit
            self.retries.extend(retries)
            if retries:
                self.cond.notify_all()
            self.parked.notify_all()
        if self.tracer is not None:
            self._trace(batch)
        settle(outcomes)

    def _trace(self, batch: Batch) -> None:
        assert self.tracer is not None
        try:
            self.tracer.batch_finished(batch)
        except Exception:  # a span is never worth a caller's answer
            log.exception("model %s: recording a batch's spans failed", self.name)

    def health(self) -> str | None:
        """Why no batch can run now (None: one can)."""
        with self.lock:
            if self._threads and all(self.hung):
                return "every instance is stuck in a batch past the watchdog's limit"
        return self.watchdog.stalled()

    @property
    def can_admit(self) -> bool:
        """Accepting, and some instance can run a batch (read without the
        lock: a hint; admission itself checks under it)."""
        return self.accepting and not (self._threads and all(self.hung))

    def refuse_if_hung(self) -> None:
        """No instance can run a batch: answer now instead of queueing (the lock held)."""
        if self._threads and all(self.hung):
            raise ModelNotReady(
                f"model {self.name!r} is not ready: every instance is stuck in a batch that "
                f"ran past the watchdog's limit"
            )

    def _fatal(self, exc: BaseException, holding: list[Pending] | None = None) -> None:
        """A pipeline thread died: answer every caller, queued, launched, to be
        retried, or in the dying thread's hands (``holding``)."""
        log.exception("batcher %s: internal thread failed", self.name, exc_info=exc)
        with self.cond:
            self.accepting = False
            stranded = self.queue.drain() + [e for b in self.in_flight for e in b.entries]
            stranded += holding or []
            stranded += [entry for part in self.retries for entry in part]
            self.retries.clear()
        error = ModelFailure(f"model {self.name!r}: internal batcher failure: {exc!r}")
        settle([(entry, error, True) for entry in stranded])
        if self._on_fatal is not None:
            self._on_fatal(exc)
