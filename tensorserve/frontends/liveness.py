"""Whether a silent front end is stuck, or only busy: ``Liveness``.

A front end sends something at least every 0.5 s (its report). One that has
sent nothing for ``SILENT_S`` is not necessarily stuck: a large body decoded
in C holds the GIL, so neither its loop nor any heartbeat thread can run,
yet it is working. So silence alone kills nothing: a silent front end is
stuck only if its CPU time (``/proc/<pid>/stat``, all its threads) has not
advanced for ``SILENT_S`` either (stopped, deadlocked, waiting on nothing);
one silent but busy for ``BUSY_LIMIT_S`` is stuck too (a loop that never
returns). Pure but for ``cpu_ticks``: the clock and the CPU readings are
passed in, so the rule is tested with made-up times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# A front end that sent nothing for this long (it reports every 0.5 s) and
# used no CPU meanwhile is stuck; one that sent nothing this long after it
# started never started.
SILENT_S = 5.0
STARTING_S = 120.0
# Silent this long, however busy: its loop never runs (no request of ours
# takes a front end this long to decode).
BUSY_LIMIT_S = 60.0


@dataclass(frozen=True)
class Stuck:
    """Why a front end is to be killed: silent ``for_s`` seconds, and ``why``."""

    for_s: float
    why: str


@dataclass
class Liveness:
    """One front end's signs of life, as the scheduler process last saw them."""

    attached: float  # when it was started (its clock: the hub loop's)
    heard: float | None = None  # when it last sent anything (None: never yet)
    cpu: int | None = None  # its CPU time at the last look, in clock ticks
    working: float | None = None  # when its CPU time was last seen advancing

    def check(self, now: float, read_cpu: Callable[[], int | None]) -> Stuck | None:
        """A ``Stuck`` if the front end is to be killed now, else None.
        ``read_cpu`` (its CPU ticks, None if unreadable) is called only
        while it is silent: the look costs nothing while it talks."""
        quiet_since = self.attached if self.heard is None else self.heard
        grace = STARTING_S if self.heard is None else SILENT_S
        if now - quiet_since <= grace / 2:
            self.cpu = self.working = None  # a fresh baseline at the next silence
            return None
        cpu = read_cpu()
        if cpu is not None and self.cpu is not None and cpu != self.cpu:
            self.working = now
        self.cpu = cpu
        quiet = now - quiet_since
        if quiet <= grace:
            return None
        if self.working is not None and now - self.working <= SILENT_S:
            limit = max(grace, BUSY_LIMIT_S)
            if quiet <= limit:
                return None  # busy (a long C call holds its GIL): let it finish
            return Stuck(limit, "busy all along, its loop never free")
        if cpu is None:
            return Stuck(grace, "its CPU time cannot be read")
        return Stuck(grace, "using no CPU time either")


def cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of process ``pid`` (all its threads), in clock
    ticks, from ``/proc/<pid>/stat``; None where unreadable (not Linux, or
    the process has gone). One small read: cheap enough for the loop."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # After "pid (comm) ": state is field 3, utime and stime fields 14 and 15
    # (the command may hold spaces and parentheses: split after the last one).
    fields = text[text.rindex(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])
