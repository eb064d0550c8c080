"""Models in worker processes of their own (``isolation = "process"``).

Why: in a thread of the server, the model's forward needs the GIL between
torch ops, and the event loop holds it while it parses, validates and
encodes requests; on a busy server the forward runs measurably slower
(docs/threading.md). A worker process has its own GIL and its own OpenMP
pool. The price is one copy of the padded inputs and of the outputs
through a socketpair per batch.

``ProcessExecutor`` is a ``LoopExecutor``: the scheduler's loop sends each
padded batch to the instance's worker (``worker_main.py``, which sees only
whole padded batches) and reads the reply as it arrives, never blocking
(``worker_channel.py``); like CUDA, it ``overlaps``.

A worker that dies (a segfault in a native extension, the OOM killer, an
``os._exit`` in model code, the watchdog) fails the batch it was running
with ``WorkerCrashed`` saying how it died (on CUDA, where a worker launches
the next batch before collecting one, the batch after it too), and a batch
queued behind them with ``WorkerCrashed(ran=False)``; the scheduler retries them (batching.recovery)
and has the instance ``repair``ed at once: the standby, a spare worker kept
ready (``[faults] standby_worker``), takes over in milliseconds; without
one, a new worker is forked from the template, or loads.

Over several devices (``[[instance_group]]``, or ``device = "auto"`` on
several GPUs) each worker runs on its own instance's device: one hello per
device, which a replacement (a restart, or that device's standby) keeps.

Every process-isolated model of the process forks its workers from one
worker template and shares one spare with the others
(``shared_workers.py``): the bundled repository's five such models run in
eight processes, not sixteen (docs/threading.md, "One template, one spare").
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensorserve.errors import BatchOutOfMemory, ConfigError, ModelFailure, RowErrors
from tensorserve.ipc import messages as ipc
from tensorserve.repository.config import ModelConfig
from tensorserve.repository.loader import ModelSource
from tensorserve.repository.platforms import PLATFORMS
from tensorserve.runtime import shared_workers
from tensorserve.runtime.device import resolve_device
from tensorserve.runtime.executor import Executed
from tensorserve.runtime.placement import Placement
from tensorserve.runtime.ragged import join_rows
from tensorserve.runtime.standby import SharedStandby, Standby
from tensorserve.runtime.template import Template
from tensorserve.runtime.worker_pipeline import CUDA_BATCHES_IN_FLIGHT
from tensorserve.runtime.worker_process import WorkerProcess
from tensorserve.tensors.dtypes import Feature, host_array

log = logging.getLogger(__name__)

RESTART_ALPHA = 0.3  # the weight of the newest restart in ``restart_seconds``
_KEYS = itertools.count(1)  # one key per executor: its model in the shared template


def instance_devices(config: ModelConfig, placements: Sequence[Placement] | None) -> list[str]:
    """Each instance's device, instance ``i`` being the ``i``-th of the
    placements' instances in order (as ``PlacedExecutor`` counts them); no
    placements: ``instance_count`` on the config's own device."""
    if not placements:
        return [config.device] * config.instance_count
    return [placement.device for placement in placements for _ in range(placement.count)]


def worker_config(config: ModelConfig, device: str, count: int) -> ModelConfig:
    """The config a worker on ``device`` loads: its one device, no groups
    (the worker runs one instance; ``count`` is how many share the device)."""
    if device == config.device and not config.instance_group:
        return config  # one device: the model's own config, as before
    return config.model_copy(
        update={"device": device, "instance_count": count, "instance_group": []}
    )


@dataclass(frozen=True)
class Sent:
    """A batch handed to one worker: ``ticket`` is its generation, so a reply
    is never awaited from a worker that was replaced or restarted."""

    worker: WorkerProcess
    ticket: int


class ProcessExecutor:
    """Runs each instance's batches in its own worker process."""

    # The worker owns the device: the server side pads into plain host
    # memory (no pinned buffers, no streams here).
    overlaps = True
    pin_memory = False

    def __init__(
        self,
        source: ModelSource,
        version: int,
        config: ModelConfig,
        *,
        intra_op_threads: int | None = None,
        placements: Sequence[Placement] | None = None,
    ) -> None:
        self.device_of = instance_devices(config, placements)  # instance -> its device
        self.instance_count = len(self.device_of)
        self.outputs = config.output
        self.label = f"model {source.name!r}"
        several = len(set(self.device_of)) > 1
        on_cpu = all(resolve_device(device).type == "cpu" for device in set(self.device_of))
        # The template loads the weights only on the CPU, of a model that
        # starts no threads as it loads: it never touches CUDA (template.py).
        self.log_level = logging.getLevelName(logging.getLogger("tensorserve").getEffectiveLevel())
        template_loads = on_cpu and PLATFORMS[config.platform].loads_before_fork
        self.key = f"{source.name}/{version}/{next(_KEYS)}"  # its model in the template
        # One hello per device, in the devices' order; ``hello``: the first.
        self.hellos: dict[str, dict[str, Any]] = {
            device: {
                "name": source.name,
                "path": str(source.path),
                "version": version,
                "key": self.key,
                "config": worker_config(config, device, self.device_of.count(device)).model_dump(
                    mode="json"
                ),
                "intra_op_threads": intra_op_threads,
                "template_loads": template_loads,
                "log_level": self.log_level,
                # On CUDA the worker launches a batch before collecting the one
                # ahead (worker_pipeline.py); if it dies, both may have run.
                "batches_in_flight": 1
                if resolve_device(device).type == "cpu"
                else CUDA_BATCHES_IN_FLIGHT,
            }
            for device in dict.fromkeys(self.device_of)
        }
        self.hello = self.hellos[self.device_of[0]]
        faults = config.faults
        self.uses_template = faults.worker_template
        self.template: Template | None = None  # the shared one, from ``start`` on
        self.shared: shared_workers.SharedWorkers | None = None
        self.workers = [
            WorkerProcess(
                self.hellos[device],
                f"{self.label} instance {i}" + (f" on {device}" if several else ""),
            )
            for i, device in enumerate(self.device_of)
        ]
        # A spare on a GPU would hold a CUDA context and a copy of the weights
        # there for a crash that may never come: by default, only on the CPU.
        # A model the template holds loaded shares its spare; one it does not
        # (on a GPU, ONNX Runtime) needs a spare of its own, loaded: one per
        # device, since a replacement keeps the dead worker's device.
        standby = on_cpu if faults.standby_worker == "auto" else faults.standby_worker
        self.standbys: dict[str, Standby | SharedStandby] = {}
        for device, hello in self.hellos.items():
            label = self.label + (f" on {device}" if several else "")
            if standby and template_loads and self.uses_template:
                self.standbys[device] = SharedStandby(hello, label)
            elif standby:
                self.standbys[device] = Standby(hello, label)
        self.loop: asyncio.AbstractEventLoop | None = None  # the scheduler's (attach)
        self.restarts = 0  # dead workers replaced (tensorserve_worker_restarts_total)
        # A moving average of what replacing one cost: a swap when the standby
        # was loaded, a wait for it or a model load when crashes came faster.
        self.restart_seconds: float | None = None

    @property
    def standby(self) -> Standby | SharedStandby | None:
        """The first device's standby (on one device, the model's)."""
        return self.standbys.get(self.device_of[0])

    def start(self) -> None:
        try:
            if self.uses_template:
                self.shared = shared_workers.acquire(self.log_level)
                self.template = self.shared.template
                self.template.add(self.key, self.hello)
                for worker in self.workers:
                    worker.template = self.template
                for standby in self.standbys.values():
                    if isinstance(standby, SharedStandby):
                        standby.spare = self.shared.spare
                    else:
                        standby.template = self.template
            for worker in self.workers:
                worker.start()
        except BaseException:
            self.close()
            raise
        for standby in self.standbys.values():
            standby.refill()  # in the background: ready does not wait for it

    def close(self) -> None:
        for standby in self.standbys.values():
            standby.close()
        for worker in self.workers:
            worker.stop()
        shared, self.shared = self.shared, None
        if shared is not None:
            shared.template.drop(self.key)
            shared_workers.release(shared)

    def free_memory_bytes(self) -> int | None:
        return None  # the device is the workers'

    def health(self) -> str | None:
        alive = any(worker.alive for worker in self.workers)
        return None if alive else "its worker process is being replaced"

    def attach(self, loop: asyncio.AbstractEventLoop, lost: Callable[[int], None]) -> None:
        self.loop = loop
        for instance, worker in enumerate(self.workers):
            worker.on_lost = functools.partial(lost, instance)

    def dispatch(
        self,
        features: dict[str, Feature],
        instance: int,
        parameters: Mapping[str, list[Any]] | None,
        done: Callable[[Executed | None, BaseException | None], None],
    ) -> Sent:
        """On the scheduler's loop (``LoopExecutor.dispatch``); a dead worker
        fails the batch unrun, to run again once ``repair`` replaced it."""
        worker = self.workers[instance]

        def on_reply(message: ipc.Message | None, error: BaseException | None) -> None:
            executed = None
            if message is not None:
                try:
                    executed = self._executed(message)
                except BaseException as exc:  # noqa: BLE001 - the batch's callers get it
                    error = exc
            done(executed, error)

        host = {name: host_array(t) for name, t in features.items()}
        return Sent(worker, worker.dispatch(host, parameters, on_reply, self.loop))

    def detach(self) -> None:
        for worker in self.workers:
            worker.detach()

    def abort(self, sent: Sent, because: str) -> bool:
        """The watchdog: kill the worker running this batch, so it fails as a
        crash (a worker already replaced, or being replaced, is left alone)."""
        sent.worker.kill(because, ticket=sent.ticket)
        return True

    def repair(self, instance: int) -> None:
        """After a worker died: replace it at once, so the model is ready again
        without waiting for traffic (on a thread of the scheduler's, which
        sends the instance nothing meanwhile); what it cost: ``restart_seconds``."""
        old = self.workers[instance]
        if old.alive:
            return  # replaced already (a batch behind the dead one)
        started = time.perf_counter()
        old.stop()
        standby = self.standbys.get(self.device_of[instance])  # a spare on its device
        spare = standby.take() if standby is not None else None
        if spare is not None:
            spare.label, spare.on_lost = old.label, old.on_lost
            self.workers[instance] = spare
            took = 1000 * (time.perf_counter() - started)
            log.warning(
                "%s: the standby worker %d took over in %.1f ms", old.label, spare.pid, took
            )
        else:
            log.warning("%s: starting a new worker process", old.label)
            try:
                old.start()
            except ConfigError as exc:  # the next batch tries again, and says why
                log.error("%s: the worker process could not restart: %s", old.label, exc)
                return
        self.restarts += 1
        seconds, last = time.perf_counter() - started, self.restart_seconds
        self.restart_seconds = seconds if last is None else last + RESTART_ALPHA * (seconds - last)

    def _executed(self, message: ipc.Message) -> Executed:
        header, tensors = message
        if "error" in header:
            kind = header.get("kind")
            if kind == "oom":
                raise BatchOutOfMemory(header["error"])
            if kind == "rows":
                raise RowErrors(dict(header["rows"]))
            raise ModelFailure(header["error"])
        parameters = header.get("parameters")  # per-row output parameters, if any
        captured = bool(header.get("captured", False))  # a CUDA graph's capture, no batch's cost
        if "items" not in header:
            ragged = [spec.name for spec in self.outputs if spec.ragged]
            batched = join_rows(tensors, ragged)
            return Executed(batched, None, header["seconds"], parameters, captured)
        failed = dict(header["failed"])
        per_item: list[Any] = [
            ModelFailure(failed[i])
            if i in failed
            else {spec.name: tensors[f"{i}/{spec.name}"] for spec in self.outputs}
            for i in range(header["items"])
        ]
        return Executed(None, per_item, header["seconds"], parameters, captured)
