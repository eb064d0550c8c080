"""How far behind the server's event loop runs: ``LoopLag``.

A request that arrives while the loop is busy waits in its socket until the
loop comes round to it, and its answer waits again before it is written.
Neither wait is seen by a model's queue, so neither the queue's metrics nor
a latency target's admission (batching/target.py) show a saturated front
end: measured on the embedder at its capacity (2-core VM, 2026-11-24),
refusals came back after 225 ms at p99, all of it spent before the queue
was asked. The loop's lag, how late a timer runs past its time, measures
that wait: a timer every ``interval_s`` notes how late it ran. A new lag is
taken at once, a lag that ended fades over a few ticks (``DECAY``), so one
late tick is still seen by a scrape soon after.

Read by ``/metrics`` (``tensorserve_event_loop_lag_seconds``, labelled with
the process's role and pid: metrics/processes.py): the signal to add
replicas on. Written only by its own timer, on the loop.
"""

from __future__ import annotations

import asyncio


class LoopLag:
    INTERVAL_S = 0.005
    # The scheduler process of ``--frontends N`` ticks less often: each tick
    # wakes its loop (~50 us of CPU on a VM), one a batch of a 5 ms model,
    # and its lag is only exported; its front ends, which serve the HTTP
    # and gRPC calls, tick every INTERVAL_S.
    SCHEDULER_INTERVAL_S = 0.05
    DECAY = 0.8  # weight of the previous lag at each tick, when the new one is smaller

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.seconds = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        """Start measuring the running loop (call on it); again: restart."""
        self.stop()
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self.interval_s
        self._timer = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        self.observe(self._loop.time() - self._due)
        self._schedule()

    def observe(self, late: float) -> None:
        """One tick that ran ``late`` seconds after its time."""
        late = max(0.0, late)
        self.seconds = (
            late if late >= self.seconds else self.DECAY * self.seconds + (1 - self.DECAY) * late
        )
