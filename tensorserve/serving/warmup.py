"""Which instances the warm-up grid runs on (``ServedModel.warmup``).

The scheduler sends a batch to the least busy instance, so a grid sent one
batch after another would warm only the first. Each instance on a GPU runs
the grid itself: it pays its own CUDA context, cuBLAS set-up, memory pool and
every graph bucket's capture, which would otherwise fall on live traffic. On
the CPU the first instance alone runs it: instances in threads share the
process's allocator and lazy initialisation, and warming each would multiply
a CPU model's time to ready (and CI's) for little (a worker process of its
own pays its first batches on traffic, as before).

Models load at once, but on a GPU one model starts and warms up at a time
(``turns_on``, in the registry): a model's first batches there time its
forward for ``compile = "auto"`` (a worker process does it as it starts)
and capture its CUDA graphs, and another model's warm-up on the same GPU
would make that forward look slower on the device than it is alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tensorserve.batching.executor import Executor
from tensorserve.runtime.device import resolve_device
from tensorserve.runtime.executor import ThreadExecutor
from tensorserve.runtime.isolated import ProcessExecutor

log = logging.getLogger(__name__)

# A model waits this long for the one whose turn it is, then goes ahead
# alongside it (its timing may then read slow): a model whose warm-up hangs
# until the watchdog answers must not hold every other model's load.
TURN_WAIT_S = 60.0


@dataclass
class _Turn:
    """One GPU's turn: who holds it, since when; waiters wait on ``changed``."""

    changed: threading.Condition = field(default_factory=threading.Condition)
    holder: str | None = None
    since: float = 0.0


_turns: dict[torch.device, _Turn] = {}
_turns_lock = threading.Lock()


@contextlib.contextmanager
def turns_on(devices: Sequence[torch.device], model: str) -> Iterator[None]:
    """Hold the turn of each GPU among ``devices`` (none for a CPU), taken in
    one order for every model so that two models on two GPUs never wait on
    each other."""
    taken: list[_Turn] = []
    try:
        for device in sorted({d for d in devices if d.type != "cpu"}, key=str):
            turn = _take(device, model)
            if turn is not None:
                taken.append(turn)
        yield
    finally:
        for turn in taken:
            with turn.changed:
                turn.holder = None
                turn.changed.notify_all()


def _take(device: torch.device, model: str) -> _Turn | None:
    """The device's turn, once its holder gives it back; None when the holder
    has kept it ``TURN_WAIT_S`` (the caller goes ahead alongside, said once)."""
    with _turns_lock:
        turn = _turns.setdefault(device, _Turn())
    with turn.changed:
        while turn.holder is not None:
            held = time.monotonic() - turn.since
            if held >= TURN_WAIT_S:
                log.warning("model %r: model %r has been starting on %s for %.0f s; starting "
                            "alongside it", model, turn.holder, device, held)  # fmt: skip
                return None
            turn.changed.wait(TURN_WAIT_S - held)
        turn.holder, turn.since = model, time.monotonic()
        return turn


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
