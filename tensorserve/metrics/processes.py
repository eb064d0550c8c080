"""Where the server's CPU goes, one series per process: ``ProcessMetrics``.

One event loop is one core. With ``--frontends N`` (N >= 2) the server is
several processes: N front ends that decode, validate and encode, and one
scheduler process that owns the models and forms the batches. Which of
them is out of CPU decides the cure (more front ends, or a cheaper
scheduler), so each process gets its own series, labelled ``role`` (one of
``ROLES``) and ``pid``:

    tensorserve_process_cpu_seconds_total{role, pid}   user + system CPU
                                                       seconds, all threads
    tensorserve_event_loop_lag_seconds{role, pid}      how late its event
                                                       loop runs a timer

prometheus-client's ``process_cpu_seconds_total`` covers only the process
that answers the scrape; these cover every process of the server. A pid is
a series of its own, so a front end restarted under a new pid starts a new
counter and ``rate()`` never sees one go backwards.

The process that exports ``/metrics`` holds the one ``ProcessMetrics``: its
own figures are read at scrape time (``cpu_seconds()`` and the loop-lag
callable); another process's are the latest it ``report()``-ed (about every
0.5 s, so at most that stale) until it is ``forget()``-ten when it exits.
Reports and forgets arrive on whichever thread receives them and scrapes
run on any thread: the table of reports is guarded by one lock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ROLES", "ProcessMetrics", "cpu_seconds"]

# server: the one process of `--frontends 1`; with N >= 2 one scheduler and N frontends.
ROLES = ("server", "scheduler", "frontend")
LABELS = ["role", "pid"]
CPU_NAME = "tensorserve_process_cpu_seconds"  # exported with the counter's _total
CPU_HELP = "User + system CPU seconds of one of the server's processes (all its threads)."
LAG_NAME = "tensorserve_event_loop_lag_seconds"
LAG_HELP = (
    "How late a server process's event loop runs a timer (a saturated front end: "
    "requests wait this long before they are read, and again before answered)."
)


def cpu_seconds() -> float:
    """User + system CPU seconds this process has used, all its threads
    (its children's not included)."""
    times = os.times()
    return times.user + times.system


def _checked_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"process role {role!r} is not one of {', '.join(ROLES)}")
    return role


@dataclass(frozen=True)
class _Reported:
    role: str
    cpu_seconds: float
    loop_lag_seconds: float


class ProcessMetrics(Collector):
    """This process's CPU and loop lag, and the latest that each other
    process of the server reported (a prometheus-client collector)."""

    def __init__(self, role: str, loop_lag: Callable[[], float] | None) -> None:
        """``role``: this process's (``ROLES``); ``loop_lag``: its event loop's
        lag in seconds, read at each scrape (None: no lag series for it)."""
        self.role = _checked_role(role)
        self._loop_lag = loop_lag
        self._lock = threading.Lock()
        self._reported: dict[int, _Reported] = {}  # pid -> its latest report

    def report(self, role: str, pid: int, cpu_seconds: float, loop_lag_seconds: float) -> None:
        """The latest figures of another process (replacing its last report)."""
        if pid == os.getpid():
            raise ValueError(f"pid {pid} is this process's own: its figures are read, not reported")
        figures = _Reported(_checked_role(role), cpu_seconds, loop_lag_seconds)
        with self._lock:
            self._reported[pid] = figures

    def forget(self, pid: int) -> None:
        """A process that exited: its series are gone from the next scrape.
        A pid never reported (or already forgotten) is no error."""
        with self._lock:
            self._reported.pop(pid, None)

    def describe(self) -> Iterator[Metric]:
        # The names alone, so the registry refuses a second collector of them.
        yield CounterMetricFamily(CPU_NAME, CPU_HELP, labels=LABELS)
        yield GaugeMetricFamily(LAG_NAME, LAG_HELP, labels=LABELS)

    def collect(self) -> Iterator[Metric]:
        cpu = CounterMetricFamily(CPU_NAME, CPU_HELP, labels=LABELS)
        lag = GaugeMetricFamily(LAG_NAME, LAG_HELP, labels=LABELS)
        own = str(os.getpid())  # read here: right in a process forked after construction
        cpu.add_metric([self.role, own], cpu_seconds())
        if self._loop_lag is not None:
            lag.add_metric([self.role, own], self._loop_lag())
        with self._lock:
            reported = sorted(self._reported.items())
        for pid, figures in reported:
            cpu.add_metric([figures.role, str(pid)], figures.cpu_seconds)
            lag.add_metric([figures.role, str(pid)], figures.loop_lag_seconds)
        yield cpu
        yield lag
