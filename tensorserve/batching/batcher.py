"""The dynamic batcher: a queue, deadlines and futures; nothing of HTTP.

Items go in with ``submit_many`` (thread-safe, from any thread) or
``infer_many`` (a coroutine). Each gets a future that the batcher owns until
it resolves it with the item's result or a ``TensorServeError``: a
``concurrent.futures.Future`` for threads, an ``asyncio.Future`` of the
caller's loop for coroutines, resolved with one ``call_soon_threadsafe`` per
batch and loop (not one wake-up of the loop per item). Two kinds of
threads form a pipeline joined by a bounded hand-off:

    model (xN)  one per model instance: takes the next batch from the queue
                (the policy says which items), pads it (runner.prepare) and
                runs it (runner.launch / runner.collect)
    finisher    un-pads the outputs and resolves the futures (runner.finish)

The thread that just finished a batch forms the next one itself, so no
thread hand-off sits between two batches on the model's critical path (with
a separate dispatcher thread, py-spy showed the model thread idle about a
third of the time at c=32, waiting for the GIL and for its next batch). While the model runs batch N, the event loop decodes
and validates the items of batch N+1 and the finisher un-pads batch N-1. On
an accelerator or in a worker process, where ``launch`` only queues the work
(``runner.overlaps``), a full batch N+1 is padded and launched while batch N
still runs.

A lone request to an idle worker process (``runner.direct``) skips the
threads: the event loop that submits it sends the batch and reads the reply
itself (``_run_direct``), so the worker is the only other party. Any batch
that finds the queue busy or the instance busy takes the threads' path.

When is a batch formed?
* by an idle model instance: at once (dispatch ``eager``: a lone request
  pays no timer), or (dispatch ``timer``) when a full batch waits or the
  oldest item has waited ``max_queue_delay``;
* ahead of a busy device (``runner.overlaps``: CUDA, or a worker process):
  only a full batch, one of max_batch_size or one the policy cut short of
  the items waiting (e.g. at its ``max_batch_tokens`` budget); a batch that
  could still grow is left to accumulate until the device is free.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tensorserve.batching.policy import BatchPolicy, FifoPolicy, Waiting
from tensorserve.batching.stats import BatchStats
from tensorserve.errors import (
    DeadlineExceeded,
    as_model_failure,
    ModelFailure,
    ModelNotReady,
    ServerBusy,
    TensorServeError,
)

log = logging.getLogger(__name__)

P = TypeVar("P")  # a prepared (padded) batch
E = TypeVar("E")  # an executed batch


class Runner(Protocol[P, E]):
    """What the batcher needs from whatever runs batches (see runtime/)."""

    instance_count: int

    def volume(self, item: Any) -> int:
        """Padded-size proxy of one item, for length-aware policies."""
        ...

    def padded_elements(self, items: list[Any]) -> int:
        """Elements a padded batch of these items would allocate."""
        ...

    def prepare(self, items: list[Any]) -> P: ...

    def padding(self, prepared: P) -> tuple[int, int]:
        """(real elements, padded elements) of a prepared batch."""
        ...

    def start_instance(self, instance: int) -> None:
        """Called once on each model thread before its first batch."""
        ...

    overlaps: bool
    """True when ``launch`` returns before the device has finished (CUDA)."""

    def launch(self, prepared: P, instance: int) -> Any:
        """Start the batch on the device (on a CPU: run it)."""
        ...

    def collect(self, launched: Any) -> E:
        """Wait for a launched batch; its outputs on the host. If the result
        has a ``seconds`` attribute that is not None, it is the model's own
        time for the batch and is used instead of the launch-to-collect clock."""
        ...

    def finish(self, executed: E, size: int) -> Sequence[Any]:
        """Per-item results (a result, or an Exception for that item alone)."""
        ...


class DirectRunner(Runner[P, E], Protocol):
    """A runner whose ``launch`` is cheap enough for the event loop's thread
    (it only hands the batch to another process) and that can deliver the
    result on the loop without blocking it: the batcher's direct path."""

    direct: bool

    def can_run_direct(self, instance: int) -> bool: ...

    def collect_soon(
        self,
        launched: Any,
        loop: asyncio.AbstractEventLoop,
        done: Callable[[E | None, BaseException | None], None],
    ) -> None: ...


@dataclass(eq=False)
class Pending:
    item: Any
    volume: int
    future: Future | asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop | None  # set for asyncio futures
    enqueued: float  # time.monotonic()
    deadline: float | None

    def caller_left(self) -> bool:
        """True if the caller cancelled; for a thread's future this also marks
        it running, so a later cancel() cannot race with the result."""
        if self.loop is None:
            return not self.future.set_running_or_notify_cancel()  # type: ignore[union-attr]
        # Read from another thread: a stale "not yet" only runs an item whose
        # caller is about to leave; its result is then dropped.
        return self.future.cancelled()


Outcome = tuple[Pending, Any, bool]  # (entry, result or exception, failed)


@dataclass(eq=False)
class _Batch:
    entries: list[Pending]
    dispatched: float
    prepared: Any = None
    launched: Any = None
    executed: Any = None
    error: BaseException | None = None
    started: float = 0.0  # perf_counter() at launch
    seconds: float = 0.0
    padding: tuple[int, int] = (0, 0)


_STOP: Any = object()
_UNTIL_NOTIFIED = math.inf


@dataclass
class BatcherOptions:
    max_batch_size: int = 32
    max_queue_delay_ms: float = 5.0
    dispatch: str = "eager"  # "eager" | "timer"
    policy: BatchPolicy = field(default_factory=FifoPolicy)
    max_queue_size: int = 4096
    max_batch_elements: int | None = None  # hard cap on one padded batch's elements

    def __post_init__(self) -> None:
        if self.dispatch not in ("eager", "timer"):
            raise ValueError(f"dispatch must be 'eager' or 'timer', not {self.dispatch!r}")
        if self.max_queue_delay_ms < 0:
            raise ValueError("max_queue_delay_ms must be >= 0")
        self.max_batch_size = max(1, self.max_batch_size)


class Batcher:
    """One model's queue and pipeline. ``start()`` before use, ``close()`` after
    (or use it as a context manager)."""

    def __init__(
        self,
        runner: Runner[Any, Any],
        options: BatcherOptions | None = None,
        *,
        name: str = "model",
        stats: BatchStats | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.runner = runner
        self.options = options or BatcherOptions()
        self.name = name
        self.stats = stats or BatchStats()
        self._on_fatal = on_fatal
        self._waiting: list[Pending] = []
        self._cond = threading.Condition()
        self._accepting = False
        self._closing = False
        instances = runner.instance_count
        self._to_finisher: queue.Queue[Any] = queue.Queue(maxsize=instances + 1)
        self._threads: list[threading.Thread] = []
        # The direct path (_run_direct): instances whose model thread waits in
        # _take_batch with nothing on the device, and those an event loop is
        # driving; the model thread leaves a driven instance alone.
        self._direct_capable = getattr(runner, "direct", False) and self.options.dispatch == "eager"
        self._parked: set[int] = set()
        self._driven: set[int] = set()

    # ------------------------------------------------------------------ life cycle
    def start(self) -> Batcher:
        threads = [
            threading.Thread(target=self._model_loop, args=(i,), name=f"{self.name}-model-{i}")
            for i in range(self.runner.instance_count)
        ]
        threads.append(threading.Thread(target=self._finish_loop, name=f"{self.name}-finish"))
        for thread in threads:
            thread.daemon = True
            thread.start()
        self._threads = threads
        self._accepting = True
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting; everything already queued still runs; then join."""
        with self._cond:
            self._accepting = False
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []

    def __enter__(self) -> Batcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

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
                self.runner.volume(item),
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
            if len(self._waiting) + len(entries) > self.options.max_queue_size:
                raise ServerBusy(
                    f"model {self.name!r} queue is full ({len(self._waiting)} items waiting, "
                    f"limit {self.options.max_queue_size}); retry later"
                )
            idle = not self._waiting
            self._waiting.extend(entries)
            driven = self._drive_idle_instance(now) if idle and loop is not None else None
            if self._waiting:
                self._wake()
        self.stats.record_request(len(entries))
        if driven is not None:
            assert loop is not None
            self._run_direct(*driven, loop)
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
            raise DeadlineExceeded(
                f"model {self.name!r}: no result within {timeout} s"
            ) from None
        finally:
            for future in futures:
                future.cancel()  # no-op for the finished; frees queue slots for the rest

    async def infer(self, item: Any, *, timeout: float | None = None) -> Any:
        return (await self.infer_many([item], timeout=timeout))[0]

    # ------------------------------------------------------------------ forming batches
    def _due_in(self, now: float, ahead: bool) -> float | None:
        """None if a batch should be formed now, else how long to wait.

        ``ahead``: the asking instance still has a batch on the device."""
        opts = self.options
        if len(self._waiting) >= opts.max_batch_size or self._closing:
            return None
        if ahead:
            # A partial batch would only wait for the device (_take_batch still
            # forms one the policy has cut short of what is waiting).
            return _UNTIL_NOTIFIED
        if opts.dispatch == "eager":
            return None
        overdue_in = self._waiting[0].enqueued + opts.max_queue_delay_ms / 1000 - now
        return None if overdue_in <= 0 else overdue_in

    def _take_batch(self, instance: int, ahead: bool = False) -> list[Pending] | None:
        """Remove and return the next batch's entries once one is due.

        Blocks, unless ``ahead`` (then returns None at once when no batch is
        due). Returns ``_STOP`` when closing and nothing is left."""
        with self._cond:
            if not ahead:
                self._parked.add(instance)
            try:
                while True:
                    if instance in self._driven:
                        self._cond.wait()  # an event loop runs a batch on this instance
                        continue
                    if not self._waiting:
                        if self._closing:
                            return _STOP
                        if ahead:
                            return None
                        self._cond.wait()
                        continue
                    now = time.monotonic()
                    wait = self._due_in(now, ahead)
                    if wait is not None and not ahead:
                        self._cond.wait(None if wait == _UNTIL_NOTIFIED else wait)
                        continue
                    return self._select(now, leave_growing=wait is not None)
            finally:
                self._parked.discard(instance)

    def _select(self, now: float, leave_growing: bool = False) -> list[Pending] | None:
        """Take the policy's choice out of the queue (the lock held). With
        ``leave_growing``, None if the policy would take everything waiting
        (a batch that could still grow)."""
        opts = self.options
        window = self._waiting[: 16 * opts.max_batch_size]
        overdue_at = now - opts.max_queue_delay_ms / 1000
        views = [Waiting(p.volume, p.enqueued <= overdue_at) for p in window]
        chosen = sorted(opts.policy.select(views, opts.max_batch_size))
        chosen = self._within_element_cap(window, chosen)
        if leave_growing and len(chosen) == len(window):
            # Ahead of a busy device, and the batch could still grow
            # (the policy took everything waiting): let it accumulate.
            return None
        taken = set(chosen)
        entries = [window[i] for i in chosen]
        self._waiting = [p for i, p in enumerate(self._waiting) if i not in taken]
        return entries

    def _wake(self) -> None:
        """Wake a model thread for the queue (the lock held). With an instance
        driven by an event loop, its thread may be the one a plain notify
        wakes, and it would go back to sleep: then wake them all."""
        if self._driven:
            self._cond.notify_all()
        else:
            self._cond.notify()

    def _within_element_cap(self, window: list[Pending], chosen: list[int]) -> list[int]:
        """Leave the newest items waiting until the padded batch fits the cap
        (items of very different shapes could otherwise pad to a huge tensor).
        One item always fits: its own size is bounded by validation."""
        cap = self.options.max_batch_elements
        if cap is None:
            return chosen
        while len(chosen) > 1 and self.runner.padded_elements([window[i].item for i in chosen]) > cap:
            chosen.pop()
        return chosen

    def _live_entries(self, entries: list[Pending], now: float) -> list[Pending]:
        """Drop items whose caller has gone (cancelled) or whose deadline passed."""
        live, expired = [], []
        for entry in entries:
            if entry.caller_left():
                continue
            if entry.deadline is not None and now > entry.deadline:
                error = DeadlineExceeded(f"model {self.name!r}: item waited past its deadline")
                expired.append((entry, error, True))
                continue
            live.append(entry)
        _settle(expired)
        return live

    # ------------------------------------------------------------------ model threads
    def _model_loop(self, instance: int) -> None:
        try:
            self.runner.start_instance(instance)
            on_device: _Batch | None = None  # launched, not yet collected
            while True:
                entries = self._take_batch(instance, ahead=on_device is not None)
                if entries is _STOP:
                    break
                launched = self._launch(entries, instance) if entries else None
                if on_device is not None:
                    self._collect(on_device)
                if launched is not None and not self.runner.overlaps:
                    self._collect(launched)  # on a CPU the batch already ran
                    launched = None
                on_device = launched
            if on_device is not None:
                self._collect(on_device)
        except BaseException as exc:  # pragma: no cover - a bug: fail loudly, not silently
            self._fatal(exc)
        finally:
            self._to_finisher.put(_STOP)

    def _launch(self, entries: list[Pending], instance: int) -> _Batch | None:
        now = time.monotonic()
        batch: _Batch = _Batch(self._live_entries(entries, now), now)
        if not batch.entries:
            return None
        try:
            batch.prepared = self.runner.prepare([e.item for e in batch.entries])
            batch.padding = self.runner.padding(batch.prepared)
            batch.started = time.perf_counter()
            batch.launched = self.runner.launch(batch.prepared, instance)
        except BaseException as exc:  # the model (or padding) failed: this batch only
            batch.error = exc
        return batch

    def _collect(self, batch: _Batch) -> None:
        if batch.error is None:
            try:
                self._collected(batch, self.runner.collect(batch.launched), None)
            except BaseException as exc:
                self._collected(batch, None, exc)
        batch.prepared = batch.launched = None  # free device/pinned memory early
        if not self._waiting and self._to_finisher.empty():
            # Nothing to run next: the finisher would only add a hand-off.
            self._finish(batch)
        else:
            self._to_finisher.put(batch)

    def _collected(self, batch: _Batch, executed: Any, error: BaseException | None) -> None:
        batch.executed, batch.error = executed, error
        batch.seconds = time.perf_counter() - batch.started
        # A batch launched ahead waited for the one before it: prefer the
        # runner's own figure of the model's time, which the cost model learns.
        reported = getattr(executed, "seconds", None)
        if reported is not None:
            batch.seconds = reported

    # ------------------------------------------------------------------ direct path
    # A lone request to an idle worker process would otherwise cross three
    # threads: the loop wakes the model thread, which sends the batch to the
    # worker, wakes when the reply comes and wakes the loop. Each hand-off
    # costs ~0.1 ms on a small VM. When a caller on an event loop finds the
    # queue empty and an instance idle, the loop sends the batch itself and
    # reads the reply with add_reader: the worker is the only other party.
    # Under load no instance is idle and the model threads pipeline as usual.
    def _drive_idle_instance(self, now: float) -> tuple[list[Pending], int] | None:
        """Claim an idle instance and the batch it should run (the lock held)."""
        if not self._direct_capable:
            return None
        runner: DirectRunner[Any, Any] = self.runner  # type: ignore[assignment]
        for instance in sorted(self._parked - self._driven):
            if runner.can_run_direct(instance):
                entries = self._select(now)  # the queue is not empty: never None
                assert entries
                self._driven.add(instance)
                return entries, instance
        return None

    def _run_direct(self, entries: list[Pending], instance: int, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop's thread: pad and send the batch, and finish it when
        the reply arrives (the loop never blocks on the worker)."""
        batch = self._launch(entries, instance)
        if batch is None or batch.error is not None:
            self._release(batch, instance)
            return
        runner: DirectRunner[Any, Any] = self.runner  # type: ignore[assignment]

        def done(executed: Any, error: BaseException | None) -> None:
            self._collected(batch, executed, error)
            batch.prepared = batch.launched = None
            self._release(batch, instance)

        try:
            runner.collect_soon(batch.launched, loop, done)
        except BaseException as exc:  # could not even watch the socket
            done(None, exc)

    def _release(self, batch: _Batch | None, instance: int) -> None:
        """Finish a directly driven batch, then hand the instance back to its
        model thread (before the callers resume: a caller that then closes
        the model finds nothing in flight)."""
        if batch is not None:
            self._finish(batch)
        with self._cond:
            self._driven.discard(instance)
            if self._waiting or self._closing:
                self._cond.notify_all()

    # ------------------------------------------------------------------ finisher
    def _finish_loop(self) -> None:
        stops = 0
        while stops < self.runner.instance_count:
            batch = self._to_finisher.get()
            if batch is _STOP:
                stops += 1
                continue
            self._finish(batch)

    def _finish(self, batch: _Batch) -> None:
        """Un-pad, record and deliver; whatever goes wrong, every caller of the
        batch gets an answer (a thread that died here would leave them hanging)."""
        try:
            self._finish_batch(batch)
        except BaseException as exc:  # a bug in un-padding, stats or the cost model
            log.exception("batcher %s: finishing a batch failed", self.name)
            error = ModelFailure(f"model {self.name!r}: finishing the batch failed: {exc!r}")
            _settle([(entry, error, True) for entry in batch.entries])

    def _finish_batch(self, batch: _Batch) -> None:
        entries = batch.entries
        results: Sequence[Any]
        if batch.error is None:
            try:
                results = self.runner.finish(batch.executed, len(entries))
                if len(results) != len(entries):
                    raise ModelFailure(
                        f"batch function returned {len(results)} results for a batch of "
                        f"{len(entries)} items"
                    )
            except BaseException as exc:
                batch.error = exc
        if batch.error is not None:
            error = as_model_failure(batch.error, self.name)
            results = [error] * len(entries)
        elif self.options.policy.cost is not None:
            # Teach the policy what a batch of this padded volume costs.
            longest = max(e.volume for e in entries)
            self.options.policy.cost.observe(len(entries), longest, batch.seconds)
        queued = sum(batch.dispatched - e.enqueued for e in entries)
        real, padded = batch.padding
        self.stats.record_batch(len(entries), batch.seconds, queued, real, padded)
        outcomes: list[Outcome] = [
            (entry, as_model_failure(result, self.name), True)
            if isinstance(result, BaseException)
            else (entry, result, False)
            for entry, result in zip(entries, results)
        ]
        _settle(outcomes)
        failures = sum(failed for _, _, failed in outcomes)
        if failures:
            self.stats.record_failures(failures)

    def _fatal(self, exc: BaseException) -> None:
        log.exception("batcher %s: internal thread failed", self.name, exc_info=exc)
        with self._cond:
            self._accepting = False
            waiting, self._waiting = self._waiting, []
        error = ModelFailure(f"model {self.name!r}: internal batcher failure: {exc!r}")
        _settle([(entry, error, True) for entry in waiting])
        if self._on_fatal is not None:
            self._on_fatal(exc)


def _settle(outcomes: Sequence[Outcome]) -> None:
    """Deliver results: thread futures directly, asyncio futures with one
    ``call_soon_threadsafe`` per loop (directly when already on that loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
    for outcome in outcomes:
        loop = outcome[0].loop
        if loop is None:
            _deliver([outcome])
        else:
            by_loop.setdefault(loop, []).append(outcome)
    for loop, batch in by_loop.items():
        if _running_loop() is loop:
            _deliver(batch)  # the direct path runs on the loop: no self-pipe round
            continue
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the loop is closed: its callers are gone
            pass


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # a model or finisher thread
        return None


def _deliver(outcomes: Sequence[Outcome]) -> None:
    for entry, value, failed in outcomes:
        future = entry.future
        # A caller that gave up (timeout, disconnect) may have cancelled meanwhile.
        if future.done():
            continue
        try:
            if failed:
                future.set_exception(value)
            else:
                future.set_result(value)
        except Exception:  # pragma: no cover - raced with cancel(); nothing to deliver
            pass
