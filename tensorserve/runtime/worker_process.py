"""One model instance's worker process, seen from the server: start it, hand
it padded batches and read the replies (on the scheduler's event loop,
``worker_channel.py``), notice its death, kill it for the watchdog.
``isolated.ProcessExecutor`` drives one per instance; ``standby.py`` keeps a
spare loaded; ``worker_main.py`` is the other end of the socket.

Who may touch what (docs/architecture.md, "Who owns what"): the scheduler
owns the instance. Its loop sends and reads (``dispatch``); restoring a dead
worker (``start`` again) runs on another thread while the scheduler sends
the instance nothing. Any thread may ``kill`` it (the watchdog), ask whether
it is ``alive`` and its ``pid`` (readiness), or ``stop`` it; they take
``_guard``, which every swap of the process takes too.

The loop never waits on a worker: ``alive``, ``pid`` and ``kill`` read this
handle's own state and send a signal, nothing more (a forked worker's exit
status is asked of the template, a round trip that may take seconds). The
loop learns of a death from its socket's EOF (``worker_channel.py``), takes
the process off the handle there, and has how it died found out on the
control pool (``Lost.report``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorserve.errors import ConfigError, WorkerCrashed
from tensorserve.ipc import messages as ipc
from tensorserve.pools import control_pool
from tensorserve.runtime.template import STOP_TIMEOUT_S, ForkedProcess, Template, reap, spawn
from tensorserve.runtime.worker_channel import OnReply, WorkerChannel

log = logging.getLogger("tensorserve.runtime.isolated")

LOAD_TIMEOUT_S = 600.0  # import torch, load weights, maybe compile
SOCKET_BUFFER_BYTES = 4 << 20  # fewer, larger socket reads and writes for batches of a few MB

Process = subprocess.Popen[bytes] | ForkedProcess


def _died(returncode: int | None) -> str:
    if returncode is None:
        return "still running, but its connection broke"
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    if returncode == ipc.EXIT_DEVICE_LOST:
        return f"exit code {returncode}: a sticky CUDA error lost its CUDA context"
    return f"exit code {returncode}"


def signal_name(number: int) -> str:
    """ "signal SIGKILL"; one ``signal.Signals`` has no member for (a real-time
    signal but the first and last): "signal 35 (SIGRTMIN+1)"."""
    try:
        return f"signal {signal.Signals(number).name}"
    except ValueError:
        pass
    if signal.SIGRTMIN < number < signal.SIGRTMAX:
        return f"signal {number} (SIGRTMIN+{number - signal.SIGRTMIN})"
    return f"signal {number}"


class WorkerProcess:
    """One worker process and the server's end of its socket (see the module
    docstring for which thread may call what)."""

    def __init__(self, hello: dict[str, Any], label: str, template: Template | None = None) -> None:
        self.hello = hello
        self.label = label
        self.template = template  # fork from it (milliseconds) instead of spawning
        self._guard = threading.Lock()  # swaps of the process vs. kill / alive / stop
        self.process: Process | None = None
        self.sock: socket.socket | None = None
        self.generation = 0  # counts starts: a batch sent to a dead worker is lost
        self.killed_because: str | None = None  # the watchdog killed it, and why
        self._channel: WorkerChannel | None = None  # the socket as the loop drives it
        # Called on the loop once this handle's worker is seen dead, busy or
        # idle (its instance's: ProcessExecutor sets it; a spare has none).
        self.on_lost: Callable[[], None] | None = None

    # ------------------------------------------------------------------ any thread
    @property
    def pid(self) -> int | None:
        process = self.process
        return process.pid if process is not None else None

    @property
    def alive(self) -> bool:
        """It holds a worker whose death the loop has not seen (its socket's
        EOF). Only this handle's state: safe on the loop, never waits."""
        return self.sock is not None and self.process is not None

    def running(self) -> bool:
        """``alive``, and its process has not exited. Off the loop only: a
        forked worker's exit status is a round trip to the template."""
        process = self.process
        return self.alive and process is not None and process.poll() is None

    def kill(self, because: str, *, ticket: int | None = None) -> None:
        """SIGKILL, without waiting or polling (the watchdog, on the loop; a
        stopped process dies too): the scheduler's loop sees its socket close
        and reports ``because`` (``Lost.report`` tells a worker that had died
        of its own accord first). With ``ticket``: only if it is still the
        process that batch went to."""
        with self._guard:
            process = self.process
            if process is None or (ticket is not None and ticket != self.generation):
                return
            self.killed_because = because
            # Still on this handle, so nobody has reaped it yet: its pid is
            # still its own (a zombie at worst); a forked worker's goes by pidfd.
            if isinstance(process, ForkedProcess):
                process.kill()
            elif process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ the owner
    def start(self) -> None:
        """Spawn (or fork) and wait until the model is loaded; ``ConfigError``
        with the worker's own reason if it cannot load."""
        self.start_idle(fork_only=False)
        self.assign(self.hello, self.label)

    def start_idle(self, *, fork_only: bool = True) -> None:
        """Fork a worker that waits for its model's hello (a spare, until a
        model takes it: ``assign``); ``ConfigError`` if there is no template."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        with theirs:
            forked = self._fork(theirs)
            if forked is None and fork_only:
                ours.close()
                raise ConfigError(f"{self.label}: no worker template to fork from")
            process: Process = forked or spawn([], theirs)
        with self._guard:
            self.process, self.sock = process, ours
            self.killed_because = None
            self.generation += 1
        if forked is not None:  # until it runs: a spare is not ready while the fork settles
            try:
                ours.settimeout(LOAD_TIMEOUT_S)
                ipc.recv(ours)  # {"forked": pid}
                ours.settimeout(None)
            except (EOFError, OSError) as exc:
                why = "timed out" if isinstance(exc, TimeoutError) else _died(process.poll())
                self.stop()
                raise ConfigError(
                    f"{self.label}: the forked worker did not start ({why})"
                ) from None

    def assign(self, hello: dict[str, Any], label: str) -> None:
        """Tell the started worker its model, and wait until it is loaded."""
        self.hello, self.label = hello, label
        ours, process = self.sock, self.process
        if ours is None or process is None:
            raise ConfigError(f"{self.label}: the worker process is gone")
        try:
            ours.settimeout(LOAD_TIMEOUT_S)
            ipc.send(ours, hello)
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

    def dispatch(
        self,
        features: dict[str, np.ndarray],
        parameters: Mapping[str, list[Any]] | None,
        on_reply: OnReply,
        loop: asyncio.AbstractEventLoop | None,
    ) -> int:
        """On the scheduler's ``loop``: send one padded batch without blocking;
        ``on_reply(message, None)`` once its reply is in, or ``(None,
        WorkerCrashed)`` if the worker dies first (``ran`` for the oldest, and
        ``behind`` too for the rest of the hello's ``batches_in_flight``, which
        it may have been running unless the watchdog killed it; not ``ran`` for
        those sent behind them). ``parameters`` (plain scalars,
        one per row) travel in the msgpack header. Returns the ticket ``kill`` takes."""
        if not self.alive or loop is None:
            raise self._never_ran()
        assert self.sock is not None
        if self._channel is None or self._channel.sock is not self.sock:
            lost = functools.partial(self._lost_on_loop, loop, self.generation)
            self._channel = WorkerChannel(self.sock, loop, lost)
        header = {"parameters": dict(parameters)} if parameters else {}
        self._channel.send(ipc.frames(header, features), on_reply)
        return self.generation

    def detach(self) -> None:
        """On the loop: stop watching the socket (before ``close``)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _lost_on_loop(
        self, loop: asyncio.AbstractEventLoop, generation: int, waiting: list[OnReply]
    ) -> None:
        """The connection to worker ``generation`` broke: take that process
        off this handle (not a newer one ``repair`` started meanwhile), learn
        how it died on the control pool, then fail what was sent to it. Never
        raises; every one of ``waiting`` is answered once, whatever fails."""
        lost = self._take(generation)
        if lost.generation == self.generation:
            self._channel = None
        if lost.process is not None and self.on_lost is not None:
            try:
                self.on_lost()  # the scheduler starts the repair now, busy or idle
            except Exception:  # the batches below must still be answered
                log.exception("%s: reporting a lost worker to the scheduler failed", self.label)

        # The oldest was running; on CUDA the worker launches the next before
        # collecting it (worker_pipeline.py), so that one may have run too:
        # a device-side assert it caused can surface while the worker collects
        # the oldest, and a forward that blocks the host (a hung kernel's
        # ``.item()``) keeps the oldest from being collected until the watchdog
        # kills the worker. So it is a suspect either way, launched ``behind``
        # (recovery does not count the crash against its items). Those sent
        # behind them never ran.
        running = self.hello.get("batches_in_flight", 1)

        def fail(reported: asyncio.Future[WorkerCrashed] | None) -> None:
            crash = self._reported(reported)
            for i, on_reply in enumerate(waiting):
                # One exception per batch: each batch's callers raise their own.
                error = crash if i == 0 else self._never_ran()
                if 0 < i < running:
                    error = WorkerCrashed(crash.message, ran=True, behind=True)
                try:
                    on_reply(None, error)
                except Exception:  # the rest must still be answered
                    log.exception("%s: answering a batch of a dead worker failed", self.label)

        try:
            loop.run_in_executor(control_pool(), lost.report).add_done_callback(fail)
        except Exception:  # no pool (shutting down): answer without the report
            log.exception("%s: could not find out how the worker process died", self.label)
            fail(None)

    def _reported(self, reported: asyncio.Future[WorkerCrashed] | None) -> WorkerCrashed:
        """The report's crash, or one saying that how it died is unknown."""
        why = "the report was not made"
        if reported is not None and not reported.cancelled():
            error = reported.exception()
            if error is None and isinstance(reported.result(), WorkerCrashed):
                return reported.result()
            why = repr(error) if error is not None else f"the report was {reported.result()!r}"
        log.error("%s: reporting a dead worker process failed: %s", self.label, why)
        return WorkerCrashed(
            f"{self.label}: the worker process died while running this batch (how is unknown)",
            ran=True,
        )

    def _never_ran(self) -> WorkerCrashed:
        return WorkerCrashed(
            f"{self.label}: the worker process died before running this batch", ran=False
        )

    def _take(self, generation: int | None = None) -> Lost:
        """Take the process and its socket off this handle; with ``generation``,
        only if they are still that start's (else an empty ``Lost``: whoever
        started the newer one stopped the old)."""
        with self._guard:
            if generation is not None and generation != self.generation:
                return Lost(self.label, None, None, None, generation)
            lost = Lost(self.label, self.process, self.sock, self.killed_because, self.generation)
            self.process, self.sock = None, None
            return lost

    def stop(self) -> None:
        """Ask the worker to exit (closing the socket does), kill it if it won't."""
        lost = self._take()
        if lost.sock is not None:
            with contextlib.suppress(OSError):
                lost.sock.settimeout(1.0)  # the loop had made it non-blocking
                ipc.send(lost.sock, {"stop": True})
            lost.sock.close()
        if lost.process is not None:
            reap(self.label, lost.process)


@dataclass(frozen=True)
class Lost:
    """A worker process taken off its handle (its connection broke, or it
    is stopping). Nothing else holds it, so any thread may wait for it."""

    label: str
    process: Process | None
    sock: socket.socket | None
    because: str | None  # why the watchdog killed it, if it did
    generation: int  # the handle's start it came from

    def report(self) -> WorkerCrashed:
        """How it died running its batch, once its exit status is in (waits up
        to ``STOP_TIMEOUT_S``; one still running is killed)."""
        returncode: int | None = None
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                returncode = self.process.wait(STOP_TIMEOUT_S)
        if self.sock is not None:
            self.sock.close()
        if returncode is None and self.process is not None:
            reap(self.label, self.process)  # alive with a broken socket: it goes now
        # The watchdog's SIGKILL may have come after it died of its own accord.
        watchdog = self.because is not None and returncode in (None, -signal.SIGKILL)
        if watchdog:
            message = f"{self.label}: the watchdog killed the worker process: {self.because}"
        elif self.process is None:  # a newer worker replaced it, and its replacer stopped it
            message = f"{self.label}: the worker process was replaced while running this batch"
        else:
            died = _died(returncode)
            message = f"{self.label}: the worker process died while running this batch ({died})"
        log.error("%s", message)
        return WorkerCrashed(message, ran=True, watchdog=watchdog)
