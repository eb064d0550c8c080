"""When the scheduler process reads its front ends' sockets: ``ReadPacing``.

Each read costs the scheduler process a wake-up of its loop (~50 us of CPU
on a VM, before any work), and the code it runs then starts cold. Each
front end sends a message per loop iteration of its own, so the process
woke two or three times per batch only to queue requests that could not
run before the batch on the device ended: with every instance of every
model busy, a request read now and one read when that batch ends go into
the same next batch.

So while no instance of any model has room, the front ends' sockets are
not watched. When a batch ends, before the next one forms
(``Scheduler.before_forming``), everything waiting in them is read and
queued, so the next batch is chosen from all of it, as before; then, if
every model is busy again, they stay unwatched until the next batch ends.
At most ``MAX_PAUSE_S`` goes by without a read, so a cancel, a question
(health, metadata) or a front end's exit waits no longer than that behind
a long batch. With an instance free nothing waits: a request may start a
batch at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from tensorserve.dataplane.plane import DataPlane
from tensorserve.serving.model import ServedModel

if TYPE_CHECKING:
    from tensorserve.ipc.link import Link

# The longest the sockets go unread behind busy models.
MAX_PAUSE_S = 0.01


class ReadPacing:
    """Owned by the hub; runs on the scheduler process's loop."""

    def __init__(
        self,
        plane: DataPlane,
        loop: asyncio.AbstractEventLoop,
        held_wakes: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self.plane, self.loop = plane, loop
        self._held_wakes = held_wakes  # the intake's: admit all that is read, then batch
        self._paused: list[Link] = []
        self._timer: asyncio.TimerHandle | None = None
        self._rechecking = False

    def after_message(self, link: Link) -> None:
        """Stop watching ``link`` while every model is busy."""
        if link.paused or not link.open or not self._all_busy():
            return
        link.pause_reading()
        self._paused.append(link)
        self._arm()

    def read_now(self) -> None:
        """Read what waits in every unwatched socket (a batch ended, before
        the next forms; or the pause is up); watch them again unless every
        model is busy once the loop has formed what it can."""
        self._paused = [link for link in self._paused if link.open]
        with self._held_wakes():
            for link in self._paused:
                link.read_pending()
        if self._paused and not self._rechecking:
            self._rechecking = True
            self.loop.call_soon(self._recheck)

    def _recheck(self) -> None:
        self._rechecking = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._paused:
            return
        if self._all_busy():
            self._arm()
            return
        paused, self._paused = self._paused, []
        for link in paused:
            link.resume_reading()

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(MAX_PAUSE_S, self._time_up)

    def _time_up(self) -> None:
        self._timer = None
        self.read_now()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._paused.clear()

    def _all_busy(self) -> bool:
        """No instance of any served model has room; each such scheduler
        then reads the sockets as its batches end (``before_forming``)."""
        busy = False
        for entry in self.plane.registry.entries.values():
            served = entry.served
            if not isinstance(served, ServedModel):
                continue  # an ensemble: its steps are models of their own
            scheduler = served.batcher.scheduler
            if scheduler.free_instance() is not None:
                return False
            scheduler.before_forming = self.read_now
            busy = True
        return busy
