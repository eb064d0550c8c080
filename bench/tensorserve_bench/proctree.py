"""A server's CPU seconds by role, read from ``/proc``: its own process (the
scheduler, or the one-process server), its front-end processes and any
other child (model workers), so a benchmark sees where the CPU goes without
asking the server (no metric it may lack, no psutil).

    before = sample_tree(server_pid)
    ...                                         # the measured window
    split = split_cpu(before, sample_tree(server_pid), server_pid)
    split.scheduler_s, split.frontend_s, split.workers_s, split.total_s
    wait_for_frontends(server_pid, 2)           # until the server runs 2 front ends

``sample_tree`` finds the descendants by scanning ``/proc/*/stat`` for
parent pids (``/proc/<pid>/task/*/children`` needs a kernel option that not
every kernel, container or sandbox has). ``root`` points it at another
folder laid out as ``/proc``: the tests build a fake one. ``split_cpu`` is
pure: two samples in, a ``CpuSplit`` out.

A front end is a descendant whose command line holds ``FRONTEND_MARK`` (the
module ``tensorserve serve --frontends N`` starts them with); every other
descendant is a worker. A process is the same one in two samples when its
pid and its start time agree (a pid reused in between counts as new).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FRONTEND_MARK = "tensorserve.frontends.process"
PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessSample:
    """One process at one moment."""

    pid: int
    ppid: int
    started: int  # clock ticks after boot (stat field 22): with pid, the process's identity
    cpu_s: float  # its own user + system seconds (not its reaped children's)
    command: str  # its command line, arguments joined by spaces

    @property
    def is_frontend(self) -> bool:
        return FRONTEND_MARK in self.command


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds a server's tree spent between two samples, by role."""

    scheduler_s: float  # the server's own process (with no front ends: the whole server)
    frontend_s: float  # summed over its front-end processes
    workers_s: float  # summed over every other descendant
    frontends: int  # front-end processes alive at the end
    workers: int  # other descendants alive at the end
    # Processes alive at the start and gone at the end: their CPU after the
    # start is in nobody's figure (a benchmark should see none).
    exited: int

    @property
    def total_s(self) -> float:
        return self.scheduler_s + self.frontend_s + self.workers_s

    def as_row(self, requests: int) -> dict[str, Any]:
        """Each figure in seconds and, over ``requests``, in microseconds a
        request (None when no request was served): a benchmark row's fields."""
        seconds = {
            "scheduler": self.scheduler_s,
            "frontend": self.frontend_s,
            "workers": self.workers_s,
            "total": self.total_s,
        }
        row: dict[str, Any] = {}
        for role, value in seconds.items():
            row[f"{role}_cpu_s"] = value
            row[f"{role}_cpu_us_per_request"] = 1e6 * value / requests if requests else None
        row.update(frontend_processes=self.frontends, worker_processes=self.workers)
        row["exited_processes"] = self.exited
        return row


# ---------------------------------------------------------------------- reading /proc
def parse_stat(text: str, ticks_per_s: float) -> tuple[int, int, float]:
    """``/proc/<pid>/stat`` -> (parent pid, start time in ticks, user + system
    seconds). The command name (field 2) sits in parentheses and may itself
    hold spaces and parentheses: the fields are counted from the last ``)``."""
    fields = text[text.rindex(")") + 1 :].split()
    # fields[0] is field 3 (state): field n is fields[n - 3].
    ppid = int(fields[4 - 3])
    utime, stime = int(fields[14 - 3]), int(fields[15 - 3])
    started = int(fields[22 - 3])
    return ppid, started, (utime + stime) / ticks_per_s


def _read_stats(root: Path, ticks_per_s: float) -> dict[int, tuple[int, int, float]]:
    """Every process's parsed stat under ``root``; those gone while read are skipped."""
    stats = {}
    for entry in os.scandir(root):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:  # it exited between the listing and the read
            continue
        stats[int(entry.name)] = parse_stat(text, ticks_per_s)
    return stats


def _read_command(root: Path, pid: int) -> str:
    try:
        raw = Path(root, str(pid), "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def sample_tree(
    pid: int, *, root: Path = PROC, ticks_per_s: float | None = None
) -> dict[int, ProcessSample]:
    """``pid`` and every descendant of it now, by pid (empty if ``pid`` is gone)."""
    if ticks_per_s is None:
        ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
    stats = _read_stats(root, ticks_per_s)
    if pid not in stats:
        return {}
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in sorted(stats.items()):  # each level in pid order
        children.setdefault(parent, []).append(child)
    members, frontier = [pid], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        members += frontier
    samples = {}
    for member in members:
        ppid, started, cpu_s = stats[member]
        samples[member] = ProcessSample(member, ppid, started, cpu_s, _read_command(root, member))
    return samples


# ---------------------------------------------------------------------- the split
def split_cpu(
    before: Mapping[int, ProcessSample], after: Mapping[int, ProcessSample], server_pid: int
) -> CpuSplit:
    """What each role spent from ``before`` to ``after`` (``sample_tree`` of
    ``server_pid`` both): a process born in between counts from zero."""
    spent = {"scheduler": 0.0, "frontend": 0.0, "workers": 0.0}
    frontends = workers = 0
    for pid, now in after.items():
        then = before.get(pid)
        reused = then is not None and then.started != now.started
        delta = now.cpu_s if then is None or reused else now.cpu_s - then.cpu_s
        if pid == server_pid:
            spent["scheduler"] += delta
        elif now.is_frontend:
            spent["frontend"] += delta
            frontends += 1
        else:
            spent["workers"] += delta
            workers += 1
    exited = sum(
        1 for pid, then in before.items() if pid not in after or after[pid].started != then.started
    )
    return CpuSplit(
        spent["scheduler"], spent["frontend"], spent["workers"], frontends, workers, exited
    )


# ---------------------------------------------------------------------- waiting for them
class FrontendsMissing(RuntimeError):
    """The server did not run as many front-end processes as asked for."""


def wait_for_frontends(
    pid: int, count: int, *, timeout_s: float = 60.0, root: Path = PROC, poll_s: float = 0.1
) -> None:
    """Return once ``pid`` has ``count`` front-end processes among its
    descendants (a server answers ready as soon as one listens); raise
    ``FrontendsMissing`` after ``timeout_s`` seconds without."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = sum(p.is_frontend for p in sample_tree(pid, root=root).values())
        if seen == count:
            return
        if time.monotonic() >= deadline:
            raise FrontendsMissing(
                f"{seen} front-end processes of {count} after {timeout_s:g} s (descendants "
                f"of {pid} whose command line holds {FRONTEND_MARK})"
            )
        time.sleep(poll_s)  # nothing to wait on: the processes are the server's, not ours
