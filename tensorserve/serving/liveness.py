"""Liveness: is this process still worth keeping, or should it be restarted?

Readiness says whether a model can take requests now; liveness says whether
waiting can ever make it so. One state only a restart fixes: a forward in a
thread of the server process that the watchdog gave up on (it cannot be
killed: Python has no way to stop a thread), still running. The watchdog
answered its callers; the instance is lost for good. Once one has been stuck
longer than ``--liveness-stall-s``, ``/v2/health/live`` answers 503 and the
orchestrator restarts the pod.

The other: a sticky CUDA error (a device-side assert, an illegal memory
access) in a thread of the server process lost its CUDA context, which no
call can clear (runtime/device.py, ``CONTEXT_LOSS``). Liveness fails at
once: waiting cannot help.

A worker process that hangs is killed and replaced by the watchdog, so it is
never stuck, and the server stays live; so is one whose CUDA context is lost. Nor is a batch the watchdog still
allows (``[faults] watchdog_ms``, off for a compiled model by default):
liveness only counts what the watchdog already gave up on.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from tensorserve.runtime.device import CONTEXT_LOSS
from tensorserve.serving.registry import ModelRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Wedged:
    """One model instance stuck in a forward that cannot be stopped."""

    model: str
    version: str
    instance: int
    stalled_s: float

    def describe(self) -> dict[str, object]:
        return {
            "model": self.model,
            "version": self.version,
            "instance": self.instance,
            "stalled_s": round(self.stalled_s, 1),
        }

    @property
    def reason(self) -> str:
        return (
            f"model {self.model!r} instance {self.instance} has been stuck in a forward "
            f"for {self.stalled_s:.1f} s; a thread cannot be stopped, so only a restart "
            f"frees it"
        )


class Liveness:
    """The one owner of the liveness verdict: asked by the live probe and by
    the metrics scrape, it logs each wedged instance once."""

    def __init__(self, registry: ModelRegistry, stall_s: float) -> None:
        self.registry = registry
        self.stall_s = stall_s  # 0: liveness never fails
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str, int]] = set()

    def wedged(self) -> list[Wedged]:
        """Every instance stuck longer than the limit, by model and instance."""
        if not self.stall_s:
            return []
        found = []
        for entry in sorted(self.registry.entries.values(), key=lambda e: e.name):
            served = entry.served
            if served is None:
                continue
            for instance, stalled_s in served.stuck_instances():
                if stalled_s > self.stall_s:
                    found.append(Wedged(entry.name, str(served.version), instance, stalled_s))
        self._log_new(found)
        return found

    @staticmethod
    def context_lost() -> str | None:
        """Why this process's CUDA context is gone (None: it is not); the
        executor that met the error logged it once."""
        reason = CONTEXT_LOSS.reason
        if reason is None:
            return None
        return f"the CUDA context of this process is lost ({reason}); only a restart recovers it"

    def _log_new(self, found: list[Wedged]) -> None:
        keys = {(w.model, w.version, w.instance): w for w in found}
        with self._lock:
            new = [w for key, w in keys.items() if key not in self._logged]
            self._logged = set(keys)  # an instance that recovers is logged again if it sticks
        for w in new:
            log.error("liveness fails: %s (past --liveness-stall-s %g s)", w.reason, self.stall_s)
