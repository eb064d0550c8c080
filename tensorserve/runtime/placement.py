"""Where a model's instances run: Triton's instance groups over devices.

    [[instance_group]]          # config.toml: two instances on each of GPUs 0 and 1
    count = 2
    kind = "KIND_GPU"
    gpus = [0, 1]

``place`` turns the groups into one ``Placement`` per device (the counts of
groups that name the same device add up). A model whose ``device`` is left to
``auto`` with no group has Triton's default, an implicit ``KIND_AUTO`` group:
``instance_count`` instances on every visible GPU, else on the CPU. A model on
several devices gets a ``PlacedExecutor`` (threads) or a ``ProcessExecutor``
with one worker per instance on its own device, so one server keeps every GPU
busy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorserve.errors import ConfigError
from tensorserve.host import available_cpus
from tensorserve.repository.config import ModelConfig
from tensorserve.runtime.cuda_diagnosis import cuda_missing
from tensorserve.runtime.device import DeviceContext, resolve_device
from tensorserve.runtime.executor import ThreadExecutor, on_device


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu", "cuda:N", or (no instance_group) the config's own device
    count: int


def place(config: ModelConfig, gpu_count: int | None = None) -> list[Placement]:
    """One placement per device, in the order the groups name them. Without
    instance groups, Triton's default: ``device = "auto"`` or a bare
    ``"cuda"`` (the model's own, or the server's ``--device`` in its place:
    the GPU image says ``cuda``) is ``instance_count`` on each visible GPU.
    With none, ``auto`` runs on the CPU (its placement stays ``auto``: the
    server warns once) and ``cuda`` stays ``cuda``, which fails to load
    saying why CUDA is missing. ``cpu`` and ``cuda:N`` are that one device.
    ``gpu_count``: the GPUs torch sees (for tests; None: ask torch, which
    will run the model)."""
    every_gpu = config.device in ("auto", "cuda")
    if not config.instance_group and not every_gpu:
        return [Placement(config.device, config.instance_count)]
    if gpu_count is None:
        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not config.instance_group:
        if gpu_count == 0:
            return [Placement(config.device, config.instance_count)]
        return [Placement(f"cuda:{g}", config.instance_count) for g in range(gpu_count)]
    counts: dict[str, int] = {}
    for index, group in enumerate(config.instance_group):
        kind = group.kind
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if group.gpus is not None or gpu_count else "KIND_CPU"
        if kind == "KIND_CPU":
            devices = ["cpu"]
        else:
            if gpu_count == 0:
                raise ConfigError(
                    f"instance_group[{index}]: KIND_GPU needs a GPU, and CUDA sees none: "
                    f"{cuda_missing()}"
                )
            gpus = list(range(gpu_count)) if group.gpus is None else group.gpus
            missing = [g for g in gpus if g >= gpu_count]
            if missing:
                raise ConfigError(
                    f"instance_group[{index}]: gpus {missing} do not exist "
                    f"({gpu_count} GPU(s) visible: 0..{gpu_count - 1})"
                )
            devices = [f"cuda:{g}" for g in gpus]
        for device in devices:
            counts[device] = counts.get(device, 0) + group.count
    return [Placement(device, count) for device, count in counts.items()]


def resolve_placement(
    config: ModelConfig, gpu_count: int | None = None
) -> tuple[ModelConfig, list[Placement]]:
    """The config to build the model with, and where its instances go. On
    one device the config comes back with that ``device`` and
    ``instance_count`` and no groups, so every executor runs it as before
    (``auto`` on one GPU becomes ``cuda:0``; on none it stays ``auto``)."""
    placements = place(config, gpu_count)
    if len(placements) == 1 and (config.instance_group or placements[0].device != config.device):
        only = placements[0]
        config = config.model_copy(
            update={"device": only.device, "instance_count": only.count, "instance_group": []}
        )
    return config, placements


class PlacedExecutor(ThreadExecutor):
    """Instances over several devices: a ``ThreadExecutor`` whose instances
    run, placement by placement, on that placement's device with its own copy
    of the model (an ``nn.Module`` is deep-copied while still where it was
    loaded, before any copy moves to its device). Instance ``i`` of the
    batcher is the ``i``-th of that flat list."""

    def __init__(
        self,
        fn: Callable[..., Any],
        config: ModelConfig,
        placements: Sequence[Placement],
        intra_op_threads: int | None = None,
        *,
        name: str = "model",
    ) -> None:
        if not placements:
            raise ValueError("PlacedExecutor needs at least one placement")
        is_module = isinstance(fn, torch.nn.Module)
        copies = [fn] + [copy.deepcopy(fn) if is_module else fn for _ in placements[1:]]
        devices = [resolve_device(placement.device) for placement in placements]
        models = [on_device(model, config, device) for model, device in zip(copies, devices)]
        placement_of = [i for i, placement in enumerate(placements) for _ in range(placement.count)]
        count = len(placement_of)
        super().__init__(
            models[0], config, devices[0],
            instance_count=count, intra_op_threads=intra_op_threads, name=name,
        )  # fmt: skip
        self.models = [models[i] for i in placement_of]
        self._contexts = [DeviceContext(devices[i], intra_op_threads) for i in placement_of]
        # Any device that queues work makes launching ahead worth it; on a
        # CPU, launch simply runs the batch to the end.
        self.overlaps = self.pin_memory = any(device.type == "cuda" for device in devices)


def resolve_isolation(
    config: ModelConfig, placements: list[Placement], cpus: int | None = None
) -> ModelConfig:
    """The config with ``isolation = "auto"`` decided (only repository
    models reach here: a worker process imports their model.py).

    A worker process when the model runs on the CPU and this process may use
    two CPUs or more: there the forward and the event loop (decoding,
    encoding, un-padding) no longer take turns at one GIL. On 2 cores, with
    the learnt budget, it served four of the five bundled models 1.1-1.9x
    the items/s of the model in a thread at 32 callers and the GRU tagger about the
    same (docs/performance.md, "Defaults"). A thread on one CPU, where
    the two could not run at once anyway, and on a GPU, where the forward
    waits on the device without the GIL and a worker would only add a copy
    of the inputs and outputs through a socket."""
    if config.isolation != "auto":
        return config
    on_cpu = all(resolve_device(p.device).type == "cpu" for p in placements)
    cpus = available_cpus() if cpus is None else cpus
    isolation = "process" if on_cpu and cpus >= 2 and len(placements) == 1 else "thread"
    return config.model_copy(update={"isolation": isolation})
