"""Shared fixtures: the bundled repository, a real server process on loopback,
and an in-process app for pytest-aiohttp's ``aiohttp_client``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tensorserve_bench.server import ServerProcess as BenchServerProcess

# Every server a test starts (docs' examples, start-up tests) takes any free
# gRPC port rather than 8001, which servers of other tests or engineers hold.
os.environ.setdefault("TENSORSERVE_GRPC_PORT", "0")

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"


class ServerProcess(BenchServerProcess):
    """``python -m tensorserve serve`` on a free loopback port, started (and
    ready) on construction; ``stop()`` ends it. ``log``: a file for its output."""

    def __init__(
        self,
        repository: Path = REPOSITORY,
        *args: str,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ):
        super().__init__(str(repository), args, env=env, log=log)
        self.start()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One real server process serving the bundled repository, for the session."""
    process = ServerProcess()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def server_url(server: ServerProcess) -> str:
    return server.url
