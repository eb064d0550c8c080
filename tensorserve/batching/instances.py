"""One thread per instance for an executor that runs batches in this process.

The scheduler (``scheduler.py``) owns every batch; for a ``ThreadedExecutor``
(a forward on this process's CPU or GPU) it hands each padded batch to the
instance's thread here, which launches it, collects it and reports the outcome
through the batch's ``done``. Nothing here decides anything about a batch.

Where the executor ``overlaps`` (CUDA: ``launch`` only queues the work), an
instance has two threads: one launches each batch the moment it is handed
over, the other waits for the device and collects, so a second batch is
queued on the device while the first runs and no launch waits on a collect.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorserve.batching.executor import Done, ThreadedExecutor
from tensorserve.host import name_native_thread
from tensorserve.tensors.dtypes import Feature


@dataclass(eq=False)
class Job:
    """One batch handed to an instance's thread."""

    features: dict[str, Feature]
    parameters: Mapping[str, list[Any]] | None
    done: Done
    launched: Any = None  # what the executor's launch returned (abort takes it)
    error: BaseException | None = None


class InstanceThreads:
    """The ``LoopExecutor`` face of a ``ThreadedExecutor``: ``dispatch``
    never blocks the scheduler's loop; each instance runs its batches in the
    order they were handed over, on a daemon thread started on first use."""

    def __init__(self, executor: ThreadedExecutor, name: str) -> None:
        self.executor = executor
        self.name = name
        self._jobs: list[queue.SimpleQueue[Job | None]] = [
            queue.SimpleQueue() for _ in range(executor.instance_count)
        ]
        self._threads: list[threading.Thread | None] = [None] * executor.instance_count

    def attach(self, loop: asyncio.AbstractEventLoop, lost: Callable[[int], None]) -> None:
        """Nothing to watch on the loop: each thread reports through ``done``
        (a thread is never lost on its own: ``lost`` is not called)."""

    def dispatch(
        self,
        features: dict[str, Feature],
        instance: int,
        parameters: Mapping[str, list[Any]] | None,
        done: Done,
    ) -> Job:
        job = Job(features, parameters, done)
        if self._threads[instance] is None:
            self._threads[instance] = self._start(instance)
        self._jobs[instance].put(job)
        return job

    def _start(self, instance: int) -> threading.Thread:
        collector: queue.SimpleQueue[Job | None] | None = None
        if self.executor.overlaps:
            collector = queue.SimpleQueue()
            self._daemon(f"{instance}-collect", self._collect_each, collector)
        return self._daemon(str(instance), self._launch_each, instance, collector)

    def _daemon(self, suffix: str, target: Callable[..., None], *args: Any) -> threading.Thread:
        thread = threading.Thread(
            target=_named, args=(target, *args), name=f"{self.name}-instance-{suffix}", daemon=True
        )
        thread.start()
        return thread

    def abort(self, job: Job, because: str) -> bool:
        return self.executor.abort(job.launched, because)

    def detach(self) -> None:
        """Each thread stops once the batches handed to it are over."""
        for jobs, thread in zip(self._jobs, self._threads):
            if thread is not None:
                jobs.put(None)

    def _launch_each(self, instance: int, collector: queue.SimpleQueue[Job | None] | None) -> None:
        """Launch each batch handed over, in order (and collect it, without a collector)."""
        executor, jobs = self.executor, self._jobs[instance]
        try:
            executor.start_instance(instance)
            broken: BaseException | None = None
        except BaseException as exc:  # noqa: BLE001 - every batch then fails with it, none hangs
            broken = exc
        while (job := jobs.get()) is not None:
            self._launch(job, instance, broken)
            if collector is not None:
                collector.put(job)
            else:
                self._collect(job)
            del job
        if collector is not None:
            collector.put(None)  # after the last batch: what is launched still ends

    def _collect_each(self, collected: queue.SimpleQueue[Job | None]) -> None:
        while (job := collected.get()) is not None:
            self._collect(job)
            del job

    def _launch(self, job: Job, instance: int, broken: BaseException | None) -> None:
        try:
            if broken is not None:
                raise broken
            job.launched = self.executor.launch(job.features, instance, job.parameters)
        except BaseException as exc:  # noqa: BLE001 - the model's failure: this batch only
            job.error = exc
        job.features = {}  # the device (or the forward) has them now

    def _collect(self, job: Job) -> None:
        outputs = None
        if job.error is None:
            try:
                outputs = self.executor.collect(job.launched)
            except BaseException as exc:  # noqa: BLE001 - the batch's callers get it
                job.error = exc
        error, job.launched = job.error, None
        job.done(outputs, error)


def _named(target: Callable[..., None], *args: Any) -> None:
    """Run ``target`` on a thread that the OS knows by its Python name."""
    name_native_thread()
    target(*args)
