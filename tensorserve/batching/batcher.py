"""The dynamic batcher of one model: the front callers use.

Items go in with ``submit_many`` (thread-safe, from any thread) or
``infer_many`` (a coroutine); each gets a future that the model's scheduler
owns until it resolves it with the item's result or a ``TensorServeError``.
This file keeps the callers' side: futures, deadlines and withdrawals. The
other pieces, and the thread each runs on: docs/architecture.md, "The
batcher in pieces".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, cast, final

from tensorserve.batching.admission import NO_PARAMETERS, BatcherOptions, Pending
from tensorserve.batching.collate import Collator
from tensorserve.batching.executor import Executor
from tensorserve.batching.scheduler import Scheduler
from tensorserve.batching.stats import BatchStats, RequestTally
from tensorserve.batching.target import LatencyTarget
from tensorserve.errors import DeadlineExceeded


def _time_out(waiting: asyncio.Future, name: str, timeout: float) -> None:
    if not waiting.done():
        waiting.set_exception(DeadlineExceeded(f"model {name!r}: no result within {timeout} s"))


@final  # one per model, never specialised: its context manager returns a Batcher
class Batcher:
    """One model's front and scheduler: ``start()`` before use, ``close()`` after (or ``with``)."""

    def __init__(
        self,
        executor: Executor,
        collator: Collator,
        options: BatcherOptions | None = None,
        *,
        name: str = "model",
        stats: BatchStats | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options or BatcherOptions()
        self.name = name
        self.stats = stats or BatchStats()
        self.collator = collator
        self.scheduler = Scheduler(
            executor, collator, self.options, name, self.stats, on_fatal, clock
        )
        self.clock = clock

    # ------------------------------------------------------------------ life cycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> Batcher:
        """Schedule on ``loop`` (the server's: no thread hand-off between a
        request and its batch), or on a private loop of its own."""
        self.scheduler.start(loop)
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting; everything already queued still runs; then stop."""
        self.scheduler.close(timeout)

    def __enter__(self) -> Batcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def pinned(self, instance: int) -> Iterator[None]:
        """Every batch goes to ``instance`` until the block ends: the warm-up
        runs its grid on each instance in turn, before the model takes
        traffic (the scheduler otherwise picks the least busy, always the
        first one for batches sent one after another)."""
        self.scheduler.pinned = instance
        try:
            yield
        finally:
            self.scheduler.pinned = None
            if self.scheduler.home is not None:  # not started: ModelNotReady is the news
                self.scheduler.wake()  # anything still queued may go to any instance now

    def warmed_up(self) -> None:
        """Forget what the warm-up batches taught (a model's first runs
        compile and allocate): the budget's cost fit and the watchdog's
        slowest batch learn from real traffic only."""
        if (budget := self.options.policy.budget) is not None:
            budget.reset()
        self.scheduler.slowest.forget()

    @property
    def latency_target(self) -> LatencyTarget | None:
        """The latency target's controller, if the model has a target."""
        return self.scheduler.target

    @property
    def queue_depth(self) -> int:
        return len(self.scheduler.queue)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once nothing is queued or running (False: not within ``timeout``)."""
        return self.scheduler.wait_idle(timeout)

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

    def submit_into(
        self,
        items: Sequence[Any],
        futures: Sequence[Any],
        loop: asyncio.AbstractEventLoop,
        *,
        timeout: float | None,
        priority: int,
        parameters: Mapping[str, Any],
        wake: bool,
        one_per_request: bool = False,
    ) -> list[Pending]:
        """Queue a request's items, each answered through the given future-like
        object (what the scheduler calls on it: ``done``, ``cancelled``,
        ``cancel``, ``set_result``, ``set_exception``; resolved on ``loop``):
        the front ends' requests (``frontends/hub.py``). Without ``wake``
        the caller wakes the scheduler once after queueing several requests.
        ``one_per_request``: each item is a request of its own (several
        requests queued at once, all or none). Returns the entries, for
        ``withdraw``."""
        return self._enqueue(
            items, timeout, loop, priority, parameters, futures, wake, one_per_request
        )

    def _enqueue(
        self,
        items: Sequence[Any],
        timeout: float | None,
        loop: asyncio.AbstractEventLoop | None,
        priority: int = 0,
        parameters: Mapping[str, Any] = NO_PARAMETERS,
        futures: Sequence[Any] | None = None,
        wake: bool = True,
        one_per_request: bool = False,
    ) -> list[Pending]:
        now = self.clock()
        deadline = None if timeout is None else now + timeout
        # A request of several items is counted once (stats.py).
        tally = RequestTally(len(items)) if len(items) > 1 and not one_per_request else None
        tracer = self.scheduler.tracer  # the request's span, for its items' queue and batch spans
        trace = tracer.current_request() if tracer is not None else None
        if futures is None:
            futures = [loop.create_future() if loop is not None else Future() for _ in items]
        volumes = self.collator.volumes(items)
        entries = [  # positional, in Pending's field order (tests/test_admission.py): a third cheaper
            Pending(
                item, volume, future, loop, now, deadline, 0, 0, priority, parameters, trace, tally
            )
            for item, volume, future in zip(items, volumes, futures, strict=True)
        ]
        self.scheduler.admit(entries, now, wake=wake)
        if loop is None and not one_per_request:
            # A thread's caller may cancel its concurrent future: its slot is
            # freed then (an asyncio caller withdraws itself, infer_many).
            for entry, future in zip(entries, futures):  # futures of its own: Future()
                future.add_done_callback(self._cancelled(entry))
        self.stats.record_requests(len(entries) if one_per_request else 1, len(entries))
        return entries

    def _cancelled(self, entry: Pending) -> Callable[[Any], None]:
        def withdraw_if_cancelled(future: Any) -> None:
            if future.cancelled():
                self.scheduler.withdraw([entry])

        return withdraw_if_cancelled

    def submit(self, item: Any, *, timeout: float | None = None) -> Future:
        return self.submit_many([item], timeout=timeout)[0]

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
        timer = None
        if timeout is not None:
            timer = loop.call_later(timeout, _time_out, waiting, self.name, timeout)
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
                self.withdraw(entries)

    def withdraw(self, entries: list[Pending]) -> None:
        """Cancel what is unanswered; the entries still queued leave the queue
        now, so their slots go to live requests at once."""
        for entry in entries:
            entry.future.cancel()
        self.scheduler.withdraw([e for e in entries if e.future.cancelled()])
