"""The worker template: one process per server that has imported torch and
the process-isolated models (and, on the CPU, loaded their weights) but never
runs a batch, and that ``fork()``s the models' worker processes on request
(``isolation = "process"``).

Why: a worker started from scratch pays for Python, torch and the model
before it can run a batch (3-4 s of a core on a small VM,
``benchmarks/worker_crash.py``); a worker forked from the template is ready
in milliseconds and shares the template's weights copy-on-write: a crash
is cheap for the machine too, not only for the callers (the standby's work).
Why one for all models, not one each: torch and Python's own pages are then
paid for once (docs/threading.md, "One template, one spare").

Safe to fork because the template never runs a batch: it holds torch's
intra-op pool at one thread (no OpenMP threads exist to be lost in the
child), and never touches CUDA: a model on a GPU (or "auto") is imported but
loaded by each worker after the fork, the way a spawned worker loads it.

The control socket is a ``SOCK_SEQPACKET`` pair (one message per request,
no framing needed), one request at a time: ``{"load": key, "hello": ...}``
loads a model under ``key`` (or only notes it, where the template may not
load it); ``{"drop": key}`` forgets it; ``{"fork": 1}`` with a socket's file
descriptor attached (SCM_RIGHTS) answers ``{"pid": ...}``, a worker that
waits on that socket for its model's hello; ``{"status": pid}`` answers the
exit status of a worker that has exited (the template is its parent and
reaps it). A load holds the template for its length: a fork asked meanwhile
waits for it (the spare worker, ``standby.py``, is what a crash takes first).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import msgpack

from tensorserve.errors import ConfigError

log = logging.getLogger("tensorserve.runtime.isolated")

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0


class Template:
    """The server's handle on the worker template (see the module docstring)."""

    def __init__(self, log_level: str, label: str = "the worker template") -> None:
        self.log_level = log_level
        self.label = label
        self.process: subprocess.Popen[bytes] | None = None
        self.started = False  # it answered its first message
        self.keys: frozenset[str] = frozenset()  # the models it holds loaded
        self._control: socket.socket | None = None
        self._lock = threading.Lock()  # one request on the control socket at a time

    def start(self) -> None:
        self.launch()
        self.wait_started()

    def launch(self) -> None:
        """Spawn it; it imports torch and the server's modules at once."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = spawn(["--template"], theirs)
        self._control = ours

    def wait_started(self) -> None:
        """Until it is ready for requests; ``ConfigError`` if it died."""
        try:
            self._ask({"log_level": self.log_level}, timeout=START_TIMEOUT_S)
        except (EOFError, OSError):
            self.stop()
            raise ConfigError(f"{self.label}: did not start") from None
        self.started = True
        log.info("%s: process %d ready", self.label, self.pid)

    def add(self, key: str, hello: dict[str, Any]) -> None:
        """Load a model (``hello``, as a worker gets it) under ``key``, for the
        workers forked from now on; ``ConfigError`` with the reason it cannot."""
        try:
            reply = self._ask({"load": key, "hello": hello}, timeout=START_TIMEOUT_S)
        except (EOFError, OSError) as exc:
            self.stop()  # it died or hangs in the model's code: workers spawn from now on
            raise ConfigError(f"{self.label} failed loading the model ({exc!r})") from None
        if "error" in reply:
            raise ConfigError(reply["error"])
        with self._lock:
            self.keys = self.keys | {key}

    def drop(self, key: str) -> None:
        """Forget a model closed for good (its workers keep their copy)."""
        with self._lock:
            self.keys = self.keys - {key}
        with contextlib.suppress(EOFError, OSError):
            self._ask({"drop": key})

    def fork(self, worker_end: socket.socket) -> ForkedProcess:
        """A new worker process whose end of its socket is ``worker_end``; it
        waits there for its model's hello."""
        reply = self._ask({"fork": 1}, fds=[worker_end.fileno()])
        return ForkedProcess(int(reply["pid"]), self)

    def returncode(self, pid: int) -> int | None:
        """A finished worker's exit status (negative: the signal); None if the
        template has not reaped it yet."""
        try:
            return self._ask({"status": pid}, timeout=5.0).get("returncode")
        except (EOFError, OSError):
            return None

    def _ask(
        self, message: dict[str, Any], fds: list[int] | None = None, timeout: float = 30.0
    ) -> dict[str, Any]:
        with self._lock:
            control = self._control
            if control is None:
                raise EOFError("the worker template is stopped")
            control.settimeout(timeout)
            socket.send_fds(control, [msgpack.packb(message)], fds or [])
            data, _, _, _ = socket.recv_fds(control, 1 << 16, 0)
            if not data:
                raise EOFError("the worker template exited")
            return msgpack.unpackb(data)

    @property
    def pid(self) -> int | None:
        process = self.process
        return process.pid if process is not None else None

    @property
    def alive(self) -> bool:
        process = self.process
        return process is not None and process.poll() is None

    def stop(self) -> None:
        """Closing the control socket ends the template; its workers live on
        until their own sockets close."""
        control, self._control = self._control, None  # no lock: a load may hold it
        if control is not None:
            with contextlib.suppress(OSError):
                control.shutdown(socket.SHUT_RDWR)  # wakes a request waiting for a reply
            control.close()
        process, self.process = self.process, None
        if process is not None:
            if not self.started:  # still importing: it would read the socket only after
                process.kill()
            reap(self.label, process)


def spawn(args: list[str], theirs: socket.socket) -> subprocess.Popen[bytes]:
    """``python -m tensorserve.runtime.worker_main [ARGS] FD``, which inherits
    the socket ``theirs`` as FD."""
    fd = theirs.fileno()
    return subprocess.Popen(
        [sys.executable, "-m", "tensorserve.runtime.worker_main", *args, str(fd)], pass_fds=(fd,)
    )


def reap(label: str, process: subprocess.Popen[bytes] | ForkedProcess) -> int:
    """Wait for a process that was asked to exit; kill it if it does not."""
    try:
        return process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("%s: process %d did not stop; killing it", label, process.pid)
        process.kill()
        return process.wait()


class ForkedProcess:
    """A worker forked by the template, with the part of ``subprocess.Popen``
    that ``WorkerProcess`` uses. It is the template's child, not ours: its
    exit is seen through a pidfd, and its status asked of the template.

    ``poll`` and ``wait`` may make that round trip (seconds, if the template
    is slow): never on an event loop. ``kill`` never waits: it signals through
    the pidfd, which stays open for the object's life, so a signal can never
    reach another process that took the pid over.

    Safe from several threads, as ``Popen`` is: the status is collected once,
    under a lock."""

    def __init__(self, pid: int, template: Template) -> None:
        self.pid = pid
        self.template = template
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)
        weakref.finalize(self, os.close, self._pidfd)
        self._collecting = threading.Lock()

    def poll(self) -> int | None:
        if self.returncode is None and self._exited(0):
            with self._collecting:
                if self.returncode is None:
                    self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            if not self._exited(timeout):
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            self.poll()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # exited (and reaped) already
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def _exited(self, timeout: float | None) -> bool:
        readable, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(readable)

    def _collect(self) -> None:
        """Its exit status, from the template (which reaps it on SIGCHLD)."""
        for _ in range(100):
            code = self.template.returncode(self.pid)
            if code is not None:
                self.returncode = code
                return
            time.sleep(0.01)
        # The template is gone: dead, but how is unknown.
        self.returncode = -int(signal.SIGKILL)
