"""``--serve``: run ``tensorserve serve`` in a subprocess on a free loopback
port for the length of one variant, so a single command measures the real
server (and can restart it with different flags per variant)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from tensorserve.bench.items import FeatureSpec, Item
from tensorserve.bench.targets import Counters, HttpTarget


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def override_flags(overrides: Mapping[str, Any]) -> list[str]:
    """``{"max_batch_size": 32}`` -> ``["--max-batch-size", "32"]`` (serve's flags)."""
    flags = []
    for key, value in overrides.items():
        flags += [
            f"--{key.replace('_', '-')}",
            str(value).lower() if isinstance(value, bool) else str(value),
        ]
    return flags


class ServerProcess:
    """A ``python -m tensorserve serve`` child; ``start`` waits until it is ready."""

    def __init__(
        self,
        repository: str,
        args: Sequence[str] = (),
        *,
        ready_timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable,
            "-m",
            "tensorserve",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model-repository",
            repository,
            "--log-level",
            "WARNING",
            *args,
        ]
        self.ready_timeout = ready_timeout
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        self.process = subprocess.Popen(self.command, env=self.env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with status {self.process.returncode}: {' '.join(self.command)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server at {self.url} not ready after {self.ready_timeout:.0f} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ServedHttpTarget:
    """An ``HttpTarget`` whose server this target starts on ``open`` and stops on ``aclose``."""

    kind = "http (--serve)"

    def __init__(
        self, repository: str, model: str, server_args: Sequence[str] = (), *, timeout: float = 60.0
    ):
        self.server = ServerProcess(repository, server_args)
        self.http = HttpTarget(self.server.url, model, timeout=timeout)
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
            self.server.stop()
            raise

    def encode(self, items: Sequence[Item]) -> bytes:
        return self.http.encode(items)

    async def send(self, payload: bytes) -> None:
        await self.http.send(payload)

    async def counters(self) -> Counters:
        return await self.http.counters()

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
