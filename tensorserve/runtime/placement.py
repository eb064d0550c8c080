"""Where a model's instances run: Triton's instance groups over devices.

    [[instance_group]]          # config.toml: two instances on each of GPUs 0 and 1
    count = 2
    kind = "KIND_GPU"
    gpus = [0, 1]

``place`` turns the groups into one ``Placement`` per device (the counts of
groups that name the same device add up). A model on one device runs as
before: ``resolve_placement`` hands back the config with that ``device`` and
``instance_count``. A model on several devices gets a ``PlacedExecutor``:
one ``ThreadExecutor`` (one copy of the model) per device, whose instances
the batcher sees as one flat list, so one server keeps every GPU busy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorserve.errors import ConfigError
from tensorserve.repository.config import ModelConfig
from tensorserve.runtime.cpus import available_cpus
from tensorserve.runtime.cuda_diagnosis import cuda_missing
from tensorserve.runtime.device import resolve_device
from tensorserve.runtime.executor import Executed, Launched, ThreadExecutor, on_device
from tensorserve.tensors.dtypes import Feature


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu", "cuda:N", or (no instance_group) the config's own device
    count: int


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place(config: ModelConfig, gpu_count: int | None = None) -> list[Placement]:
    """One placement per device, in the order the groups name them. Without
    instance groups: the config's own ``device`` and ``instance_count``."""
    if not config.instance_group:
        return [Placement(config.device, config.instance_count)]
    gpus_here = visible_gpus() if gpu_count is None else gpu_count
    counts: dict[str, int] = {}
    for index, group in enumerate(config.instance_group):
        kind = group.kind
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if group.gpus is not None or gpus_here else "KIND_CPU"
        if kind == "KIND_CPU":
            devices = ["cpu"]
        else:
            if gpus_here == 0:
                raise ConfigError(
                    f"instance_group[{index}]: KIND_GPU needs a GPU, and CUDA sees none: "
                    f"{cuda_missing()}"
                )
            gpus = list(range(gpus_here)) if group.gpus is None else group.gpus
            missing = [g for g in gpus if g >= gpus_here]
            if missing:
                raise ConfigError(
                    f"instance_group[{index}]: gpus {missing} do not exist "
                    f"({gpus_here} GPU(s) visible: 0..{gpus_here - 1})"
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
    ``instance_count`` and no groups, so every executor runs it as before."""
    placements = place(config, gpu_count)
    if config.instance_group and len(placements) == 1:
        only = placements[0]
        config = config.model_copy(
            update={"device": only.device, "instance_count": only.count, "instance_group": []}
        )
    return config, placements


@dataclass
class Routed:
    """A batch launched on one part of a ``PlacedExecutor``."""

    part: ThreadExecutor
    launched: Launched


class PlacedExecutor:
    """Instances over several devices: one ``ThreadExecutor`` per device,
    each with its own copy of the model. Instance ``i`` of the batcher is
    the ``i``-th instance of the flat list, part by part. It implements the
    batcher's ``Executor`` contract by routing each call to its part."""

    def __init__(self, parts: Sequence[ThreadExecutor]) -> None:
        if not parts:
            raise ValueError("PlacedExecutor needs at least one part")
        self.parts = list(parts)
        self._route = [(part, local) for part in self.parts for local in range(part.instance_count)]
        self.instance_count = len(self._route)
        self.device = self.parts[0].device
        self.fn = self.parts[0].fn
        # Any part that queues work on a device makes launching ahead worth it;
        # on a CPU part launch simply runs the batch to the end.
        self.overlaps = any(part.overlaps for part in self.parts)
        self.pin_memory = any(part.pin_memory for part in self.parts)
        self.restarts = 0  # threads are never replaced
        self.restart_seconds: float | None = None

    def abort(self, routed: Routed, because: str) -> bool:
        return routed.part.abort(routed.launched, because)

    def repair(self, instance: int) -> None:
        part, local = self._route[instance]
        part.repair(local)

    def free_memory_bytes(self) -> int | None:
        """The least any part's device has: batches form under one ceiling."""
        known = [part.free_memory_bytes() for part in self.parts]
        return None if None in known else min(b for b in known if b is not None)

    def health(self) -> str | None:
        return next((why for part in self.parts if (why := part.health())), None)

    def devices(self) -> list[torch.device]:
        """Each instance's device, in the batcher's instance order."""
        return [part.device for part, _ in self._route]

    def start_instance(self, instance: int) -> None:
        part, local = self._route[instance]
        part.start_instance(local)

    def launch(
        self,
        features: dict[str, Feature],
        instance: int,
        parameters: Mapping[str, list[Any]] | None = None,
    ) -> Routed:
        part, local = self._route[instance]
        return Routed(part, part.launch(features, local, parameters))

    def collect(self, routed: Routed) -> Executed:
        return routed.part.collect(routed.launched)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def placed_thread_executor(
    fn: Callable[..., Any],
    config: ModelConfig,
    placements: Sequence[Placement],
    intra_op_threads: int | None = None,
) -> PlacedExecutor:
    """One model copy per placement (an ``nn.Module`` is deep-copied while
    still where it was loaded, before any copy moves to its device)."""
    is_module = isinstance(fn, torch.nn.Module)
    copies = [fn] + [copy.deepcopy(fn) if is_module else fn for _ in placements[1:]]
    parts = []
    for model, placement in zip(copies, placements):
        device = resolve_device(placement.device)
        parts.append(
            ThreadExecutor(
                on_device(model, config, device),
                config,
                device,
                instance_count=placement.count,
                intra_op_threads=intra_op_threads,
            )
        )
    return PlacedExecutor(parts)


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
