"""What the batcher needs from whatever runs its batches: the runtime's
contract, declared here so that batching never imports the runtime.

An executor only *runs* padded batches. Everything about shapes (how big a
batch would be, padding, un-padding) belongs to ``batching.collate``; the
executor sees one dict of padded tensors per batch and hands back host
outputs. ``tensorserve.runtime`` has two: forwards on a thread of this
process (``ThreadedExecutor``) and worker processes of their own
(``LoopExecutor``). Either way the scheduler (``batching/scheduler.py``)
owns every batch: an executor runs what it is handed and reports back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tensorserve.tensors.dtypes import Feature


class BatchOutputs(Protocol):
    """A batch's outputs, on the host."""

    @property
    def batched(self) -> Mapping[str, np.ndarray | Sequence[np.ndarray]] | None:
        """One array per output with the batch first (a ragged output: one
        array per row): un-padded by collate."""

    @property
    def per_item(self) -> Sequence[Any] | None:
        """Or, when the model returned one result per item: each item's host
        arrays, or the Exception that fails that item alone."""

    @property
    def parameters(self) -> Mapping[str, Sequence[Any]] | None:
        """The model's per-row output parameters (name -> one JSON scalar per
        row; ``tensorserve.WithParameters``), or None."""

    @property
    def seconds(self) -> float | None:
        """The model's own time for the batch, when the executor knows it
        better than the batcher's launch-to-collect clock (a worker with a
        batch queued behind another); None otherwise."""

    @property
    def captured(self) -> bool:
        """True when the batch's time is mostly a CUDA graph's capture (its
        bucket's first batch): no batch's cost, nor the slowest batch's."""


class Executor(Protocol):
    instance_count: int
    """Model instances: the scheduler keeps up to two batches on each where
    the executor ``overlaps``, one otherwise."""

    overlaps: bool
    """True when ``launch`` returns before the batch has run (CUDA, a worker
    process): a second batch is then handed to an instance while one runs, so
    the device never waits for the scheduler to pad the next."""

    pin_memory: bool
    """True when padded host buffers should be page-locked (CUDA)."""

    restarts: int
    """Instances restored after a failure so far (worker processes replaced;
    0 for executors in this process): ``tensorserve_worker_restarts_total``."""

    restart_seconds: float | None
    """What restoring an instance after its worker died has cost lately, in
    seconds (a moving average), or None (none yet, or nothing to restore):
    recovery weighs it against forwards (batching.culprit)."""

    def abort(self, launched: Any, because: str) -> bool:
        """The watchdog's: stop a batch past its limit. True if it will end as
        a failure (its worker killed); False if it cannot be stopped (a
        forward in a thread of this process: its instance is then stuck)."""

    def repair(self, instance: int) -> None:
        """After a batch failed on the instance: restore it now (a dead
        worker replaced), not at its next batch. Never raises."""

    def health(self) -> str | None:
        """Why no batch can run now (every worker down), None if one can."""

    def free_memory_bytes(self) -> int | None:
        """Device memory a batch could still use, in bytes: free on the device
        plus what torch's caching allocator holds unused (None: not known here,
        a CPU or a worker process). The memory ceiling grows only into it."""

    def close(self) -> None:
        """Release what the executor holds (workers, device state)."""


class ThreadedExecutor(Executor, Protocol):
    """An executor that runs a batch on the calling thread: one per instance
    (``batching/instances.py``)."""

    def start_instance(self, instance: int) -> None:
        """Called once on each instance's thread before its first batch."""

    def launch(
        self,
        features: dict[str, Feature],
        instance: int,
        parameters: Mapping[str, list[Any]] | None = None,
    ) -> Any:
        """Start a padded batch on the instance (on a CPU: run it).
        ``parameters``: the model's declared request parameters, one value
        per row (empty or None: the model declares none, and its forward
        gets exactly the features)."""

    def collect(self, launched: Any) -> BatchOutputs:
        """Wait for a launched batch and return its outputs."""


Done = Callable[[BatchOutputs | None, BaseException | None], None]
"""A batch's completion: its outputs, or the error that failed it (any thread)."""


@runtime_checkable
class LoopExecutor(Executor, Protocol):
    """An executor that runs its batches elsewhere (worker processes), driven
    from the scheduler's event loop without a thread of its own: ``dispatch``
    only hands the batch over, never blocking, and the reply is read as it
    arrives."""

    def attach(self, loop: asyncio.AbstractEventLoop, lost: Callable[[int], None]) -> None:
        """The scheduler's loop: ``dispatch`` is called, and ``done`` runs, on
        it. ``lost(instance)``, on the loop too, as soon as an instance's
        worker is seen dead, running a batch or idle: the scheduler has it
        ``repair``ed at once, not when its next batch would find it dead."""

    def dispatch(
        self,
        features: dict[str, Feature],
        instance: int,
        parameters: Mapping[str, list[Any]] | None,
        done: Done,
    ) -> Any:
        """Hand the padded batch to the instance without blocking, whatever
        the host's socket buffers; ``done(outputs, error)`` is called once,
        on the loop, when it is over. Returns what ``abort`` takes."""

    def detach(self) -> None:
        """On the loop, before ``close``: stop watching the instances."""
