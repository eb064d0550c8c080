"""Models in worker processes of their own (``isolation = "process"``).

Why: in a thread of the server, the model's forward needs the GIL between
torch ops, and the event loop holds it while it parses, validates and
encodes requests; on a busy server the forward runs measurably slower
(docs/threading.md). A worker process has its own GIL and its own OpenMP
pool. The price is one copy of the padded inputs and of the outputs
through a socketpair per batch.

The batcher does not know the difference: ``ProcessRunner`` is a
``PaddedRunner`` whose ``launch`` sends the padded batch to the instance's
worker (``tensorserve/runtime/worker.py``) and whose ``collect`` waits for
the reply with the GIL released; like CUDA, it ``overlaps``, so a full next
batch can be sent while the worker runs this one. Padding and un-padding
stay in the server, so the worker only ever sees whole padded batches.

A worker that dies (a segfault in a native extension, the OOM killer, an
``os._exit`` in model code) fails the batch it was running with a message
saying how it died; the next batch starts a fresh worker.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from tensorserve.batching.collate import PaddedBatch
from tensorserve.errors import ConfigError, ModelFailure
from tensorserve.repository.config import ModelConfig
from tensorserve.repository.loader import ModelSource
from tensorserve.runtime import ipc
from tensorserve.runtime.runner import Executed, Launched, PaddedRunner
from tensorserve.tensors.dtypes import from_torch

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0  # import torch, load weights, maybe compile
STOP_TIMEOUT_S = 10.0
# Fewer, larger socket reads and writes for batches of a few MB.
SOCKET_BUFFER_BYTES = 4 << 20


def _died(returncode: int | None) -> str:
    if returncode is None:
        return "still running, but its connection broke"
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


class WorkerProcess:
    """One worker process and the server's end of its socket."""

    def __init__(self, hello: dict[str, Any], label: str) -> None:
        self.hello = hello
        self.label = label
        self.process: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.generation = 0  # counts starts: a batch sent to a dead worker is lost

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        """Spawn and wait until the model is loaded; ``ConfigError`` with the
        worker's own reason if it cannot load."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-m", "tensorserve.runtime.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
        self.process, self.sock = process, ours
        self.generation += 1
        try:
            ours.settimeout(LOAD_TIMEOUT_S)
            ipc.send(ours, self.hello)
            reply, _ = ipc.recv(ours)
            ours.settimeout(None)
        except (EOFError, OSError) as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else _died(process.poll())
            self.stop()
            raise ConfigError(f"{self.label}: the worker process did not start ({why})") from None
        if "error" in reply:
            self.stop()
            raise ConfigError(reply["error"])
        log.info("%s: worker process %d ready", self.label, process.pid)

    def submit(self, features: dict[str, np.ndarray]) -> int:
        """Send one padded batch (restarting a dead worker first); returns a
        ticket for ``receive``. Replies come back in the order of submits."""
        if self.process is None or self.process.poll() is not None:
            self._restart()
        assert self.sock is not None
        try:
            ipc.send(self.sock, {}, features)
        except OSError:
            self._lost("while receiving this batch")
        return self.generation

    def receive(self, ticket: int) -> ipc.Message:
        """The reply to a submitted batch."""
        if ticket != self.generation or self.sock is None:
            raise ModelFailure(f"{self.label}: the worker process died before running this batch")
        try:
            return ipc.recv(self.sock)
        except (EOFError, OSError):
            self._lost("while running this batch")

    @property
    def alive(self) -> bool:
        return self.sock is not None and self.process is not None and self.process.poll() is None

    def receive_soon(
        self,
        ticket: int,
        loop: asyncio.AbstractEventLoop,
        on_reply: Callable[[ipc.Message | None, BaseException | None], None],
    ) -> None:
        """``receive`` for an event loop that must not block: the loop reads
        the reply as it arrives and calls ``on_reply(message, None)`` on its
        own thread, or ``on_reply(None, ModelFailure)`` if the worker died."""
        sock = self.sock
        if ticket != self.generation or sock is None:
            on_reply(None, ModelFailure(f"{self.label}: the worker process died before running this batch"))
            return
        reader = ipc.MessageReader()

        def stop_reading() -> None:
            loop.remove_reader(sock)
            # uvloop (libuv) leaves the descriptor non-blocking, and the model
            # thread's next receive() expects a blocking socket.
            sock.setblocking(True)

        def readable() -> None:
            try:
                message = reader.feed(sock)
            except (EOFError, OSError):
                stop_reading()
                # Waiting for its exit status may take a moment: not on the loop.
                died = loop.run_in_executor(None, self._lost, "while running this batch")
                died.add_done_callback(lambda f: on_reply(None, f.exception()))
                return
            if message is not None:
                stop_reading()
                on_reply(message, None)

        loop.add_reader(sock, readable)

    def _lost(self, when: str) -> NoReturn:
        assert self.process is not None
        try:
            returncode: int | None = self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        self.stop()
        message = (
            f"{self.label}: the worker process died {when} ({_died(returncode)}); "
            f"a new one starts for the next batch"
        )
        log.error("%s", message)
        raise ModelFailure(message)

    def _restart(self) -> None:
        self.stop()
        log.warning("%s: starting a new worker process", self.label)
        try:
            self.start()
        except ConfigError as exc:
            raise ModelFailure(f"{self.label}: the worker process could not restart: {exc}") from None

    def stop(self) -> None:
        """Ask the worker to exit (closing the socket does), kill it if it won't."""
        sock, self.sock = self.sock, None
        process, self.process = self.process, None
        if sock is not None:
            try:
                ipc.send(sock, {"stop": True})
            except OSError:
                pass
            sock.close()
        if process is not None:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s: worker process %d did not stop; killing it", self.label, process.pid)
                process.kill()
                process.wait()


class ProcessRunner(PaddedRunner):
    """Pads and un-pads here; runs each instance's batches in its own worker."""

    def __init__(
        self,
        source: ModelSource,
        version: int,
        config: ModelConfig,
        *,
        intra_op_threads: int | None = None,
    ) -> None:
        # The server side only pads on the host: the worker owns the device,
        # so no pinned memory and no streams here.
        super().__init__(_runs_in_worker, config, torch.device("cpu"),
                         instance_count=config.instance_count)
        self.overlaps = True
        hello = {
            "name": source.name,
            "path": str(source.path),
            "version": version,
            "config": config.model_dump(mode="json"),
            "intra_op_threads": intra_op_threads,
            "log_level": logging.getLevelName(logging.getLogger("tensorserve").getEffectiveLevel()),
        }
        self.workers = [
            WorkerProcess(hello, f"model {source.name!r} instance {i}")
            for i in range(config.instance_count)
        ]

    def start(self) -> None:
        try:
            for worker in self.workers:
                worker.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()

    def start_instance(self, instance: int) -> None:
        """Thread set-up happens in the worker."""

    def launch(self, prepared: PaddedBatch, instance: int) -> Launched:
        """Send the batch to the instance's worker; ``collect`` waits for it.
        Meanwhile the batcher may pad and send the next full batch, so the
        worker never waits for the server between two batches."""
        features = {name: from_torch(t) for name, t in prepared.features.items()}
        ticket = self.workers[instance].submit(features)
        return Launched(prepared, None, None, None, worker=(instance, ticket))

    def collect(self, launched: Launched) -> Executed:
        assert launched.worker is not None
        instance, ticket = launched.worker
        return self._executed(launched, self.workers[instance].receive(ticket))

    # -- the event loop's direct path (see Batcher._run_direct)
    direct = True

    def can_run_direct(self, instance: int) -> bool:
        """An idle instance whose worker is up: a dead one restarts on a model
        thread, never on the event loop."""
        return self.workers[instance].alive

    def collect_soon(
        self,
        launched: Launched,
        loop: asyncio.AbstractEventLoop,
        done: Callable[[Executed | None, BaseException | None], None],
    ) -> None:
        """``collect`` without blocking ``loop``: ``done(executed, error)`` runs
        on the loop's thread once the worker has answered."""
        assert launched.worker is not None
        instance, ticket = launched.worker

        def on_reply(message: ipc.Message | None, error: BaseException | None) -> None:
            if message is None:
                done(None, error)
                return
            try:
                executed = self._executed(launched, message)
            except BaseException as exc:
                done(None, exc)
            else:
                done(executed, None)

        self.workers[instance].receive_soon(ticket, loop, on_reply)

    def _executed(self, launched: Launched, message: ipc.Message) -> Executed:
        header, tensors = message
        if "error" in header:
            raise ModelFailure(header["error"])
        if "items" not in header:
            return Executed(launched.batch, tensors, None, header["seconds"])
        failed = dict(header["failed"])
        per_item: list[Any] = [
            ModelFailure(failed[i]) if i in failed
            else {spec.name: tensors[f"{i}/{spec.name}"] for spec in self._outputs}
            for i in range(header["items"])
        ]
        return Executed(launched.batch, None, per_item, header["seconds"])

    def finish(self, executed: Executed, size: int) -> list[Any]:
        if executed.per_item is not None:
            return executed.per_item  # already host arrays (or the item's error)
        return super().finish(executed, size)


def _runs_in_worker(**features: torch.Tensor) -> Any:  # pragma: no cover - never called
    raise AssertionError("a ProcessRunner runs its model in the worker process")
