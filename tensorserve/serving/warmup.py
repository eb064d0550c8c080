"""Which instances the warm-up grid runs on (``ServedModel.warmup``).

The scheduler sends a batch to the least busy instance, so a grid sent one
batch after another would warm only the first. Each instance on a GPU runs
the grid itself: it pays its own CUDA context, cuBLAS set-up, memory pool and
every graph bucket's capture, which would otherwise fall on live traffic. On
the CPU the first instance alone runs it: instances in threads share the
process's allocator and lazy initialisation, and warming each would multiply
a CPU model's time to ready (and CI's) for little (a worker process of its
own pays its first batches on traffic, as before).

Models load at once, but on a GPU their warm-ups take turns (``turn_on``):
a model's first batch there times its forward for ``compile = "auto"`` and
captures its CUDA graphs, and another model's warm-up on the same GPU
would make that forward look slower on the device than it is alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence

import torch

from tensorserve.batching.executor import Executor
from tensorserve.runtime.device import resolve_device
from tensorserve.runtime.executor import ThreadExecutor
from tensorserve.runtime.isolated import ProcessExecutor

log = logging.getLogger(__name__)

# A warm-up waits this long for another model's on its GPU, then goes ahead
# (its timing may then read slow): a model whose warm-up hangs until the
# watchdog answers must not hold every other model's load.
TURN_WAIT_S = 60.0
_turns: dict[torch.device, threading.Lock] = {}
_turns_lock = threading.Lock()


@contextlib.contextmanager
def turn_on(device: torch.device, model: str) -> Iterator[None]:
    """One warm-up at a time on each GPU (nothing on a CPU, where a timing
    and captures never run)."""
    if device.type == "cpu":
        yield
        return
    with _turns_lock:
        turn = _turns.setdefault(device, threading.Lock())
    mine = turn.acquire(timeout=TURN_WAIT_S)
    if not mine:
        log.warning("model %r: another model's warm-up has held %s for %.0f s; warming up "
                    "alongside it", model, device, TURN_WAIT_S)  # fmt: skip
    try:
        yield
    finally:
        if mine:
            turn.release()


def instance_devices(executor: Executor) -> list[torch.device]:
    """Each instance's device, in the scheduler's instance order; an
    executor of another kind: its instances counted as on the CPU."""
    if isinstance(executor, ThreadExecutor):  # a PlacedExecutor too
        return executor.devices()
    if isinstance(executor, ProcessExecutor):
        return [resolve_device(device) for device in executor.device_of]
    return [torch.device("cpu")] * executor.instance_count


def warmed_instances(devices: Sequence[torch.device]) -> list[int]:
    """The instances that run the grid: the first, and every one not on the CPU."""
    return [i for i, device in enumerate(devices) if i == 0 or device.type != "cpu"]
