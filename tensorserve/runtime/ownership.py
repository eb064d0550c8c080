"""One owner thread at a time for state that threads hand to each other.

A worker process's socket is used by whichever thread holds its instance:
the event loop while it drives a batch (the direct path), else the
instance's model thread; the batcher's instance states decide which, under
its lock (batching/pipeline.py). ``Owner`` makes that hand-over checkable at
the state itself: the thread about to use it ``acquire``s it, every
owner-only method ``check``s, and the last ``release`` frees it for the
next thread. A second thread that reaches for it while it is held gets
``NotOwner`` at once, instead of interleaving two messages on one socket.

It is a check, not a lock that waits: a thread that would have to wait for
the owner is a bug in the hand-over, never a reason to block the event loop.
Holds nest (a model thread that sends a batch ahead holds it twice).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class NotOwner(RuntimeError):
    """A thread used state that another thread holds (a hand-over bug)."""


class Owner:
    def __init__(self, what: str) -> None:
        self.what = what
        # Held (never waited for) while a thread owns the state: taking it is
        # one atomic test-and-set, so of two threads that reach at once, one
        # is refused.
        self._held = threading.Lock()
        self._thread: int | None = None
        self._holds = 0

    @property
    def thread(self) -> int | None:
        """The ident of the thread that holds it; None when free."""
        return self._thread

    def acquire(self) -> None:
        """This thread owns it until a matching ``release``."""
        me = threading.get_ident()
        if self._thread == me:  # only this thread could have set it to itself
            self._holds += 1
            return
        if not self._held.acquire(blocking=False):
            raise self._refused(me)
        self._thread = me
        self._holds = 1

    def release(self) -> None:
        me = threading.get_ident()
        if self._thread != me:
            raise self._refused(me)
        self._holds -= 1
        if not self._holds:
            self._thread = None
            self._held.release()

    def check(self) -> None:
        """``NotOwner`` unless the calling thread holds it."""
        me = threading.get_ident()
        if self._thread != me:
            raise self._refused(me)

    @contextmanager
    def held(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def _refused(self, me: int) -> NotOwner:
        holder = "nobody" if self._thread is None else f"thread {self._thread}"
        return NotOwner(f"{self.what} is held by {holder}; thread {me} may not use it")
