"""(placeholder until the procmetrics branch lands)"""

from __future__ import annotations

import os
from collections.abc import Callable


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


class ProcessMetrics:
    def __init__(self, role: str, loop_lag: Callable[[], float] | None) -> None:
        self.role = role

    def report(self, role: str, pid: int, cpu_seconds: float, loop_lag_seconds: float) -> None:
        pass

    def forget(self, pid: int) -> None:
        pass
