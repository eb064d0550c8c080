"""Servers in child processes, for benchmarks and tests: start one, wait until
it is ready, measure its process tree, stop it and every process it started.

    ChildServer       any command (the peers of benchmarks/peers run in these)
    ServerProcess     ``python -m tensorserve serve`` on a free loopback port
    ServedHttpTarget  an ``HttpTarget`` whose server it starts and stops (``--serve``)

The process tree is read with psutil: the server, its descendants, every
process seen in the tree before (a worker re-parented to init when its
parent died is still the server's) and, for a server started in its own
session, every process of that session. Deadlines use ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tensorserve_bench.items import FeatureSpec, Item
from tensorserve_bench.targets import Counters, HttpTarget


def tree_path(tree: str | Path) -> str:
    """A ``PYTHONPATH`` that serves ``tree``'s tensorserve first and keeps what
    this process's path adds after it (packages installed beside the system's,
    as on the lent GPU machine: scripts/gpu_run.sh puts them in /tmp/site)."""
    return os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def override_flags(overrides: Mapping[str, Any]) -> list[str]:
    """``{"max_batch_size": 32, "access_log": False}`` -> ``["--max-batch-size", "32",
    "--no-access-log"]``: serve refuses ``--access-log false``; None is left out."""
    flags = []
    for key, value in overrides.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            flags += [f"--{flag}", str(value)]
    return flags


@dataclass(frozen=True)
class TreeUsage:
    """A server's process tree at one moment."""

    processes: int
    rss_bytes: int  # summed over the processes (shared pages count once per process)
    cpu_s: float  # user + system seconds so far, the children they reaped included


@dataclass(frozen=True)
class StopReport:
    returncode: int | None
    # Processes of the tree still alive after the server itself exited, killed
    # by PID (pid -> command line). LitServe leaves its workers behind, say.
    leftovers: dict[int, str]


class ChildServer:
    """A server command in a child process, ready when ``ready_url`` answers 200.

    ``log``: a file for the server's stdout and stderr (else it inherits ours).
    ``new_session``: start it in a session of its own (its processes are then
    found by session as well as by parentage). ``sample_interval``: a thread
    samples the tree's memory this often, for ``peak_rss_bytes``.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        ready_url: str,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log: str | Path | None = None,
        name: str | None = None,
        ready_timeout: float = 120.0,
        new_session: bool = False,
        sample_interval: float | None = None,
    ) -> None:
        self.command = list(command)
        self.ready_url = ready_url
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.log = Path(log) if log is not None else None
        self.name = name or Path(self.command[0]).name
        self.ready_timeout = ready_timeout
        self.new_session = new_session
        self.sample_interval = sample_interval
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None  # seconds from start to ready
        self._seen: dict[int, psutil.Process] = {}
        self._peak_rss = 0
        self._sampler: threading.Thread | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ life cycle
    def start(self) -> ChildServer:
        """Start the command and wait until it is ready; on failure nothing is left running."""
        output = None
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            output = open(self.log, "wb")  # noqa: SIM115 - the child keeps it open
        started = time.monotonic()
        try:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                start_new_session=self.new_session,
            )
        finally:
            if output is not None:
                output.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - started
        if self.sample_interval:
            self._sampler = threading.Thread(
                target=self._sample_loop, name=f"{self.name}-sampler", daemon=True
            )
            self._sampler.start()
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.process.returncode} before it was "
                    f"ready: {' '.join(self.command)}{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.ready_url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(
            f"{self.name} not ready at {self.ready_url} after {self.ready_timeout:.0f} s"
            f"{self.log_tail()}"
        )

    def stop(self, grace: float = 15.0, linger: float = 3.0) -> StopReport:
        """SIGTERM the server and wait ``grace`` seconds (then SIGKILL); then
        SIGTERM / SIGKILL, by PID, whatever is left of its tree, giving it
        ``linger`` seconds to exit before each. Raises if a process survives
        SIGKILL."""
        self._stopping.set()
        if self.process is None:
            return StopReport(None, {})
        tree = self.members()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        root = self.process.pid
        left = [p for p in {p.pid: p for p in [*tree, *self.members()]}.values() if p.pid != root]
        # Children shutting down on their own, as the server asked them to.
        alive = _wait_gone(left, linger)
        leftovers = {p.pid: _command_line(p) for p in alive}
        for signal_them in (psutil.Process.terminate, psutil.Process.kill):
            if not alive:
                break
            for process in alive:
                try:
                    signal_them(process)
                except psutil.NoSuchProcess:
                    pass
            alive = _wait_gone(alive, linger)
        if alive:
            raise RuntimeError(
                f"{self.name}: processes alive after SIGKILL: "
                f"{ {p.pid: _command_line(p) for p in alive} }"
            )
        return StopReport(self.process.returncode, leftovers)

    def log_tail(self, lines: int = 25) -> str:
        if self.log is None:
            return ""
        try:
            tail = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "; log tail:\n" + "\n".join(tail)

    # ------------------------------------------------------------------ the tree
    def members(self) -> list[psutil.Process]:
        """The live processes of the server's tree (see the module docstring),
        the server first while it runs."""
        if self.process is None:
            return []
        found: list[psutil.Process] = []
        try:
            root = psutil.Process(self.process.pid)
            found += [root, *root.children(recursive=True)]  # the server first
        except psutil.NoSuchProcess:
            pass
        found += self._seen.values()
        if self.new_session:
            for process in psutil.process_iter():
                try:
                    if os.getsid(process.pid) == self.process.pid:
                        found.append(process)
                except OSError:
                    pass
        live = {p.pid: p for p in found if _alive(p)}
        self._seen = dict(live)
        return list(live.values())

    def usage(self) -> TreeUsage:
        """Processes, summed RSS and CPU seconds of the tree now."""
        rss, cpu, count = 0, 0.0, 0
        for process in self.members():
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    memory = process.memory_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            count += 1
            rss += memory.rss
            cpu += times.user + times.system + times.children_user + times.children_system
        self._peak_rss = max(self._peak_rss, rss)
        return TreeUsage(count, rss, cpu)

    @property
    def peak_rss_bytes(self) -> int:
        """The largest summed RSS seen since start (or ``reset_peak``); sampled
        every ``sample_interval`` seconds and at every ``usage()`` call."""
        return self._peak_rss

    def reset_peak(self) -> None:
        self._peak_rss = self.usage().rss_bytes

    def _sample_loop(self) -> None:
        assert self.sample_interval is not None
        while not self._stopping.wait(self.sample_interval):
            try:
                self.usage()
            except psutil.Error:  # a process that went between two reads
                pass


def _wait_gone(processes: Sequence[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``processes`` still alive after up to ``timeout`` seconds. A
    zombie counts as gone: its parent may be an init that never reaps it
    (``psutil.wait_procs`` would wait for that)."""
    deadline = time.monotonic() + timeout
    alive = [p for p in processes if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    return alive


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())[:160]
    except psutil.Error:
        return "?"


class ServerProcess(ChildServer):
    """A ``python -m tensorserve serve`` child on free loopback ports (HTTP and
    gRPC); ``start`` waits until it is ready. ``env`` adds to this process's
    environment. Every benchmark that needs a server starts it with this; to
    serve another source tree (a worktree of an older commit), give
    ``env={"PYTHONPATH": tree}`` and ``cwd=tree``."""

    def __init__(
        self,
        repository: str,
        args: Sequence[str] = (),
        *,
        ready_timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log: str | Path | None = None,
        new_session: bool = False,
        sample_interval: float | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {"TENSORSERVE_GRPC_PORT": str(free_port()), **(env or {})}  # older trees ignore it
        self.grpc_address = f"127.0.0.1:{env['TENSORSERVE_GRPC_PORT']}"
        command = [
            sys.executable, "-m", "tensorserve", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--model-repository", repository, "--log-level", "WARNING",
            # No load balancer to drain: stop at once (``args`` may say otherwise).
            "--drain-delay-s", "0",
            *args,
        ]  # fmt: skip
        super().__init__(
            command,
            ready_url=f"{self.url}/v2/health/ready",
            env={**os.environ, **env},
            cwd=cwd,
            log=log,
            name="tensorserve",
            ready_timeout=ready_timeout,
            new_session=new_session,
            sample_interval=sample_interval,
        )

    def start(self) -> ServerProcess:
        super().start()
        return self


class ServedHttpTarget:
    """An ``HttpTarget`` whose server this target starts on ``open`` and stops on
    ``aclose``. Its counters carry the server tree's CPU seconds, so each point
    also reports what the server spent (``PointResult.server_cpu_s``)."""

    kind = "http (--serve)"

    def __init__(
        self,
        repository: str,
        model: str,
        server_args: Sequence[str] = (),
        *,
        timeout: float = 60.0,
        protocol: str = "msgpack",
    ):
        self.server = ServerProcess(repository, server_args)
        self.http = HttpTarget(self.server.url, model, timeout=timeout, protocol=protocol)
        self.model = model

    @property
    def specs(self) -> list[FeatureSpec]:
        return self.http.specs

    @property
    def parameters(self) -> dict[str, Any]:
        return self.http.parameters

    async def open(self) -> None:
        await asyncio.to_thread(self.server.start)
        try:
            await self.http.open()
        except BaseException:
            await asyncio.to_thread(self.server.stop)
            raise

    def encode(self, items: Sequence[Item]) -> bytes:
        return self.http.encode(items)

    async def send(self, payload: bytes) -> None:
        await self.http.send(payload)

    async def counters(self) -> Counters:
        counters = await self.http.counters()
        return dataclasses.replace(counters, server_cpu_s=self.server.usage().cpu_s)

    def describe(self) -> dict[str, Any]:
        return {
            **self.http.describe(),
            "kind": self.kind,
            "server_command": self.server.command[1:],
        }

    async def aclose(self) -> None:
        try:
            await self.http.aclose()
        finally:
            await asyncio.to_thread(self.server.stop)
