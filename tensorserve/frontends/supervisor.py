"""``tensorserve serve --frontends N`` (N >= 2): this process becomes the
scheduler process. It checks the repository and reserves the ports (so a
start that cannot succeed fails here, in one line, before anything runs),
loads the models, and starts N front-end processes that serve HTTP and gRPC
on those ports and feed its schedulers (``frontends/hub.py``).

A front end that dies is restarted (at once if it had been up a while,
else after a growing pause); the others go on serving, and its own callers
see their connection close. This process dying ends every front end: each
sees its socket to here close and exits (the platform restarts the pod).

On SIGTERM or SIGINT every front end is sent SIGTERM and drains as a
one-process server does (readiness 503, ``drain_delay_s``, stop accepting,
``shutdown_grace_s`` for what is in flight); the models keep serving them
until the last has exited, then close. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from tensorserve.dataplane import logs
from tensorserve.dataplane.assembly import build_plane, models_served
from tensorserve.frontends.hub import FrontEndHub
from tensorserve.frontends.liveness import Stuck
from tensorserve.frontends.process import SETTINGS_ENV
from tensorserve.host import available_cpus
from tensorserve.http.server import CLOSE_TIMEOUT_S, cannot_listen, check_repository, tune_process
from tensorserve.settings import Settings

log = logging.getLogger(__name__)

# Pauses before restarting a front end that died soon after it started.
RESTART_PAUSES_S = (0.5, 1.0, 2.0, 5.0, 10.0)
STABLE_S = 10.0  # a front end up this long had started well: restarted at once


def frontend_count(settings: Settings) -> int:
    """``--frontends``: a number; ``auto``: the CPUs this process may use less
    one (for the scheduler process), 1 to 8; unset: ``auto`` where the server
    feeds a GPU, else 1 (``Settings.frontends_choice``)."""
    return settings.frontends_choice().count


def reserve(host: str, port: int, what: str) -> socket.socket:
    """Bind ``host:port`` with ``SO_REUSEPORT`` without listening: the port is
    checked free (a port in use fails here) and, for port 0, chosen; the
    front ends listen on it beside this socket, which takes no connection."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        return sock
    except OSError as exc:
        raise cannot_listen(f"{host}:{port} for {what}", exc) from None


def run(settings: Settings) -> None:
    """Serve with front-end processes until SIGTERM or SIGINT; ``StartupError``
    (before anything started) when the server cannot start."""
    logs.configure(settings.log_level, settings.log_format, "scheduler")
    check_repository(settings)
    count = frontend_count(settings)
    http = reserve(settings.host, settings.port, "HTTP")
    grpc = reserve(settings.host, settings.grpc_port, "gRPC") if settings.grpc_port >= 0 else None
    logs.log_startup(settings)
    ports: dict[str, Any] = {"port": http.getsockname()[1], "frontends": 1}
    if settings.intra_op_threads is None:
        # The front ends keep cores busy too: a CPU model's threads leave them theirs.
        ports["intra_op_threads"] = max(1, available_cpus() - 1 - count)
    if grpc is not None:
        ports["grpc_port"] = grpc.getsockname()[1]
    tune_process(settings)
    gc.collect()
    gc.freeze()  # as http/server.py does: what was imported lives as long as the process
    try:
        asyncio.run(_serve(settings.model_copy(update=ports), count))
    finally:
        http.close()
        if grpc is not None:
            grpc.close()


async def _serve(settings: Settings, count: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fleet: Fleet | None = None

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("shutdown: second %s, exiting at once (status %d)", name, 128 + signum)
            if fleet is not None:
                fleet.kill()
            logging.shutdown()
            os._exit(128 + signum)
        log.info(
            "shutdown: %s received; the front ends drain (send it again to exit at once)", name
        )
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    plane, loop_lag = build_plane(settings, role="scheduler")
    hub = FrontEndHub(plane, loop)
    async with models_served(plane, loop_lag):
        hub.start()
        fleet = Fleet(settings, hub, count)
        await fleet.start()
        log.info(
            "serving %s with %d front-end processes on http://%s:%s%s",
            settings.model_repository,
            count,
            settings.host,
            settings.port,
            f" and grpc://{settings.host}:{settings.grpc_port}" if settings.grpc_port >= 0 else "",
        )
        await stop.wait()
        # Each drains as a one-process server does; then a little longer to exit.
        patience = settings.drain_delay_s + settings.shutdown_grace_s + 2 * CLOSE_TIMEOUT_S
        await fleet.stop(patience)
        hub.stop()
    log.info("shutdown: done")


class Fleet:
    """The front-end processes: started, watched, restarted, stopped."""

    def __init__(self, settings: Settings, hub: FrontEndHub, count: int) -> None:
        self.settings, self.hub, self.count = settings, hub, count
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self._watching: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._env = {**os.environ, SETTINGS_ENV: settings.model_dump_json()}
        hub.on_silent = self._silent
        self._killed: set[int] = set()

    async def start(self) -> None:
        for index in range(self.count):
            await self._spawn(index, 0)

    async def _spawn(self, index: int, failures: int) -> None:
        ours, theirs = socket.socketpair()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tensorserve.frontends.process",
                str(theirs.fileno()),
                str(index),
                pass_fds=(theirs.fileno(),),
                env=self._env,
                # Signals reach a front end from this process only: a Ctrl-C
                # sent to the terminal's process group would otherwise be a
                # second signal to each, which exits at once instead of draining.
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.hub.attach(ours, process.pid)
        self.processes[index] = process
        if self._stopping:  # a restart that raced with the shutdown drains too
            process.send_signal(signal.SIGTERM)
        task = asyncio.create_task(self._watch(index, process, failures))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _watch(self, index: int, process: asyncio.subprocess.Process, failures: int) -> None:
        started = time.monotonic()
        status = await process.wait()
        if self._stopping:
            return
        failures = 0 if time.monotonic() - started >= STABLE_S else failures + 1
        log.error(
            "front end %d (pid %d) exited with status %s; restarting it", index, process.pid, status
        )
        while not self._stopping:
            pause = RESTART_PAUSES_S[min(failures, len(RESTART_PAUSES_S)) - 1] if failures else 0.0
            await asyncio.sleep(pause)
            if self._stopping:
                return
            try:
                await self._spawn(index, failures)
                return
            except Exception:  # fork or exec failed (memory, file descriptors): try again later
                log.exception("front end %d could not be started", index)
                failures += 1

    async def stop(self, patience: float) -> None:
        """SIGTERM to each; SIGKILL to any still running after ``patience`` s."""
        self._stopping = True
        for process in self.processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self._all_exited(), patience)
        except asyncio.TimeoutError:
            log.error("shutdown: front ends still running after %.0f s: killing them", patience)
            self.kill()
            await self._all_exited()
        for task in self._watching:
            task.cancel()

    async def _all_exited(self) -> None:
        """Every front end has exited, a restart started meanwhile included."""
        while running := [p for p in self.processes.values() if p.returncode is None]:
            await asyncio.gather(*(p.wait() for p in running))

    def _silent(self, pid: int, stuck: Stuck) -> None:
        for index, process in self.processes.items():
            if process.pid == pid and process.returncode is None and not self._stopping:
                if pid in self._killed:
                    return  # killed already; its socket closes as it goes
                self._killed.add(pid)
                log.error(
                    "front end %d (pid %d) has sent nothing for %.0f s: killing it (%s)",
                    index,
                    pid,
                    stuck.for_s,
                    stuck.why,
                )
                process.kill()

    def kill(self) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                process.kill()
