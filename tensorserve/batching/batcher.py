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
    pipeline.py    the model threads and the finisher: take, pad, launch,
                   collect, finish (the one place a batch ends)
    batcher.py     this file: the front callers use, and the direct path

    submit ─▶ queue ─▶ model thread: take ─▶ pad ─▶ launch ─▶ collect
                                                               │
              caller ◀─ settle ◀─ un-pad ◀────────── finish ◀──┘

The direct path: the event loop owns the batch. When a caller on an event
loop finds an instance parked, the loop takes the due batch, pads it, hands
it to the executor without blocking (a worker process's socket, or the
instance's forward thread) and reads the reply as it arrives
(``_run_direct``); then it finishes the batch and, while work is due,
drives the next one on the same instance (``_release``). Under load the
model and finisher threads stay parked, so they never take the GIL from the
loop. The loop never blocks on an executor: if a batch cannot be handed
over, it goes back to the queue for the model threads (which restart a dead
worker), and only small batches go direct (``DIRECT_MAX_ELEMENTS``). The
model threads own what the loop does not: callers without a loop, large
batches, retries of failed batches, ``dispatch = "timer"``, closing, and a
model in a thread whose forwards take ``DIRECT_MAX_FORWARD_S`` or more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, cast, final

from tensorserve.batching.admission import NO_PARAMETERS, AdmissionQueue, BatcherOptions, Pending
from tensorserve.batching.collate import Collator
from tensorserve.batching.delivery import running_loop
from tensorserve.batching.executor import BatchOutputs, DirectExecutor, Executor
from tensorserve.batching.pipeline import InstanceState, Pipeline
from tensorserve.batching.results import Batch
from tensorserve.batching.stats import BatchStats, RequestTally
from tensorserve.batching.target import LatencyTarget
from tensorserve.errors import DeadlineExceeded, ModelNotReady

# The direct path pads on the event loop's thread and sends without blocking:
# only batches this small go direct (at most 1 MB of int64, well inside a
# worker socket's 4 MB buffer, ~0.1 ms of padding); larger ones take a thread.
DIRECT_MAX_ELEMENTS = 1 << 17
# A model that runs in this process one batch at a time (in a thread, on the
# CPU) goes direct only while its forwards are shorter than this. Driven, each
# batch crosses two hand-offs (loop -> forward thread -> loop, ~0.1 ms each on
# a small VM) during which the instance idles, and the next batch waits for
# the loop's un-padding and delivery; a model thread instead takes the next
# batch the moment a forward ends. That matters once the forward is long
# enough for the batcher to be busy: a 1 ms toy in the fault soak served 0.94x
# the items/s driven and 1.01x through its threads (20 and 12 paired rounds,
# benchmarks/results/HISTORY.md); the GIL the loop saves is worth it for short forwards
# (the model-free toy: 268 -> 213 us of CPU per request).
DIRECT_MAX_FORWARD_S = 0.0005


def _time_out(waiting: asyncio.Future, name: str, timeout: float) -> None:
    if not waiting.done():
        waiting.set_exception(DeadlineExceeded(f"model {name!r}: no result within {timeout} s"))


@final  # one per model, never specialised: its context manager returns a Batcher
class Batcher:
    """One model's queue and pipeline: ``start()`` before use, ``close()`` after (or ``with``)."""

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
        self.options = options or BatcherOptions()
        self.name = name
        self.stats = stats or BatchStats()
        self.collator = collator
        self.pipeline = Pipeline(executor, collator, self.options, name, self.stats, on_fatal)
        self._direct = isinstance(executor, DirectExecutor) and self.options.dispatch == "eager"
        if self._direct and not executor.overlaps:
            self.pipeline.offer_to_loop = self._offer_to_loop

    # ------------------------------------------------------------------ life cycle
    def start(self) -> Batcher:
        self.pipeline.start()
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting; everything already queued still runs; then join.
        Safe from any thread, the event loop that drives a batch included."""
        self.pipeline.stop_accepting()
        self._finish_batches_driven_here()
        self.pipeline.join(timeout)

    def __enter__(self) -> Batcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def queue(self) -> AdmissionQueue:
        return self.pipeline.queue

    @property
    def latency_target(self) -> LatencyTarget | None:
        """The latency target's controller, if the model has a target."""
        return self.pipeline.target

    @property
    def queue_depth(self) -> int:
        return len(self.pipeline.queue)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once nothing is queued or running and every model thread waits
        for work; False if that did not happen within ``timeout``."""
        return self.pipeline.wait_idle(timeout)

    # ------------------------------------------------------------------ submitting
    def submit_many(
        self,
        items: Sequence[Any],
        *,
        timeout: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        priority: int = 0,
        parameters: Mapping[str, Any] = NO_PARAMETERS,
    ) -> list[Any]:
        """Queue a request's items; one future per item, in order:
        ``asyncio.Future``s of ``loop`` (call from that loop), else
        ``concurrent.futures.Future``s. ``priority``: the items' level
        (1 is the highest; 0 without priority levels). ``parameters``: the
        request's values of the model's declared parameters (validated)."""
        entries = self._enqueue(items, timeout, loop, priority, parameters)
        return [entry.future for entry in entries]

    def _enqueue(
        self,
        items: Sequence[Any],
        timeout: float | None,
        loop: asyncio.AbstractEventLoop | None,
        priority: int = 0,
        parameters: Mapping[str, Any] = NO_PARAMETERS,
    ) -> list[Pending]:
        p = self.pipeline
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        tally = RequestTally(len(items)) if len(items) > 1 else None  # one request (stats.py)
        entries = [
            Pending(
                item,
                self.collator.volume(item),
                loop.create_future() if loop is not None else Future(),
                loop,
                now,
                deadline,
                priority=priority,
                parameters=parameters,
                request=tally,
            )
            for item in items
        ]
        if p.tracer is not None:  # the request's span, for its items' queue and batch spans
            trace = p.tracer.current_request()
            for entry in entries:
                entry.trace = trace
        with p.cond:
            if not p.accepting:
                raise ModelNotReady(f"model {self.name!r} is not accepting requests (stopping)")
            p.refuse_if_hung()
            p.queue.admit(entries, now)
            direct = self._claim_direct(now, lone=len(entries)) if loop is not None else None
            if len(p.queue) and InstanceState.PARKED in p.states:
                p.wake()  # a parked instance the loop could not use: its thread takes it
        self.stats.record_request(len(entries))
        if direct is not None:
            assert loop is not None
            self._run_direct(*direct, loop)
        return entries

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

    async def infer_many(
        self,
        items: Sequence[Any],
        *,
        timeout: float | None = None,
        priority: int = 0,
        parameters: Mapping[str, Any] = NO_PARAMETERS,
    ) -> list[Any]:
        """All items' results in order; if one fails, the call fails (and the
        others still queued are cancelled)."""
        loop = asyncio.get_running_loop()
        entries = self._enqueue(items, timeout, loop, priority, parameters)
        futures = [cast(asyncio.Future, entry.future) for entry in entries]  # on this loop
        # One item (the common case) needs no gather: one loop iteration less.
        waiting = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
        # A timer that fails the wait, rather than asyncio.wait_for's extra
        # future and callbacks per request (~3% of the loop's time per request).
        timer = (
            None
            if timeout is None
            else loop.call_later(timeout, _time_out, waiting, self.name, timeout)
        )
        try:
            results = await waiting
            return [results] if len(futures) == 1 else list(results)
        finally:
            if timer is not None:
                timer.cancel()
            # Unanswered: timed out, or the caller left. A caller that left
            # cancelled its task, and with it the futures it awaited: those
            # are done too, but still queued.
            if not all(future.done() and not future.cancelled() for future in futures):
                self._withdraw(entries)

    def _withdraw(self, entries: list[Pending]) -> None:
        """Cancel what is unanswered; the entries still queued leave the queue
        now, so their slots go to live requests at once."""
        for entry in entries:
            entry.future.cancel()
        with self.pipeline.cond:
            self.pipeline.queue.withdraw([e for e in entries if e.future.cancelled()])

    async def infer(self, item: Any, *, timeout: float | None = None) -> Any:
        return (await self.infer_many([item], timeout=timeout))[0]

    # ------------------------------------------------------------------ the direct path
    # Through the model threads a batch would cross three threads, and they would
    # take the GIL from the busy loop: it drives the batch (the module docstring).
    def _claim_direct(
        self, now: float, *, unless_backlog: bool = False, lone: int = 0
    ) -> tuple[list[Pending], int] | None:
        """A parked instance and the batch the loop should run on it (the lock held).

        ``unless_backlog``: none if more waits than this batch takes. The
        executor is then the bottleneck, and a model thread, which forms and
        pads the next batch (and, on a worker or CUDA, sends it) while one
        runs, keeps it busier than the loop, whose replies wait behind its
        HTTP work (the tagger in a worker: 1.2x the items/s; in a thread,
        1.1x and p99 60 vs 95-104 ms). With no backlog the loop is the
        bottleneck, and driving saves it the threads' GIL."""
        p = self.pipeline
        if not self._direct or p.retries:
            return None
        if not p.executor.overlaps:
            if p.recent_forward_s >= DIRECT_MAX_FORWARD_S:
                return None  # a model thread pipelines long forwards better (above)
            if lone and len(p.queue) <= lone and not p.in_flight:
                return None  # ``lone`` (its items): the model thread is cheaper (_offer_to_loop)
        if not len(p.queue):  # an offered batch someone else took
            return None
        executor: DirectExecutor = p.executor  # type: ignore[assignment]
        for instance, state in enumerate(p.states):
            if (
                state is InstanceState.PARKED
                and instance not in p.repairs
                and executor.can_run_direct(instance)
            ):
                entries = p.queue.take(now)
                backlog = unless_backlog and len(p.queue) > 0
                if backlog or (
                    p.collator.padded_elements([e.item for e in entries]) > DIRECT_MAX_ELEMENTS
                ):
                    p.queue.put_back(entries, declined=True)  # for the model threads
                    return None
                p.states[instance] = InstanceState.DRIVEN
                return entries, instance
        return None

    def _offer_to_loop(self, instance: int) -> bool:
        """A model thread about to take a batch offers it to its callers' loop
        (the lock held; True: offered, it parks). A lone caller of a model in a
        thread is served by the model thread (~85 us of CPU less than driven);
        once others wait the loop owns the batches again (benchmarks/results/HISTORY.md)."""
        p = self.pipeline
        if p.retries or len(p.queue) <= 1 or p.recent_forward_s >= DIRECT_MAX_FORWARD_S:
            return False
        loop = p.queue.oldest_loop()
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(self._drive_offered, loop)
        except RuntimeError:  # the loop has closed
            return False
        return True

    def _drive_offered(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: drive the batch a model thread offered, or decline."""
        p = self.pipeline
        with p.cond:
            direct = (
                None if p.closing else self._claim_direct(time.monotonic(), unless_backlog=True)
            )
            if direct is None:
                p.loop_declined = True
                p.cond.notify_all()
        if direct is not None:
            self._run_direct(*direct, loop)

    def _run_direct(
        self, entries: list[Pending], instance: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        """On the loop's thread: pad and send the batch; it is finished when
        the reply arrives. Any trouble before the send hands it to the threads."""
        p = self.pipeline
        executor: DirectExecutor = p.executor  # type: ignore[assignment]
        batch = p.begin(entries, instance)
        if batch is None or batch.error is not None:
            self._release(batch, instance)
            return
        assert batch.padded is not None
        try:
            batch.started = time.perf_counter()
            padded = batch.padded
            batch.launched = executor.try_launch_direct(
                padded.features, instance, padded.parameters
            )
        except BaseException as exc:  # noqa: BLE001 - the model's own failure, reported at once
            batch.error, batch.ran = exc, True
            self._release(batch, instance)
            return
        if batch.launched is None:  # not sent: the model thread (re)starts the worker
            with p.cond:
                p.in_flight.discard(batch)
                p.queue.put_back(batch.entries)
            self._release(None, instance)
            return

        def done(outputs: BatchOutputs | None, error: BaseException | None) -> None:
            p.collected(batch, outputs, error)
            self._release(batch, instance)

        batch.loop = loop
        try:
            batch.finish_now = executor.collect_soon(batch.launched, loop, done)
        except BaseException as exc:  # noqa: BLE001 - could not even watch the socket
            done(None, exc)

    def _release(self, batch: Batch | None, instance: int) -> None:
        """Finish a directly driven batch, then run the next due batch on the
        instance from this loop, or hand the instance back to its model thread
        (before the callers resume: a caller that then closes the model finds
        nothing in flight).

        The loop keeps driving while work is due, so under load a worker-process
        model's batches form, pad, run and finish on the loop alone: its model
        and finisher threads stay parked and never take the GIL from the loop
        (that contention cost ~20% of the server's CPU per request,
        benchmarks/results/HISTORY.md). A batch that did not run (``batch`` None or
        never sent) and a closing batcher go back to the threads."""
        p = self.pipeline
        if batch is not None:
            p.finish(batch)
        loop = batch.loop if batch is not None else None
        with p.cond:
            p.states[instance] = InstanceState.PARKED
            if batch is not None and batch.error is not None:
                # Restoring the instance (a dead worker replaced) may block:
                # its model thread does it, right away (notified below).
                p.repairs.add(instance)
            p.parked.notify_all()
            direct = None
            if loop is not None and not p.closing and len(p.queue):
                direct = self._claim_direct(time.monotonic(), unless_backlog=True)
            # Whatever the model threads would take now (parts of a failed batch
            # to run again included: finish woke them while this instance was
            # still DRIVEN, and they went back to waiting).
            if direct is None and (len(p.queue) or p.retries or p.repairs or p.closing):
                p.cond.notify_all()
        if direct is not None:
            assert loop is not None
            self._run_direct(*direct, loop)

    def _finish_batches_driven_here(self) -> None:
        """``close()`` on a loop that drives batches: their replies would only
        be read once close returned, so wait for them here."""
        p = self.pipeline
        loop = running_loop()
        if loop is None:
            return
        with p.cond:
            driven = [b for b in p.in_flight if b.loop is loop and b.finish_now is not None]
        for batch in driven:
            assert batch.finish_now is not None
            batch.finish_now()
