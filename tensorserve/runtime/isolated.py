"""Models in worker processes of their own (``isolation = "process"``).

Why: in a thread of the server, the model's forward needs the GIL between
torch ops, and the event loop holds it while it parses, validates and
encodes requests; on a busy server the forward runs measurably slower
(docs/threading.md). A worker process has its own GIL and its own OpenMP
pool. The price is one copy of the padded inputs and of the outputs
through a socketpair per batch.

The batcher does not know the difference: ``ProcessExecutor`` is an
executor whose ``launch`` sends the padded batch to the instance's worker
(``tensorserve/runtime/worker.py``) and whose ``collect`` waits for the reply
with the GIL released; like CUDA, it ``overlaps``, so a full next batch can
be sent while the worker runs this one. Padding and un-padding stay in the
server, so the worker only ever sees whole padded batches. It is also a
``DirectExecutor``: an event loop may send a batch to an idle worker and
read the reply itself, without ever blocking on the worker.

A worker that dies (a segfault in a native extension, the OOM killer, an
``os._exit`` in model code) fails the batch it was running with a message
saying how it died; the next batch starts a fresh worker.
"""

from __future__ import annotations

import asyncio
import logging
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch

from tensorserve.errors import ConfigError, ModelFailure
from tensorserve.repository.config import ModelConfig
from tensorserve.repository.loader import ModelSource
from tensorserve.runtime import ipc
from tensorserve.runtime.executor import Executed
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
        # A send failed on the event loop, which never waits for or restarts a
        # worker: the next batch on a model thread replaces it.
        self.broken = False

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
        self.broken = False
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
        if not self.alive:
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
        return (
            not self.broken
            and self.sock is not None
            and self.process is not None
            and self.process.poll() is None
        )

    def try_submit(self, features: dict[str, np.ndarray]) -> int | None:
        """``submit`` for an event loop: never restarts a worker or waits for
        one. None if the worker is not up or the send fails (then it is
        marked broken, and the next ``submit`` replaces it)."""
        if not self.alive:
            return None
        assert self.sock is not None
        try:
            ipc.send(self.sock, {}, features)
        except OSError:
            self.broken = True
            return None
        return self.generation

    def receive_soon(
        self,
        ticket: int,
        loop: asyncio.AbstractEventLoop,
        on_reply: Callable[[ipc.Message | None, BaseException | None], None],
    ) -> Callable[[], None]:
        """``receive`` for an event loop that must not block: the loop reads
        the reply as it arrives and calls ``on_reply(message, None)`` on its
        own thread, or ``on_reply(None, ModelFailure)`` if the worker died
        (its exit status is awaited in a thread, never on the loop).

        Returns ``finish_now``: on the loop's thread, stop watching and wait
        for the reply right there (for a close() on that thread)."""
        sock = self.sock
        if ticket != self.generation or sock is None:
            on_reply(None, ModelFailure(f"{self.label}: the worker process died before running this batch"))
            return lambda: None
        reader = ipc.MessageReader()
        watching = True

        def stop_watching() -> None:
            nonlocal watching
            if watching:
                loop.remove_reader(sock)
                # uvloop (libuv) leaves the descriptor non-blocking, and the
                # model thread's next receive() expects a blocking socket.
                sock.setblocking(True)
                watching = False

        def readable() -> None:
            try:
                message = reader.feed(sock)
            except (EOFError, OSError):
                stop_watching()
                died = loop.run_in_executor(None, self._lost, "while running this batch")
                died.add_done_callback(lambda f: on_reply(None, f.exception()))
                return
            if message is not None:
                stop_watching()
                on_reply(message, None)

        def finish_now() -> None:
            if not watching:
                return  # the reply is already in
            stop_watching()
            while True:
                try:
                    select.select([sock], [], [])
                    message = reader.feed(sock)
                except (EOFError, OSError):
                    try:
                        self._lost("while running this batch")
                    except ModelFailure as exc:
                        on_reply(None, exc)
                    return
                if message is not None:
                    on_reply(message, None)
                    return

        loop.add_reader(sock, readable)
        return finish_now

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


@dataclass(frozen=True)
class Sent:
    """A batch handed to an instance's worker: ``ticket`` is the worker's
    generation, so a reply is never awaited from a worker that was replaced."""

    instance: int
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
    ) -> None:
        self.instance_count = config.instance_count
        self.outputs = config.output
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

    def launch(self, features: dict[str, torch.Tensor], instance: int) -> Sent:
        """Send the batch to the instance's worker (a dead one is replaced
        first); ``collect`` waits for it. Meanwhile the batcher may pad and
        send the next full batch, so the worker never waits for the server."""
        return Sent(instance, self.workers[instance].submit(_host(features)))

    def collect(self, sent: Sent) -> Executed:
        return self._executed(self.workers[sent.instance].receive(sent.ticket))

    # -- the event loop's direct path (batching.executor.DirectExecutor)
    def can_run_direct(self, instance: int) -> bool:
        """Only a worker that is up: a dead one restarts on a model thread."""
        return self.workers[instance].alive

    def try_launch_direct(self, features: dict[str, torch.Tensor], instance: int) -> Sent | None:
        ticket = self.workers[instance].try_submit(_host(features))
        return None if ticket is None else Sent(instance, ticket)

    def collect_soon(
        self,
        sent: Sent,
        loop: asyncio.AbstractEventLoop,
        done: Callable[[Executed | None, BaseException | None], None],
    ) -> Callable[[], None]:
        """``collect`` without blocking ``loop``: ``done(outputs, error)`` runs
        on the loop's thread once the worker has answered."""

        def on_reply(message: ipc.Message | None, error: BaseException | None) -> None:
            if message is None:
                done(None, error)
                return
            try:
                executed = self._executed(message)
            except BaseException as exc:
                done(None, exc)
            else:
                done(executed, None)

        return self.workers[sent.instance].receive_soon(sent.ticket, loop, on_reply)

    def _executed(self, message: ipc.Message) -> Executed:
        header, tensors = message
        if "error" in header:
            raise ModelFailure(header["error"])
        if "items" not in header:
            return Executed(tensors, None, header["seconds"])
        failed = dict(header["failed"])
        per_item: list[Any] = [
            ModelFailure(failed[i]) if i in failed
            else {spec.name: tensors[f"{i}/{spec.name}"] for spec in self.outputs}
            for i in range(header["items"])
        ]
        return Executed(None, per_item, header["seconds"])


def _host(features: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: from_torch(t) for name, t in features.items()}
