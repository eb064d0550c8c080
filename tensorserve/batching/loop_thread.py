"""The event loop a scheduler runs on: the server's, or a private one on a
thread of its own (a model used as a library, outside a server)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable

from tensorserve.host import name_native_thread


class SchedulerLoop:
    def __init__(self, loop: asyncio.AbstractEventLoop | None, name: str) -> None:
        self._thread: threading.Thread | None = None
        if loop is None:
            loop = asyncio.new_event_loop()
            started = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(loop, started), name=name, daemon=True
            )
            self._thread.start()
            started.wait()
        self.loop = loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
        name_native_thread()
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def here(self) -> bool:
        """True on the loop's own thread, while it runs."""
        # (not get_running_loop: its exception cost ~20 us on a model's thread, waking cold)
        return asyncio._get_running_loop() is self.loop

    def call_soon(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)`` on the loop, from any thread (nothing once it has closed)."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            if self.here():
                self.loop.call_soon(fn, *args)
            else:
                self.loop.call_soon_threadsafe(fn, *args)

    def run(self, fn: Callable[[], None]) -> None:
        """``fn()`` on the loop, waiting for it (at once on the loop's thread,
        or where the loop no longer runs: nothing else can be on it then)."""
        if self.here() or not self.loop.is_running():
            fn()
            return
        ran = threading.Event()

        def run_then_tell() -> None:
            try:
                fn()
            finally:
                ran.set()

        with contextlib.suppress(RuntimeError):  # closed: nothing runs there any more
            self.loop.call_soon_threadsafe(run_then_tell)
            ran.wait()

    def stop(self) -> None:
        """Stop a private loop once what is queued on it has run; join it."""
        if self._thread is None or self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing to stop
            self.loop.call_soon_threadsafe(self.loop.stop)
            if self._thread is not threading.current_thread():
                self._thread.join()


class Alarm:
    """One callback on the loop, at the soonest time it was asked for: a
    later ask while one is set changes nothing (it comes back sooner
    already). It fires once, and can then be set again. The loop's alone."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf

    def within(self, seconds: float) -> None:
        """Call back in ``seconds`` at the latest (``math.inf``: no change)."""
        if seconds == math.inf:
            return
        at = self._loop.time() + seconds
        if self._timer is not None:
            if self._at <= at:
                return
            self._timer.cancel()
        self._at, self._timer = at, self._loop.call_at(at, self._fire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = None, math.inf

    def _fire(self) -> None:
        self._timer, self._at = None, math.inf
        self._callback()
