"""The dynamic batcher: a queue, deadlines and futures; nothing of HTTP.

Items go in with ``submit`` (thread-safe, from any thread or event loop) and
each gets a ``concurrent.futures.Future`` that the batcher owns until it
resolves it with the item's result or a ``TensorServeError``. Three kinds of
threads form a pipeline joined by bounded hand-offs:

    dispatcher  waits for a batch-worthy queue, asks the policy which items
                form the batch, pads them (runner.prepare)
    model (xN)  runs the batch on the device (runner.execute), one thread per
                model instance
    finisher    un-pads the outputs and resolves the futures (runner.finish)

So while the model runs batch N, the dispatcher pads batch N+1 and the
finisher un-pads batch N-1. At most ``instance_count + prefetch`` batches are
between the dispatcher and the finisher: the queue in front of the model is
bounded, and items keep accumulating (forming bigger batches) while it is
busy.

When is a batch dispatched?
* while a model instance is idle: at once (dispatch ``eager``: a lone request
  pays no timer), or (dispatch ``timer``) when a full batch waits or the
  oldest item has waited ``max_queue_delay``;
* while every instance is busy: only a full batch is formed ahead of time
  (prefetch); a partial one would merely wait in front of the model, so the
  queue keeps accumulating until an instance frees up.
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
from typing import Any, Generic, Protocol, TypeVar

from tensorserve.batching.policy import BatchPolicy, FifoPolicy, Waiting
from tensorserve.batching.stats import BatchStats
from tensorserve.errors import (
    DeadlineExceeded,
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

    def prepare(self, items: list[Any]) -> P: ...

    def padding(self, prepared: P) -> tuple[int, int]:
        """(real elements, padded elements) of a prepared batch."""
        ...

    def start_instance(self, instance: int) -> None:
        """Called once on each model thread before its first batch."""
        ...

    def execute(self, prepared: P, instance: int) -> E: ...

    def finish(self, executed: E, size: int) -> Sequence[Any]:
        """Per-item results (a result, or an Exception for that item alone)."""
        ...


@dataclass(eq=False)
class Pending:
    item: Any
    volume: int
    future: Future
    enqueued: float  # time.monotonic()
    deadline: float | None


@dataclass(eq=False)
class _Batch(Generic[P]):
    entries: list[Pending]
    dispatched: float
    prepared: Any = None
    executed: Any = None
    error: BaseException | None = None
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
    prefetch: int = 1  # padded batches allowed to wait in front of a busy model

    def __post_init__(self) -> None:
        if self.dispatch not in ("eager", "timer"):
            raise ValueError(f"dispatch must be 'eager' or 'timer', not {self.dispatch!r}")
        if self.max_queue_delay_ms < 0:
            raise ValueError("max_queue_delay_ms must be >= 0")
        if self.prefetch < 0:
            raise ValueError("prefetch must be >= 0")
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
        self._slots = threading.Semaphore(instances + self.options.prefetch)
        self._not_started = 0  # dispatched batches no model thread has picked up yet
        self._busy = 0  # batches executing right now
        self._to_model: queue.Queue[Any] = queue.Queue()  # bounded by _slots
        self._to_finisher: queue.Queue[Any] = queue.Queue(maxsize=instances + 1)
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ life cycle
    def start(self) -> Batcher:
        threads = [threading.Thread(target=self._dispatch_loop, name=f"{self.name}-dispatch")]
        threads += [
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
    def submit_many(self, items: Sequence[Any], *, timeout: float | None = None) -> list[Future]:
        """Queue a request's items; one future per item, in order."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        entries = [
            Pending(item, self.runner.volume(item), Future(), now, deadline) for item in items
        ]
        with self._cond:
            if not self._accepting:
                raise ModelNotReady(f"model {self.name!r} is not accepting requests (stopping)")
            if len(self._waiting) + len(entries) > self.options.max_queue_size:
                raise ServerBusy(
                    f"model {self.name!r} queue is full ({len(self._waiting)} items waiting, "
                    f"limit {self.options.max_queue_size}); retry later"
                )
            self._waiting.extend(entries)
            self._cond.notify()
        self.stats.record_request(len(entries))
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
        futures = [asyncio.wrap_future(f) for f in self.submit_many(items, timeout=timeout)]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), timeout))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"model {self.name!r}: no result within {timeout} s"
            ) from None
        finally:
            for future in futures:
                future.cancel()  # no-op for the finished; frees queue slots for the rest

    async def infer(self, item: Any, *, timeout: float | None = None) -> Any:
        return (await self.infer_many([item], timeout=timeout))[0]

    # ------------------------------------------------------------------ dispatcher
    def _ready_to_dispatch(self, now: float) -> float | None:
        """None if a batch should go now, else seconds until the oldest is overdue."""
        opts = self.options
        if len(self._waiting) >= opts.max_batch_size or self._closing:
            return None
        if self._not_started + self._busy >= self.runner.instance_count:
            # Every instance is busy: a batch formed now would only wait in front
            # of the model, so keep accumulating (the model thread wakes us).
            return _UNTIL_NOTIFIED
        if opts.dispatch == "eager":
            return None
        overdue_in = self._waiting[0].enqueued + opts.max_queue_delay_ms / 1000 - now
        return None if overdue_in <= 0 else overdue_in

    def _take_batch(self) -> list[Pending] | None:
        """Block until a batch is due; remove and return its entries (None: stop)."""
        opts = self.options
        with self._cond:
            while True:
                if not self._waiting:
                    if self._closing:
                        return None
                    self._cond.wait()
                    continue
                now = time.monotonic()
                wait = self._ready_to_dispatch(now)
                if wait is not None:
                    self._cond.wait(None if wait == _UNTIL_NOTIFIED else wait)
                    continue
                window = self._waiting[: 16 * opts.max_batch_size]
                overdue_at = now - opts.max_queue_delay_ms / 1000
                views = [Waiting(p.volume, p.enqueued <= overdue_at) for p in window]
                chosen = set(opts.policy.select(views, opts.max_batch_size))
                entries = [p for i, p in enumerate(window) if i in chosen]
                self._waiting = [p for i, p in enumerate(self._waiting) if i not in chosen]
                self._not_started += 1
                return entries

    def _live_entries(self, entries: list[Pending], now: float) -> list[Pending]:
        """Drop items whose caller has gone (cancelled) or whose deadline passed."""
        live = []
        for entry in entries:
            if not entry.future.set_running_or_notify_cancel():
                continue
            if entry.deadline is not None and now > entry.deadline:
                entry.future.set_exception(
                    DeadlineExceeded(f"model {self.name!r}: item waited past its deadline")
                )
                continue
            live.append(entry)
        return live

    def _dispatch_loop(self) -> None:
        try:
            while True:
                self._slots.acquire()
                entries = self._take_batch()
                if entries is None:
                    self._slots.release()
                    break
                now = time.monotonic()
                batch = _Batch(self._live_entries(entries, now), now)
                if not batch.entries:
                    with self._cond:
                        self._not_started -= 1
                        self._cond.notify()
                    self._slots.release()
                    continue
                try:
                    batch.prepared = self.runner.prepare([e.item for e in batch.entries])
                    batch.padding = self.runner.padding(batch.prepared)
                except BaseException as exc:  # a bug in padding fails this batch only
                    batch.error = exc
                self._to_model.put(batch)
        except BaseException as exc:  # pragma: no cover - a bug: fail loudly, not silently
            self._fatal(exc)
        finally:
            for _ in range(self.runner.instance_count):
                self._to_model.put(_STOP)

    # ------------------------------------------------------------------ model threads
    def _model_loop(self, instance: int) -> None:
        try:
            self.runner.start_instance(instance)
        except BaseException as exc:
            self._fatal(exc)
        while True:
            batch = self._to_model.get()
            if batch is _STOP:
                self._to_finisher.put(_STOP)
                return
            with self._cond:
                self._not_started -= 1
                self._busy += 1
            if batch.error is None:
                started = time.perf_counter()
                try:
                    batch.executed = self.runner.execute(batch.prepared, instance)
                except BaseException as exc:
                    batch.error = exc
                batch.seconds = time.perf_counter() - started
            batch.prepared = None  # free padded inputs before the finisher runs
            with self._cond:
                self._busy -= 1
                self._cond.notify()  # an idle instance may trigger an eager dispatch
            self._slots.release()
            self._to_finisher.put(batch)

    # ------------------------------------------------------------------ finisher
    def _finish_loop(self) -> None:
        stops = 0
        while stops < self.runner.instance_count:
            batch = self._to_finisher.get()
            if batch is _STOP:
                stops += 1
                continue
            self._finish(batch)

    def _finish(self, batch: _Batch[Any]) -> None:
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
            error = _as_model_failure(batch.error, self.name)
            results = [error] * len(entries)
        elif self.options.policy.cost is not None:
            # Teach the policy what a batch of this padded volume costs.
            longest = max(e.volume for e in entries)
            self.options.policy.cost.observe(len(entries), longest, batch.seconds)
        queued = sum(batch.dispatched - e.enqueued for e in entries)
        real, padded = batch.padding
        self.stats.record_batch(len(entries), batch.seconds, queued, real, padded)
        failures = 0
        for entry, result in zip(entries, results):
            if isinstance(result, BaseException):
                failures += 1
                _resolve(entry.future, exception=_as_model_failure(result, self.name))
            else:
                _resolve(entry.future, result=result)
        if failures:
            self.stats.record_failures(failures)

    def _fatal(self, exc: BaseException) -> None:
        log.exception("batcher %s: internal thread failed", self.name, exc_info=exc)
        with self._cond:
            self._accepting = False
            waiting, self._waiting = self._waiting, []
        error = ModelFailure(f"model {self.name!r}: internal batcher failure: {exc!r}")
        for entry in waiting:
            if entry.future.set_running_or_notify_cancel():
                entry.future.set_exception(error)
        if self._on_fatal is not None:
            self._on_fatal(exc)


def _as_model_failure(exc: BaseException, model: str) -> TensorServeError:
    if isinstance(exc, TensorServeError):
        return exc
    return ModelFailure(f"model {model!r} failed: {type(exc).__name__}: {exc}")


def _resolve(future: Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    # A caller that gave up (timeout, disconnect) may have cancelled meanwhile.
    if future.done():
        return
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except Exception:  # pragma: no cover - raced with cancel(); nothing to deliver
        pass
