"""A model's worker processes, seen from the server: one ``WorkerProcess``
per instance (start, send a batch, read its reply, notice its death, kill it
for the watchdog) and the ``Standby``, a spare one kept loaded so that a
crash costs a swap instead of a model load. ``isolated.ProcessExecutor``
drives them; ``worker_main.py`` is the other end of the socket.
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
from typing import Any, NoReturn

import numpy as np

from tensorserve.errors import ConfigError, WorkerCrashed
from tensorserve.runtime import ipc
from tensorserve.runtime.template import ForkedProcess, Template

log = logging.getLogger("tensorserve.runtime.isolated")

LOAD_TIMEOUT_S = 600.0  # import torch, load weights, maybe compile
STOP_TIMEOUT_S = 10.0
# Fewer, larger socket reads and writes for batches of a few MB.
SOCKET_BUFFER_BYTES = 4 << 20


def _batch_header(parameters: Mapping[str, list[Any]] | None) -> dict[str, Any]:
    """A batch message's header: empty, or the request parameters' columns."""
    return {"parameters": dict(parameters)} if parameters else {}


def _died(returncode: int | None) -> str:
    if returncode is None:
        return "still running, but its connection broke"
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


class WorkerProcess:
    """One worker process and the server's end of its socket."""

    def __init__(self, hello: dict[str, Any], label: str, template: Template | None = None) -> None:
        self.hello = hello
        self.label = label
        self.template = template  # fork from it (milliseconds) instead of spawning
        self.process: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.sock: socket.socket | None = None
        self.generation = 0  # counts starts: a batch sent to a dead worker is lost
        # A send failed on the event loop, which never waits for or restarts a
        # worker: the next batch on a model thread replaces it.
        self.broken = False
        self.killed_because: str | None = None  # the watchdog killed it, and why

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
            process = self._fork(theirs) or subprocess.Popen(
                [sys.executable, "-m", "tensorserve.runtime.worker_main", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
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
            log.warning("%s: the worker template failed (%s); starting the worker afresh",
                        self.label, exc)
            return None

    def submit(
        self, features: dict[str, np.ndarray], parameters: Mapping[str, list[Any]] | None = None
    ) -> int:
        """Send one padded batch to this (live) worker; returns a ticket for
        ``receive``. Replies come back in the order of submits. ``parameters``
        (the model's declared request parameters, one value per row: plain
        scalars) travel in the message's msgpack header."""
        if self.sock is None:
            raise self._never_ran()
        try:
            ipc.send(self.sock, _batch_header(parameters), features)
        except OSError:
            self._lost("while receiving this batch", ran=False)
        return self.generation

    def receive(self, ticket: int) -> ipc.Message:
        """The reply to a submitted batch."""
        if ticket != self.generation or self.sock is None:
            raise self._never_ran()
        try:
            return ipc.recv(self.sock)
        except (EOFError, OSError):
            self._lost("while running this batch")

    def _never_ran(self) -> WorkerCrashed:
        return WorkerCrashed(
            f"{self.label}: the worker process died before running this batch", ran=False
        )

    def kill(self, because: str) -> None:
        """SIGKILL, without waiting (the watchdog; a stopped process dies too):
        whoever waits for its reply sees it die and reports ``because``."""
        process = self.process
        if process is not None and process.poll() is None:
            self.killed_because = because
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover - it just exited
                pass

    @property
    def alive(self) -> bool:
        return (
            not self.broken
            and self.sock is not None
            and self.process is not None
            and self.process.poll() is None
        )

    def try_submit(
        self, features: dict[str, np.ndarray], parameters: Mapping[str, list[Any]] | None = None
    ) -> int | None:
        """``submit`` for an event loop: never restarts a worker or waits for
        one. None if the worker is not up or the send fails (then it is
        marked broken, and the next ``submit`` replaces it)."""
        if not self.alive:
            return None
        assert self.sock is not None
        try:
            ipc.send(self.sock, _batch_header(parameters), features)
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
            on_reply(None, self._never_ran())
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
                    except WorkerCrashed as exc:
                        on_reply(None, exc)
                    return
                if message is not None:
                    on_reply(message, None)
                    return

        loop.add_reader(sock, readable)
        return finish_now

    def _lost(self, when: str, *, ran: bool = True) -> NoReturn:
        process = self.process
        returncode: int | None = None
        if process is not None:
            try:
                returncode = process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        because = self.killed_because
        if because is not None:
            message = f"{self.label}: the watchdog killed the worker process: {because}"
        else:
            message = f"{self.label}: the worker process died {when} ({_died(returncode)})"
        log.error("%s", message)
        raise WorkerCrashed(message, ran=ran, watchdog=because is not None)

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


class Standby:
    """One spare worker, loaded in the background, for whichever instance's
    worker dies next: a crash then costs a swap, not a model load."""

    def __init__(self, hello: dict[str, Any], label: str, template: Template | None = None) -> None:
        self.hello = hello
        self.template = template
        self.label = f"{label} standby"
        self._lock = threading.Lock()
        self._ready: WorkerProcess | None = None
        self._loading: WorkerProcess | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def refill(self) -> None:
        with self._lock:
            if self._closed or self._ready is not None or self._loading is not None:
                return
            self._loading = WorkerProcess(self.hello, self.label, self.template)
            self._thread = threading.Thread(target=self._load, name=self.label, daemon=True)
            self._thread.start()

    def _load(self) -> None:
        worker = self._loading
        assert worker is not None
        try:
            worker.start()
        except ConfigError as exc:
            if not self._closed:
                log.error("%s: could not start (%s); crashes will reload the model", self.label, exc)
            worker = None
        with self._lock:
            self._loading = None
            if worker is not None and not self._closed:
                self._ready, worker = worker, None
        if worker is not None:
            worker.stop()  # closed while it loaded

    def take(self) -> WorkerProcess | None:
        """The loaded spare (waiting for one that is loading: it is further
        along than a new start would be); a new one starts loading."""
        with self._lock:
            thread = self._thread if self._loading is not None else None
        if thread is not None:
            thread.join(LOAD_TIMEOUT_S)
        with self._lock:
            spare, self._ready = self._ready, None
        if spare is not None and not spare.alive:
            spare.stop()
            spare = None
        self.refill()
        return spare

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._ready = self._ready, None
            loading, thread = self._loading, self._thread
        if loading is not None:
            loading.kill("the model is closing")  # its start() then fails at once
        if thread is not None:
            thread.join()
        if spare is not None:
            spare.stop()
