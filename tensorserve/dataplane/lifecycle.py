"""Where the server is in its shutdown, as every front end sees it.

``tensorserve/http/server.py`` owns the one ``Lifecycle`` of a running server (the
``DataPlane``'s, shared by the HTTP and gRPC front ends) and moves it through
its phases on SIGTERM or SIGINT (docs/reliability.md, "Shutdown"):

    SERVING    the normal state
    DRAINING   readiness answers 503; requests are still accepted and served
               (``drain_delay_s``), so load balancers stop sending
    CLOSING    the listening sockets are closed; queued and running requests
               finish (``shutdown_grace_s``)
    ABORTING   the grace period is over: every request still waiting is
               answered 503 / UNAVAILABLE (``ModelNotReady``), never a reset
               connection

Readiness answers ask ``DataPlane.draining``; every infer call runs inside
``DataPlane.track()``, which is how the server knows what is still in
flight, whichever front end it came in on, and how it answers what is left.
A data plane built without the server (tests' ``create_app``) has no
lifecycle: it is always SERVING.
"""

from __future__ import annotations

import asyncio
import enum
from types import TracebackType

from tensorserve.errors import ModelNotReady

SHUTTING_DOWN = "the server is shutting down"


class Phase(str, enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    CLOSING = "closing"
    ABORTING = "aborting"


class Lifecycle:
    """The phase, and the infer calls in flight (their handlers' tasks, HTTP or gRPC).
    Used on the event loop's thread only."""

    def __init__(self) -> None:
        self.phase = Phase.SERVING
        self._in_flight: set[asyncio.Task[object]] = set()
        self._aborted: set[asyncio.Task[object]] = set()
        self._idle: asyncio.Event | None = None  # made on the loop, when first awaited

    @property
    def draining(self) -> bool:
        return self.phase is not Phase.SERVING

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def track(self) -> Tracked:
        """Count the calling handler as in flight; if the grace period ends
        while it waits, it fails with ``ModelNotReady`` (a 503) instead of
        being cancelled under its connection."""
        if self.phase is Phase.ABORTING:
            raise ModelNotReady(f"{SHUTTING_DOWN}; send this request to another replica")
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        return Tracked(self, task)

    def _untrack(self, task: asyncio.Task[object], exc: BaseException | None) -> None:
        self._in_flight.discard(task)
        if not self._in_flight and self._idle is not None:
            self._idle.set()
        if not isinstance(exc, asyncio.CancelledError) or task not in self._aborted:
            return  # done, failed, or the client left (aiohttp's handler cancellation)
        self._aborted.discard(task)
        if hasattr(task, "uncancel"):  # Python 3.11+: the cancel was ours, and is handled
            task.uncancel()
        raise ModelNotReady(
            f"{SHUTTING_DOWN} and its grace period ended before this request finished; "
            f"send it to another replica"
        ) from None

    async def wait_idle(self, timeout: float) -> bool:
        """True once no infer request is in flight; False after ``timeout`` s."""
        if not self._in_flight:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def abort(self) -> int:
        """Enter ABORTING: every request in flight is answered 503 at its next
        step (its queued items are withdrawn, like a caller that left); new
        ones are refused. Returns how many were in flight."""
        self.phase = Phase.ABORTING
        for task in self._in_flight:
            self._aborted.add(task)
            task.cancel(SHUTTING_DOWN)
        return len(self._in_flight)


class Tracked:
    """``with lifecycle.track():`` a plain context manager, not a generator:
    it is entered on every infer request (a generator's costs ~2% of the
    loop's time per request)."""

    __slots__ = ("_lifecycle", "_task")

    def __init__(self, lifecycle: Lifecycle, task: asyncio.Task[object]) -> None:
        self._lifecycle, self._task = lifecycle, task

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lifecycle._untrack(self._task, exc)
