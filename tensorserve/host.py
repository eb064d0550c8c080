"""The host: how many CPUs this process may really use: the cores it may
run on, and a container's CPU quota (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``). The runtime sizes its
threads and picks process isolation by it, the front-end supervisor its
``--frontends auto``: a fact of the machine, below both. ``choose_frontends``
adds the GPUs (``gpus.py``) to decide the front ends a server starts.

``os.cpu_count()`` counts the node's cores: a pod limited to 2 CPUs on a
64-core node would otherwise start 63 intra-op threads, which the kernel then
throttles to 2 CPUs' worth of time per period. Nothing here runs at import;
every path is a parameter so the tests give fake cgroup trees.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tensorserve.gpus import torch_has_cuda, visible_gpus

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 mounts the cpu controller under one of these names.
V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_paths(proc_cgroup: Path) -> dict[str, PurePosixPath]:
    """The process's cgroup per hierarchy from ``/proc/self/cgroup``: the
    key ``""`` is cgroup v2's unified hierarchy, others are v1 controllers."""
    paths: dict[str, PurePosixPath] = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = PurePosixPath(parts[2] or "/")
    return paths


def _ancestors(mount: Path, own: PurePosixPath | None) -> list[Path]:
    """The process's cgroup folder under ``mount`` and every parent up to the
    mount itself: a limit set on a parent binds its children too. Inside a
    container (its own cgroup namespace) that is just the mount."""
    folders = [mount]
    if own is not None:
        relative = own.relative_to("/") if own.is_absolute() else own
        for depth in range(1, len(relative.parts) + 1):
            folders.append(mount.joinpath(*relative.parts[:depth]))
    return folders


def _v2_quota(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")  # "max 100000" or "200000 100000"
    if text is None:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max":
        return None
    try:
        return int(quota) / int(period or "100000")
    except (ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        if quota is None or period is None or int(quota) <= 0:  # -1: no quota
            return None
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota (in CPUs, possibly fractional) that binds this process,
    or ``None`` when there is none. The smallest quota along the cgroup path
    wins, in whichever hierarchy (v2 or v1) the files are found."""
    own = _own_paths(proc_cgroup)
    quotas = [q for folder in _ancestors(root, own.get("")) if (q := _v2_quota(folder))]
    for name in V1_CPU_DIRS:
        mount = root / name
        if mount.is_dir():
            quotas += [
                q for folder in _ancestors(mount, own.get("cpu")) if (q := _v1_quota(folder))
            ]
            break
    return min(quotas) if quotas else None


def usable_cores() -> int:
    """The cores this process may be scheduled on (a cpuset or ``taskset``
    narrows them), else every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)  # pragma: no cover - macOS, Windows


def available_cpus(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP, cores: int | None = None
) -> int:
    """Whole CPUs this process may use: its usable cores, capped by the CPU
    quota rounded up (a 1.5-CPU quota still lets two threads make progress)."""
    cores = usable_cores() if cores is None else cores
    quota = cpu_quota(root, proc_cgroup)
    if quota is None:
        return cores
    return max(1, min(cores, math.ceil(quota)))


# ``--frontends auto``: the CPUs less one (the scheduler process's), 1 to this.
MAX_AUTO_FRONTENDS = 8


def auto_frontends(cpus: int) -> int:
    """The front-end processes ``--frontends auto`` starts on ``cpus`` CPUs."""
    return max(1, min(MAX_AUTO_FRONTENDS, cpus - 1))


@dataclass(frozen=True)
class FrontendsChoice:
    """How many front-end processes a server starts, and why, as its startup
    line shows it (``default → 3 (auto: 1 GPU, 4 CPUs)``)."""

    count: int
    shown: str


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def choose_frontends(
    frontends: int | str | None,
    device: str,
    *,
    gpus: int | None = None,
    cpus: int | None = None,
    torch_cuda: bool | None = None,
) -> FrontendsChoice:
    """The front ends for ``--frontends`` (None: not set) on this machine.

    A number, or ``auto``, is the user's and always wins. Unset, a server
    that will feed a GPU (one is visible and ``device`` is not ``cpu``)
    takes ``auto``'s count: one process decoding and encoding every request
    left a GPU-like model 70-74% idle, four fed it 98% (docs/gpu.md). On the
    CPU, one process: there the front ends would take cores from the models,
    as on a GPU that this torch cannot use (a CPU-only build: NVML counts the
    driver's GPUs). ``gpus``, ``cpus`` and ``torch_cuda`` are for tests (None:
    this machine's)."""
    if isinstance(frontends, int):
        return FrontendsChoice(frontends, str(frontends))
    cpus = available_cpus() if cpus is None else cpus
    if frontends == "auto":
        count = auto_frontends(cpus)
        return FrontendsChoice(count, f"auto → {count} ({_plural(cpus, 'CPU')})")
    if device == "cpu":
        return FrontendsChoice(1, "default → 1 (device=cpu)")
    gpus = visible_gpus() if gpus is None else gpus
    if gpus == 0:
        return FrontendsChoice(1, "default → 1 (no GPU visible)")
    if not (torch_has_cuda() if torch_cuda is None else torch_cuda):
        return FrontendsChoice(
            1, f"default → 1 ({_plural(gpus, 'GPU')} visible, but torch has no CUDA)"
        )
    count = auto_frontends(cpus)
    return FrontendsChoice(
        count, f"default → {count} (auto: {_plural(gpus, 'GPU')}, {_plural(cpus, 'CPU')})"
    )


# Linux's PR_SET_NAME: a thread's name in /proc/<pid>/task/<tid>/comm, 15 bytes.
PR_SET_NAME = 15


def native_thread_name(python_name: str) -> str:
    """A thread's Python name, cut to what the OS keeps (15 bytes):
    ``tagger-instance-0-collect`` becomes ``tagger/0c``, ``tensorserve-request_0``
    ``ts-request_0``."""
    short = (
        python_name.replace("tensorserve-", "ts-")
        .replace("-instance-", "/")
        .replace("-collect", "c")
    )
    return short.encode()[:15].decode(errors="ignore")


def name_native_thread() -> None:
    """Give the calling thread its Python name in the OS too, so that ``top -H``,
    ``/proc``, py-spy's native view and benchmarks/gpu_fill.py's busiest threads
    tell a model's launch thread from the event loop (else each is ``python3``).
    Linux only; anywhere else, or without libc's prctl, nothing happens."""
    import sys
    import threading

    if not sys.platform.startswith("linux"):
        return
    import ctypes

    name = native_thread_name(threading.current_thread().name)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode(), 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: the name is cosmetic
        return
