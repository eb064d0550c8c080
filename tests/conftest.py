"""Shared fixtures: the bundled repository, a real server process on loopback,
and an in-process app for pytest-aiohttp's ``aiohttp_client``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server at {url} not ready after {timeout} s")


class ServerProcess:
    """``python -m tensorserve serve`` in a subprocess on a free loopback port."""

    def __init__(self, repository: Path = REPOSITORY, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "tensorserve", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--model-repository", str(repository), "--log-level", "WARNING", *args,
        ]
        self.process = subprocess.Popen(command, env={**os.environ, **(env or {})})
        try:
            wait_ready(self.url, self.process)
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One real server process serving the bundled repository, for the session."""
    process = ServerProcess()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def server_url(server: ServerProcess) -> str:
    return server.url
