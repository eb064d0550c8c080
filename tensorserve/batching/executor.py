"""What the batcher needs from whatever runs its batches: the runtime's
contract, declared here so that batching never imports the runtime.

An executor only *runs* padded batches. Everything about shapes (how big a
batch would be, padding, un-padding) belongs to ``batching.collate``; the
executor sees one dict of padded tensors per batch and hands back host
outputs. ``tensorserve.runtime`` has two: model threads in this process,
and worker processes of their own.
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
        ...

    @property
    def per_item(self) -> Sequence[Any] | None:
        """Or, when the model returned one result per item: each item's host
        arrays, or the Exception that fails that item alone."""
        ...

    @property
    def parameters(self) -> Mapping[str, Sequence[Any]] | None:
        """The model's per-row output parameters (name -> one JSON scalar per
        row; ``tensorserve.WithParameters``), or None."""
        ...

    @property
    def seconds(self) -> float | None:
        """The model's own time for the batch, when the executor knows it
        better than the batcher's launch-to-collect clock (a worker with a
        batch queued behind another); None otherwise."""
        ...


class Executor(Protocol):
    instance_count: int
    """Model instances: the batcher runs one model thread per instance."""

    overlaps: bool
    """True when ``launch`` returns before the batch has run (CUDA, a worker
    process): the batcher may then launch the next full batch meanwhile."""

    pin_memory: bool
    """True when padded host buffers should be page-locked (CUDA)."""

    def start_instance(self, instance: int) -> None:
        """Called once on each model thread before its first batch."""
        ...

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
        ...

    def collect(self, launched: Any) -> BatchOutputs:
        """Wait for a launched batch and return its outputs."""
        ...

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
        ...

    def repair(self, instance: int) -> None:
        """After a batch failed on the instance: restore it now (a dead
        worker replaced), not at its next batch. Never raises."""
        ...

    def health(self) -> str | None:
        """Why no batch can run now (every worker down), None if one can."""
        ...

    def free_memory_bytes(self) -> int | None:
        """Device memory a batch could still use, in bytes: free on the device
        plus what torch's caching allocator holds unused (None: not known here,
        a CPU or a worker process). The memory ceiling grows only into it."""
        ...

    def close(self) -> None:
        """Release what the executor holds (workers, forward threads)."""
        ...


@runtime_checkable
class DirectExecutor(Executor, Protocol):
    """An executor whose batches an event loop can drive itself, without
    blocking: launching only hands the batch to another process, and the
    reply is read as it arrives. The batcher's direct path (see batcher.py)."""

    def can_run_direct(self, instance: int) -> bool:
        """The instance is up and idle enough for the loop to use it."""
        ...

    def try_launch_direct(
        self,
        features: dict[str, Feature],
        instance: int,
        parameters: Mapping[str, list[Any]] | None = None,
    ) -> Any | None:
        """Send the batch without blocking and without ever waiting for or
        restarting a worker; None if it could not be sent (the batcher then
        gives the batch to the model threads)."""
        ...

    def collect_soon(
        self,
        launched: Any,
        loop: asyncio.AbstractEventLoop,
        done: Callable[[BatchOutputs | None, BaseException | None], None],
    ) -> Callable[[], None]:
        """Watch for the reply on ``loop``; ``done(outputs, error)`` runs on
        the loop's thread once it is in. Returns ``finish_now``: called on the
        loop's thread, it stops watching and waits for the reply right there
        (``done`` has run when it returns) — for ``close()`` on that thread."""
        ...
