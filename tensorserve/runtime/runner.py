"""The forward thread of a model instance that an event loop drives.

When the batcher's event loop drives an in-process instance (the direct
path, ``batching.executor.DirectExecutor``), the loop forms and pads each
batch and un-pads and delivers its outputs itself; only the forward (and its
copies to and from the device) runs here, on one thread per instance. That
thread holds the GIL only while the model's own Python runs: the loop has no
model or finisher thread to wait for (docs/architecture.md, "Threads").

One thread owns the instance's device while the loop drives it; the
batcher's instance states guarantee that its model thread runs nothing
on it meanwhile.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from typing import Any

from tensorserve.tensors.dtypes import Feature

Run = Callable[[dict[str, Feature], Mapping[str, list[Any]] | None], Any]
Done = Callable[[Any, BaseException | None], None]


class InstanceRunner:
    """One daemon thread that runs the batches handed to it, in order."""

    def __init__(self, name: str, enter: Callable[[], None], run: Run) -> None:
        self._run = run
        self._jobs: queue.SimpleQueue[tuple[Any, Any, Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, args=(enter,), name=name, daemon=True)
        self._thread.start()

    def submit(
        self, features: dict[str, Feature], parameters: Mapping[str, list[Any]] | None
    ) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((features, parameters, future))
        return future

    def close(self) -> None:
        """Stop after the batches already handed over (does not wait)."""
        self._jobs.put(None)

    def _loop(self, enter: Callable[[], None]) -> None:
        try:
            enter()
            broken: BaseException | None = None
        except BaseException as exc:  # noqa: BLE001 - every batch then fails with it
            broken = exc  # the thread cannot run batches: each fails, none hangs
        while (job := self._jobs.get()) is not None:
            features, parameters, future = job
            try:
                if broken is not None:
                    raise broken
                future.set_result(self._run(features, parameters))
            except BaseException as exc:  # noqa: BLE001 - the model's failure: this batch's only
                future.set_exception(exc)
            del job, features, parameters, future  # free the batch's tensors now


def reply_on_loop(
    future: Future[Any], loop: asyncio.AbstractEventLoop, done: Done
) -> Callable[[], None]:
    """Call ``done(result, error)`` on ``loop``'s thread once ``future`` is
    resolved, exactly once. Returns ``finish_now``: on the loop's thread, wait
    for the result right there and call ``done`` (a ``close()`` on the loop)."""
    called = threading.Lock()

    def deliver() -> None:
        if not called.acquire(blocking=False):
            return  # finish_now got there first
        try:
            result, error = future.result(), None
        except BaseException as exc:  # noqa: BLE001 - handed to ``done`` as it came
            result, error = None, exc
        done(result, error)

    def on_resolved(_: Future[Any]) -> None:
        try:
            loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    future.add_done_callback(on_resolved)

    def finish_now() -> None:
        wait([future])
        deliver()

    return finish_now
