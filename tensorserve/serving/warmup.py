"""Which instances the warm-up grid runs on (``ServedModel.warmup``).

The scheduler sends a batch to the least busy instance, so a grid sent one
batch after another would warm only the first. Each instance on a GPU runs
the grid itself: it pays its own CUDA context, cuBLAS set-up, memory pool and
every graph bucket's capture, which would otherwise fall on live traffic. On
the CPU the first instance alone runs it: instances in threads share the
process's allocator and lazy initialisation, and warming each would multiply
a CPU model's time to ready (and CI's) for little (a worker process of its
own pays its first batches on traffic, as before).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorserve.batching.executor import Executor
from tensorserve.runtime.device import resolve_device
from tensorserve.runtime.executor import ThreadExecutor
from tensorserve.runtime.isolated import ProcessExecutor


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
