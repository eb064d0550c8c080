"""Runs padded batches of a torch callable on its device, in model threads.

``ThreadExecutor`` is the executor the batcher drives for a model that runs
in this process (``isolation = "thread"``), and the one a worker process
runs its batches with (``isolation = "process"``). It sees padded tensors
only; padding and un-padding are ``batching.collate``'s:

    launch   one non_blocking host->device copy per feature, forward under
             inference_mode, outputs cast to their declared dtype and copied
             back to pinned host memory once per batch (queued on CUDA)
    collect  one synchronisation per batch; host arrays

A batch function may return one tensor (single output), a dict of output
name -> tensor, or a list with one entry per item, where an entry may be an
Exception that fails that item alone.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorserve.errors import BatchOutOfMemory, ModelFailure
from tensorserve.repository.config import ModelConfig, OutputSpec
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
class Executed:
    """A batch's outputs on the host (``batching.executor.BatchOutputs``)."""

    batched: dict[str, np.ndarray] | None  # one array per output, batch first
    per_item: list[Any] | None  # or: each item's host arrays, or its Exception
    seconds: float | None = None  # the model's own time, when known better


@dataclass
class Launched:
    host: dict[str, torch.Tensor] | None  # batched outputs (pinned, still filling on CUDA)
    done: torch.cuda.Event | None  # recorded after the last device->host copy
    per_item: list[Any] | None


class ThreadExecutor:
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
        self.device = device
        self.instance_count = instance_count
        self.outputs = config.output
        self._contexts = [DeviceContext(device, intra_op_threads) for _ in range(instance_count)]
        # On CUDA, launch returns once the work is queued: the batcher pads and
        # launches the next full batch while this one runs.
        self.overlaps = device.type == "cuda"
        self.pin_memory = device.type == "cuda"

    def start_instance(self, instance: int) -> None:
        self._contexts[instance].enter_thread()

    def launch(self, features: dict[str, torch.Tensor], instance: int) -> Launched:
        """Queue the batch on the device (on a CPU this runs it to the end).
        Out of memory: the caches are freed, then ``BatchOutOfMemory`` (the
        batcher splits the batch and lowers its ceiling)."""
        try:
            return self._launch(features, instance)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            reason = f"{type(exc).__name__}: {exc}"
        # Outside the handler: the exception's frames (and the tensors they
        # hold) are gone before the caches are emptied.
        free_memory(self.device)
        raise BatchOutOfMemory(reason)

    def _launch(self, features: dict[str, torch.Tensor], instance: int) -> Launched:
        context = self._contexts[instance]
        with context.running():
            result = self.fn(**context.to_device(features))
            if isinstance(result, (list, tuple)):
                return Launched(None, None, list(result))
            named = named_outputs(result, self.outputs)
            host, done = context.to_host(
                {spec.name: named[spec.name].to(spec.dt.torch) for spec in self.outputs}
            )
        return Launched(host, done, None)

    def collect(self, launched: Launched) -> Executed:
        """Wait for the device (one synchronisation per batch); host arrays."""
        if launched.per_item is not None:
            return Executed(None, [self._item_result(entry) for entry in launched.per_item])
        if launched.done is not None:
            launched.done.synchronize()
        assert launched.host is not None
        return Executed({name: from_torch(t) for name, t in launched.host.items()}, None)

    def _item_result(self, entry: Any) -> Any:
        """One entry of a per-item result list, as host arrays (or the item's Exception)."""
        if isinstance(entry, BaseException):
            return entry  # fails this item alone
        named = named_outputs(entry, self.outputs)
        return {
            spec.name: from_torch(torch.as_tensor(named[spec.name]).detach().cpu().to(spec.dt.torch))
            for spec in self.outputs
        }

    def close(self) -> None:
        """Nothing to release: the model threads belong to the batcher."""


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA (and MPS) out-of-memory error, or the CPU allocator's."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def free_memory(device: torch.device) -> None:
    """Give back what a failed batch left: garbage, then the CUDA cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def named_outputs(result: Any, outputs: list[OutputSpec]) -> Mapping[str, torch.Tensor]:
    """The model's return value as output name -> tensor, or a sentence saying
    why it is not one."""
    if isinstance(result, torch.Tensor):
        if len(outputs) != 1:
            raise ModelFailure(
                f"model returned one tensor but the config declares "
                f"{len(outputs)} outputs; return a dict"
            )
        return {outputs[0].name: result}
    if isinstance(result, Mapping):
        missing = [s.name for s in outputs if s.name not in result]
        if missing:
            raise ModelFailure(f"model did not return output(s) {', '.join(missing)}")
        return result
    raise ModelFailure(
        f"model returned {type(result).__name__}; expected a tensor, a dict of tensors, "
        f"or a list with one result per item"
    )
