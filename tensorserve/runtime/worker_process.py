"""One model instance's worker process, seen from the server: start it, send
it a padded batch, read the reply (blocking on a model thread, or as it
arrives on an event loop), notice its death, kill it for the watchdog.
``isolated.ProcessExecutor`` drives one per instance; ``standby.py`` keeps a
spare loaded; ``worker_main.py`` is the other end of the socket.

Who may touch what (docs/architecture.md, "Who owns what"):

- The socket, the process, ``generation`` and the batches in flight belong
  to the thread that holds ``owner``: the instance's model thread, or the
  event loop while it drives a batch. The batcher hands the instance from
  one to the other under its lock; ``owner`` checks that hand-over at every
  use (``ownership.Owner``): ``submit``/``try_submit`` take it, the reply
  (``receive``, or ``receive_soon``'s callback) gives it back.
- Any other thread may only ``kill`` it (the watchdog), ask whether it is
  ``alive`` and its ``pid`` (readiness), or ``close`` it. They take
  ``_guard``, which the owner takes too whenever it swaps the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from tensorserve.errors import ConfigError, WorkerCrashed
from tensorserve.runtime import ipc
from tensorserve.runtime.ownership import NotOwner, Owner
from tensorserve.runtime.template import ForkedProcess, Template

log = logging.getLogger("tensorserve.runtime.isolated")

LOAD_TIMEOUT_S = 600.0  # import torch, load weights, maybe compile
STOP_TIMEOUT_S = 10.0
# Fewer, larger socket reads and writes for batches of a few MB.
SOCKET_BUFFER_BYTES = 4 << 20

Process = subprocess.Popen[bytes] | ForkedProcess
OnReply = Callable[[ipc.Message | None, BaseException | None], None]


def _batch_header(parameters: Mapping[str, list[Any]] | None) -> dict[str, Any]:
    """A batch message's header: empty, or the request parameters' columns."""
    return {"parameters": dict(parameters)} if parameters else {}


def _died(returncode: int | None) -> str:
    if returncode is None:
        return "still running, but its connection broke"
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    if returncode == ipc.EXIT_DEVICE_LOST:
        return f"exit code {returncode}: a sticky CUDA error lost its CUDA context"
    return f"exit code {returncode}"


class WorkerProcess:
    """One worker process and the server's end of its socket (see the module
    docstring for which thread may call what)."""

    def __init__(self, hello: dict[str, Any], label: str, template: Template | None = None) -> None:
        self.hello = hello
        self.label = label
        self.template = template  # fork from it (milliseconds) instead of spawning
        self.owner = Owner(f"{label}'s worker process")
        self._guard = threading.Lock()  # the owner's swaps vs. kill / alive / close
        self.process: Process | None = None
        self.sock: socket.socket | None = None
        self.generation = 0  # counts starts: a batch sent to a dead worker is lost
        # A send failed on the event loop, which never waits for or restarts a
        # worker: the next batch on a model thread replaces it.
        self.broken = False
        self.killed_because: str | None = None  # the watchdog killed it, and why

    # ------------------------------------------------------------------ any thread
    @property
    def pid(self) -> int | None:
        process = self.process
        return process.pid if process is not None else None

    @property
    def alive(self) -> bool:
        process = self.process
        return (
            not self.broken
            and self.sock is not None
            and process is not None
            and process.poll() is None
        )

    def kill(self, because: str, *, ticket: int | None = None) -> None:
        """SIGKILL, without waiting (the watchdog; a stopped process dies too):
        the owner, waiting for its reply, sees it die and reports ``because``.
        With ``ticket``: only if it is still the process that batch went to."""
        with self._guard:
            process = self.process
            if process is None or (ticket is not None and ticket != self.generation):
                return
            if process.poll() is None:
                self.killed_because = because
                try:
                    os.kill(process.pid, signal.SIGKILL)
                except ProcessLookupError:  # pragma: no cover - it just exited
                    pass

    def close(self) -> None:
        """Stop it for good (the executor closing, after the batcher). A thread
        that still holds it (a batcher join that timed out) sees it die."""
        try:
            with self.owner.held():
                self.stop()
        except NotOwner:
            self.kill("the model is closing")

    # ------------------------------------------------------------------ the owner
    def relabel(self, label: str) -> None:
        """A spare taking over an instance takes its name."""
        self.label = label
        self.owner.what = f"{label}'s worker process"

    def start(self) -> None:
        """Spawn and wait until the model is loaded; ``ConfigError`` with the
        worker's own reason if it cannot load."""
        with self.owner.held():
            self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        with theirs:
            process = self._fork(theirs) or subprocess.Popen(
                [sys.executable, "-m", "tensorserve.runtime.worker_main", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
        with self._guard:
            self.process, self.sock = process, ours
            self.broken = False
            self.killed_because = None
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

    def _fork(self, theirs: socket.socket) -> ForkedProcess | None:
        """A worker forked from the template; None (spawn one) without a live template."""
        if self.template is None or not self.template.alive:
            return None
        try:
            return self.template.fork(theirs)
        except (EOFError, OSError) as exc:
            log.warning(
                "%s: the worker template failed (%s); starting the worker afresh", self.label, exc
            )
            return None

    def submit(
        self, features: dict[str, np.ndarray], parameters: Mapping[str, list[Any]] | None = None
    ) -> int:
        """Send one padded batch to this (live) worker; returns a ticket for
        ``receive``. Replies come back in the order of submits. ``parameters``
        (the model's declared request parameters, one value per row: plain
        scalars) travel in the message's msgpack header. The calling thread
        owns the worker until ``receive`` returns."""
        self.owner.acquire()
        try:
            if self.sock is None:
                raise self._never_ran()
            try:
                ipc.send(self.sock, _batch_header(parameters), features)
            except OSError:
                self._lost("while receiving this batch", ran=False)
        except BaseException:
            self.owner.release()
            raise
        return self.generation

    def receive(self, ticket: int) -> ipc.Message:
        """The reply to a submitted batch (blocking)."""
        self.owner.check()
        try:
            if ticket != self.generation or self.sock is None:
                raise self._never_ran()
            try:
                return ipc.recv(self.sock)
            except (EOFError, OSError):
                self._lost("while running this batch")
        finally:
            self.owner.release()

    def _never_ran(self) -> WorkerCrashed:
        return WorkerCrashed(
            f"{self.label}: the worker process died before running this batch", ran=False
        )

    def try_submit(
        self, features: dict[str, np.ndarray], parameters: Mapping[str, list[Any]] | None = None
    ) -> int | None:
        """``submit`` for an event loop: never restarts a worker or waits for
        one. None if the worker is not up or the send fails (then it is
        marked broken, and the next ``submit`` replaces it). Sent, the loop
        owns the worker until ``receive_soon`` delivers the reply."""
        self.owner.acquire()
        if not self.alive:
            self.owner.release()
            return None
        assert self.sock is not None
        try:
            ipc.send(self.sock, _batch_header(parameters), features)
        except OSError:
            self.broken = True
            self.owner.release()
            return None
        return self.generation

    def receive_soon(
        self, ticket: int, loop: asyncio.AbstractEventLoop, on_reply: OnReply
    ) -> Callable[[], None]:
        """``receive`` for an event loop that must not block: the loop reads
        the reply as it arrives and calls ``on_reply(message, None)`` on its
        own thread, or ``on_reply(None, ModelFailure)`` if the worker died.
        The dead process is taken off this handle on the loop; only waiting
        for its exit status happens on another thread, which touches nothing
        else.

        Returns ``finish_now``: on the loop's thread, stop watching and wait
        for the reply right there (for a close() on that thread)."""
        self.owner.check()
        sock = self.sock
        if ticket != self.generation or sock is None:
            self._reply(on_reply, None, self._never_ran())
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
                report = loop.run_in_executor(
                    None, self._detach().report, "while running this batch", True
                )
                report.add_done_callback(lambda f: self._reply(on_reply, None, f.result()))
                return
            if message is not None:
                stop_watching()
                self._reply(on_reply, message, None)

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
                    except WorkerCrashed as exc:
                        self._reply(on_reply, None, exc)
                    return
                if message is not None:
                    self._reply(on_reply, message, None)
                    return

        try:
            loop.add_reader(sock, readable)
        except BaseException:  # the caller fails the batch: the worker is free again
            self.owner.release()
            raise
        return finish_now

    def _reply(
        self, on_reply: OnReply, message: ipc.Message | None, error: BaseException | None
    ) -> None:
        """The batch is over for this worker: hand it back, then tell the caller."""
        self.owner.release()
        on_reply(message, error)

    def _detach(self) -> Lost:
        """Take the (dead) process and its socket off this handle."""
        self.owner.check()
        with self._guard:
            sock, self.sock = self.sock, None
            process, self.process = self.process, None
            return Lost(self.label, process, sock, self.killed_because)

    def _lost(self, when: str, *, ran: bool = True) -> NoReturn:
        raise self._detach().report(when, ran)

    def stop(self) -> None:
        """Ask the worker to exit (closing the socket does), kill it if it won't."""
        self.owner.check()
        with self._guard:
            sock, self.sock = self.sock, None
            process, self.process = self.process, None
        if sock is not None:
            try:
                ipc.send(sock, {"stop": True})
            except OSError:
                pass
            sock.close()
        if process is not None:
            _reap(self.label, process)


def _reap(label: str, process: Process) -> int:
    try:
        return process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("%s: worker process %d did not stop; killing it", label, process.pid)
        process.kill()
        return process.wait()


@dataclass(frozen=True)
class Lost:
    """A worker process taken off its handle after its connection broke.
    Nothing else holds it, so any thread may wait for it."""

    label: str
    process: Process | None
    sock: socket.socket | None
    because: str | None  # why the watchdog killed it, if it did

    def report(self, when: str, ran: bool) -> WorkerCrashed:
        """How it died, once its exit status is in (waits up to
        ``STOP_TIMEOUT_S``; one still running is killed)."""
        returncode: int | None = None
        if self.process is not None:
            try:
                returncode = self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        if self.sock is not None:
            self.sock.close()
        if returncode is None and self.process is not None:
            _reap(self.label, self.process)  # alive with a broken socket: it goes now
        if self.because is not None:
            message = f"{self.label}: the watchdog killed the worker process: {self.because}"
        else:
            message = f"{self.label}: the worker process died {when} ({_died(returncode)})"
        log.error("%s", message)
        return WorkerCrashed(message, ran=ran, watchdog=self.because is not None)
