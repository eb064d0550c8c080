"""Runs padded batches of a torch callable on its device.

``PaddedRunner`` is the ``Runner`` the batcher drives for every model, a
repository model or any batch function given pad values:

    prepare  (model thread)       pad into one host tensor per feature, pinned on CUDA
    launch   (model thread)       one non_blocking host->device copy per feature,
                                  forward under inference_mode, outputs cast to
                                  their declared dtype and copied back to pinned
                                  host memory once per batch (queued on CUDA)
    collect  (model thread)       one synchronisation per batch
    finish   (finisher thread)    slice each row back to its item's true extents

A batch function may return one tensor (single output), a dict of output
name -> tensor, or a list with one entry per item, where an entry may be an
Exception that fails that item alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorserve.batching import collate
from tensorserve.errors import ModelFailure
from tensorserve.repository.config import VARIABLE, ModelConfig
from tensorserve.runtime.device import DeviceContext
from tensorserve.tensors.dtypes import from_torch


def on_device(fn: Callable[..., Any], config: ModelConfig, device: torch.device) -> Callable[..., Any]:
    """The model moved to its device and, if the config asks, ``torch.compile``d
    (compiled lazily per shape: the warm-up grid pays for it before ready)."""
    if hasattr(fn, "to"):
        fn = fn.to(device)
    if config.compile != "off":
        fn = torch.compile(fn, mode=None if config.compile == "default" else config.compile)
    return fn


@dataclass
class Launched:
    batch: collate.PaddedBatch
    host: dict[str, torch.Tensor] | None  # batched outputs (pinned, still filling on CUDA)
    done: torch.cuda.Event | None  # recorded after the last device->host copy
    per_item: list[Any] | None
    worker: tuple[int, int] | None = None  # (instance, ticket) of a worker process's batch


@dataclass
class Executed:
    batch: collate.PaddedBatch
    outputs: dict[str, np.ndarray] | None  # batched host outputs
    per_item: list[Any] | None  # or: the batch function's own per-item list
    # Time the model itself took, when the runner knows it better than the
    # batcher's launch-to-collect clock (a worker process with a batch queued
    # behind another reports its own compute time).
    seconds: float | None = None


class PaddedRunner:
    def __init__(
        self,
        fn: Callable[..., Any],
        config: ModelConfig,
        device: torch.device,
        *,
        instance_count: int = 1,
        intra_op_threads: int | None = None,
    ) -> None:
        self.fn = fn
        self.config = config
        self.device = device
        self.instance_count = instance_count
        self._inputs = config.input
        self._outputs = config.output
        self._sources = {out.name: config.unpad_source(out) for out in config.output}
        self._primary = next((s for s in config.input if s.variable_axes), None)
        self._pad_multiple = config.dynamic_batching.pad_to_multiple_of
        self._contexts = [DeviceContext(device, intra_op_threads) for _ in range(instance_count)]
        # On CUDA, launch returns once the work is queued: the batcher pads and
        # launches the next full batch while this one runs.
        self.overlaps = device.type == "cuda"

    # -- for the policy
    def volume(self, item: Mapping[str, np.ndarray]) -> int:
        if self._primary is None:
            return 1
        return math.prod(collate.variable_extents(item[self._primary.name], self._primary))

    def padded_elements(self, items: list[Mapping[str, np.ndarray]]) -> int:
        """Elements a padded batch of ``items`` would allocate, all features."""
        total = 0
        for spec in self._inputs:
            shape = [
                max(item[spec.name].shape[axis] for item in items) if dim == VARIABLE else dim
                for axis, dim in enumerate(spec.shape)
            ]
            total += len(items) * math.prod(shape)
        return total

    # -- model thread: forming the batch
    def prepare(self, items: list[Mapping[str, np.ndarray]]) -> collate.PaddedBatch:
        return collate.pad(
            items,
            self._inputs,
            pad_to_multiple_of=self._pad_multiple,
            pin_memory=self.device.type == "cuda",
        )

    def padding(self, prepared: collate.PaddedBatch) -> tuple[int, int]:
        return prepared.real_elements, prepared.padded_elements

    # -- model threads
    def start_instance(self, instance: int) -> None:
        self._contexts[instance].enter_thread()

    def launch(self, prepared: collate.PaddedBatch, instance: int) -> Launched:
        """Queue the batch on the device (on a CPU this runs it to the end)."""
        context = self._contexts[instance]
        with context.running():
            features = context.to_device(prepared.features)
            result = self.fn(**features)
            if isinstance(result, (list, tuple)):
                return Launched(prepared, None, None, list(result))
            outputs = self._named_outputs(result)
            host, done = context.to_host(
                {spec.name: outputs[spec.name].to(spec.dt.torch) for spec in self._outputs}
            )
        return Launched(prepared, host, done, None)

    def collect(self, launched: Launched) -> Executed:
        """Wait for the device (one synchronisation per batch); host arrays."""
        if launched.done is not None:
            launched.done.synchronize()
        outputs = None
        if launched.host is not None:
            outputs = {name: from_torch(t) for name, t in launched.host.items()}
        return Executed(launched.batch, outputs, launched.per_item)

    def _named_outputs(self, result: Any) -> Mapping[str, torch.Tensor]:
        if isinstance(result, torch.Tensor):
            if len(self._outputs) != 1:
                raise ModelFailure(
                    f"model returned one tensor but the config declares "
                    f"{len(self._outputs)} outputs; return a dict"
                )
            return {self._outputs[0].name: result}
        if isinstance(result, Mapping):
            missing = [s.name for s in self._outputs if s.name not in result]
            if missing:
                raise ModelFailure(f"model did not return output(s) {', '.join(missing)}")
            return result
        raise ModelFailure(
            f"model returned {type(result).__name__}; expected a tensor, a dict of tensors, "
            f"or a list with one result per item"
        )

    def item_result(self, entry: Any) -> Any:
        """One entry of a per-item result list, as host arrays (or the item's Exception)."""
        if isinstance(entry, BaseException):
            return entry  # fails this item alone
        named = self._named_outputs(entry)
        return {
            spec.name: from_torch(torch.as_tensor(named[spec.name]).detach().cpu().to(spec.dt.torch))
            for spec in self._outputs
        }

    def close(self) -> None:
        """Nothing to release: the model threads belong to the batcher."""

    # -- finisher thread
    def finish(self, executed: Executed, size: int) -> list[Any]:
        if executed.per_item is not None:  # the batcher checks its length
            return [self.item_result(entry) for entry in executed.per_item]
        assert executed.outputs is not None
        return collate.unpad(executed.outputs, executed.batch, self._outputs, self._sources)
