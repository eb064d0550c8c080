"""The dynamic batcher of one model: threads and futures; nothing of HTTP.

Items go in with ``submit_many`` (thread-safe, from any thread) or
``infer_many`` (a coroutine); each gets a future that the batcher owns until
it resolves it with the item's result or a ``TensorServeError``. The pieces:

    admission.py   the queue: admit, when is a batch due, which items form it
                   (pure; the batcher holds its lock around every call)
    collate.py     pad a batch, un-pad its outputs (pure)
    executor.py    the runtime's contract: launch a padded batch, collect it
    results.py     a batch's outcome per caller, recorded in stats (no threads)
    delivery.py    settle futures on their callers' loops
    batcher.py     this file: the threads that join them

    submit ─▶ queue ─▶ model thread: take ─▶ pad ─▶ launch ─▶ collect
                                                               │
              caller ◀─ settle ◀─ un-pad ◀──────── _finish ◀───┘

Threads. One model thread per instance takes the next batch, pads it,
launches and collects it. ``_finish`` (un-pad, record, deliver) runs on the
finisher thread while more work waits, so the model thread goes straight to
its next batch; with nothing else waiting the model thread finishes the batch
itself (one hand-off less for a lone request). The thread that just finished
a batch forms the next one, so no hand-off sits between two batches on the
model's critical path. Where ``launch`` only queues the work
(``executor.overlaps``: CUDA, a worker process), a full next batch is padded
and launched while the current one runs.

The direct path. A lone request to an idle worker process would cross three
threads (loop → model thread → worker → model thread → loop), at ~0.1 ms a
hand-off. When a caller on an event loop finds the queue empty and an
instance parked, the loop pads and sends the batch itself and reads the reply
as it arrives (``_run_direct``). The loop never blocks on a worker: if the
batch cannot be sent, it goes back to the queue for the model threads (which
restart a dead worker), and only small batches go direct (``DIRECT_MAX_ELEMENTS``).

Each instance is in one ``InstanceState``, changed under the lock; a socket
or device has one owner at a time: its model thread, or (DRIVEN) one loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from tensorserve.batching.admission import AdmissionQueue, BatcherOptions, Pending
from tensorserve.batching.collate import Collator
from tensorserve.batching.delivery import running_loop, settle
from tensorserve.batching.executor import BatchOutputs, DirectExecutor, Executor
from tensorserve.batching.results import Batch, BatchResults
from tensorserve.batching.stats import BatchStats
from tensorserve.errors import DeadlineExceeded, ModelFailure, ModelNotReady

log = logging.getLogger(__name__)

# The direct path pads on the event loop's thread and sends without blocking:
# only batches this small go direct (at most 1 MB of int64, well inside a
# worker socket's 4 MB buffer, ~0.1 ms of padding); larger ones take a thread.
DIRECT_MAX_ELEMENTS = 1 << 17


class InstanceState(enum.Enum):
    BUSY = "busy"  # its model thread owns it: forming, running or collecting a batch
    PARKED = "parked"  # its model thread waits for work, nothing on the device
    DRIVEN = "driven"  # an event loop runs a batch on it; its model thread waits


class Batcher:
    """One model's queue and pipeline. ``start()`` before use, ``close()`` after
    (or use it as a context manager)."""

    def __init__(
        self,
        executor: Executor,
        collator: Collator,
        options: BatcherOptions | None = None,
        *,
        name: str = "model",
        stats: BatchStats | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.executor = executor
        self.collator = collator
        self.options = options or BatcherOptions()
        self.name = name
        self.stats = stats or BatchStats()
        self._on_fatal = on_fatal
        self.queue = AdmissionQueue(self.options, collator.padded_elements, name)
        self.results = BatchResults(collator, self.options.policy, self.stats, name)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # the queue and instance states
        self._parked = threading.Condition(self._lock)  # an instance was parked (wait_idle)
        self._accepting = False
        self._closing = False
        instances = executor.instance_count
        self._states = [InstanceState.BUSY] * instances
        self._in_flight: set[Batch] = set()  # left the queue, not yet finished
        self._to_finisher: queue.Queue[Batch | None] = queue.Queue(maxsize=instances + 1)
        self._threads: list[threading.Thread] = []
        self._direct = isinstance(executor, DirectExecutor) and self.options.dispatch == "eager"

    # ------------------------------------------------------------------ life cycle
    def start(self) -> Batcher:
        threads = [
            threading.Thread(target=self._model_loop, args=(i,), name=f"{self.name}-model-{i}")
            for i in range(self.executor.instance_count)
        ]
        threads.append(threading.Thread(target=self._finish_loop, name=f"{self.name}-finish"))
        for thread in threads:
            thread.daemon = True
            thread.start()
        self._threads = threads
        self._accepting = True
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting; everything already queued still runs; then join.
        Safe from any thread, the event loop that drives a batch included."""
        with self._cond:
            self._accepting = False
            self._closing = True
            self._cond.notify_all()
        self._finish_batches_driven_here()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
        self._threads = []

    def __enter__(self) -> Batcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running and every model thread is
        parked, waiting for work; False if that did not happen in time."""
        with self._lock:
            return self._parked.wait_for(
                lambda: not len(self.queue)
                and not self._in_flight
                and all(state is InstanceState.PARKED for state in self._states),
                timeout,
            )

    # ------------------------------------------------------------------ submitting
    def submit_many(
        self,
        items: Sequence[Any],
        *,
        timeout: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> list[Any]:
        """Queue a request's items; one future per item, in order:
        ``asyncio.Future``s of ``loop`` (call from that loop), else
        ``concurrent.futures.Future``s."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        entries = [
            Pending(
                item,
                self.collator.volume(item),
                loop.create_future() if loop is not None else Future(),
                loop,
                now,
                deadline,
            )
            for item in items
        ]
        with self._cond:
            if not self._accepting:
                raise ModelNotReady(f"model {self.name!r} is not accepting requests (stopping)")
            idle = not len(self.queue)
            self.queue.admit(entries)
            direct = self._claim_direct(now) if idle and loop is not None else None
            if len(self.queue):
                self._wake()
        self.stats.record_request(len(entries))
        if direct is not None:
            assert loop is not None
            self._run_direct(*direct, loop)
        return [entry.future for entry in entries]

    def submit(self, item: Any, *, timeout: float | None = None) -> Future:
        return self.submit_many([item], timeout=timeout)[0]

    def infer_sync(self, item: Any, *, timeout: float | None = None) -> Any:
        """Blocking call from any thread (not from the event loop's)."""
        future = self.submit(item, timeout=timeout)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"model {self.name!r}: no result within {timeout} s") from None

    async def infer_many(self, items: Sequence[Any], *, timeout: float | None = None) -> list[Any]:
        """All items' results in order; if one fails, the call fails (and the
        others still queued are cancelled)."""
        futures = self.submit_many(items, timeout=timeout, loop=asyncio.get_running_loop())
        # One item (the common case) needs no gather: one loop iteration less.
        waiting = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
        try:
            results = await asyncio.wait_for(waiting, timeout)
            return [results] if len(futures) == 1 else list(results)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"model {self.name!r}: no result within {timeout} s") from None
        finally:
            for future in futures:
                future.cancel()  # no-op for the finished; frees queue slots for the rest

    async def infer(self, item: Any, *, timeout: float | None = None) -> Any:
        return (await self.infer_many([item], timeout=timeout))[0]

    # ------------------------------------------------------------------ model threads
    def _model_loop(self, instance: int) -> None:
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
        except BaseException as exc:  # pragma: no cover - a bug: fail loudly, not silently
            self._fatal(exc)
        finally:
            self._to_finisher.put(None)

    def _next_batch(self, instance: int, *, ahead: bool) -> list[Pending]:
        """The next batch's entries, taken from the queue.

        Blocks until a batch is due, and returns [] only once closing with
        nothing left. ``ahead`` (a batch still on the device): never blocks,
        and returns [] unless a batch that cannot grow is waiting."""
        with self._cond:
            while True:
                if self._states[instance] is InstanceState.DRIVEN:
                    self._cond.wait()  # an event loop runs a batch on this instance
                    continue
                now = time.monotonic()
                due_in = self.queue.due_in(now, ahead=ahead, closing=self._closing)
                if ahead:
                    return self.queue.take(now, leave_growing=due_in > 0)
                if self._closing and not len(self.queue):
                    return []
                if due_in > 0:
                    self._states[instance] = InstanceState.PARKED
                    self._parked.notify_all()
                    self._cond.wait(None if due_in == math.inf else due_in)
                    continue
                self._states[instance] = InstanceState.BUSY
                return self.queue.take(now)

    def _wake(self) -> None:
        """Wake a model thread for the queue (the lock held). A thread whose
        instance a loop drives would go back to sleep on a plain notify:
        then wake them all."""
        if InstanceState.DRIVEN in self._states:
            self._cond.notify_all()
        else:
            self._cond.notify()

    def _begin(self, entries: list[Pending]) -> Batch | None:
        """Drop the entries nobody waits for any more, then pad the rest."""
        now = time.monotonic()
        live, expired = self.queue.expire(entries, now)
        settle(expired)
        if not live:
            return None
        batch = Batch(live, now)
        with self._cond:
            self._in_flight.add(batch)
        try:
            batch.padded = self.collator.pad([e.item for e in live])
        except BaseException as exc:  # padding failed: this batch only
            batch.error = exc
        return batch

    def _launch(self, entries: list[Pending], instance: int) -> Batch | None:
        batch = self._begin(entries)
        if batch is None or batch.error is not None:
            return batch
        assert batch.padded is not None
        try:
            batch.started = time.perf_counter()
            batch.launched = self.executor.launch(batch.padded.features, instance)
        except BaseException as exc:  # the model failed: this batch only
            batch.error = exc
        return batch

    def _collect(self, batch: Batch) -> None:
        if batch.error is None:
            try:
                self._collected(batch, self.executor.collect(batch.launched), None)
            except BaseException as exc:
                self._collected(batch, None, exc)
        if not len(self.queue) and self._to_finisher.empty():
            self._finish(batch)  # nothing to run next: the finisher would add a hand-off
        else:
            self._to_finisher.put(batch)

    def _collected(self, batch: Batch, outputs: BatchOutputs | None, error: BaseException | None) -> None:
        batch.outputs, batch.error = outputs, error
        batch.launched = None  # free device and socket buffers early
        batch.seconds = time.perf_counter() - batch.started
        # A batch launched ahead waited for the one before it: prefer the
        # executor's own figure of the model's time, which the cost model learns.
        if outputs is not None and outputs.seconds is not None:
            batch.seconds = outputs.seconds

    # ------------------------------------------------------------------ the direct path
    def _claim_direct(self, now: float) -> tuple[list[Pending], int] | None:
        """A parked instance and the batch the loop should run on it (the lock held)."""
        if not self._direct:
            return None
        executor: DirectExecutor = self.executor  # type: ignore[assignment]
        for instance, state in enumerate(self._states):
            if state is InstanceState.PARKED and executor.can_run_direct(instance):
                entries = self.queue.take(now)
                if self.collator.padded_elements([e.item for e in entries]) > DIRECT_MAX_ELEMENTS:
                    self.queue.put_back(entries)  # too big to pad on the loop
                    return None
                self._states[instance] = InstanceState.DRIVEN
                return entries, instance
        return None

    def _run_direct(self, entries: list[Pending], instance: int, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop's thread: pad and send the batch; it is finished when
        the reply arrives. Any trouble before the send hands it to the threads."""
        executor: DirectExecutor = self.executor  # type: ignore[assignment]
        batch = self._begin(entries)
        if batch is None or batch.error is not None:
            self._release(batch, instance)
            return
        assert batch.padded is not None
        try:
            batch.started = time.perf_counter()
            batch.launched = executor.try_launch_direct(batch.padded.features, instance)
        except BaseException as exc:  # the model's own failure, reported at once
            batch.error = exc
            self._release(batch, instance)
            return
        if batch.launched is None:  # not sent: the model thread (re)starts the worker
            with self._cond:
                self._in_flight.discard(batch)
                self.queue.put_back(batch.entries)
            self._release(None, instance)
            return

        def done(outputs: BatchOutputs | None, error: BaseException | None) -> None:
            self._collected(batch, outputs, error)
            self._release(batch, instance)

        batch.loop = loop
        try:
            batch.finish_now = executor.collect_soon(batch.launched, loop, done)
        except BaseException as exc:  # could not even watch the socket
            done(None, exc)

    def _release(self, batch: Batch | None, instance: int) -> None:
        """Finish a directly driven batch, then hand the instance back to its
        model thread (before the callers resume: a caller that then closes
        the model finds nothing in flight)."""
        if batch is not None:
            self._finish(batch)
        with self._cond:
            self._states[instance] = InstanceState.PARKED
            self._parked.notify_all()
            if len(self.queue) or self._closing:
                self._cond.notify_all()

    def _finish_batches_driven_here(self) -> None:
        """``close()`` on a loop that drives batches: their replies would only
        be read once close returned, so wait for them here."""
        loop = running_loop()
        if loop is None:
            return
        with self._cond:
            driven = [b for b in self._in_flight if b.loop is loop and b.finish_now is not None]
        for batch in driven:
            assert batch.finish_now is not None
            batch.finish_now()

    # ------------------------------------------------------------------ finishing
    def _finish_loop(self) -> None:
        stops = 0
        while stops < self.executor.instance_count:
            batch = self._to_finisher.get()
            if batch is None:
                stops += 1
            else:
                self._finish(batch)

    def _finish(self, batch: Batch) -> None:
        """The one place a batch ends: un-pad, record and deliver. Runs on the
        finisher thread, on the model thread when nothing else waits, or on
        the loop that drove it. Whatever goes wrong, every caller is answered."""
        try:
            outcomes = self.results.outcomes(batch)
        except BaseException as exc:  # a bug in un-padding, stats or the cost model
            log.exception("batcher %s: finishing a batch failed", self.name)
            error = ModelFailure(f"model {self.name!r}: finishing the batch failed: {exc!r}")
            outcomes = [(entry, error, True) for entry in batch.entries]
        with self._cond:
            self._in_flight.discard(batch)
            self._parked.notify_all()
        settle(outcomes)

    def _fatal(self, exc: BaseException) -> None:
        """A pipeline thread died: answer every caller, queued or launched."""
        log.exception("batcher %s: internal thread failed", self.name, exc_info=exc)
        with self._cond:
            self._accepting = False
            stranded = self.queue.drain() + [e for b in self._in_flight for e in b.entries]
        error = ModelFailure(f"model {self.name!r}: internal batcher failure: {exc!r}")
        settle([(entry, error, True) for entry in stranded])
        if self._on_fatal is not None:
            self._on_fatal(exc)
