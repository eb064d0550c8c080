"""Fixtures for the client tests: a sync client on the real server, a second
real server whose repository holds a model that raises, and a scripted server."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from tensorserve_client import Client

from tests.client.helpers import (
    FAST,
    FAULTY,
    FAULTY_MODEL,
    FaultyServer,
    ScriptedServer,
)
from tests.conftest import ServerProcess
from tests.helpers import write_toy_model


@pytest.fixture
def client(server_url: str) -> Iterator[Client]:
    with Client(server_url, retries=FAST) as c:
        yield c


@pytest.fixture(scope="session")
def faulty_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultyServer]:
    """A real server on a temporary repository holding ``faulty`` (raises on
    negative input). ``pending`` is copied in after start-up, so the server
    lists it as UNAVAILABLE: a model that exists but is not ready."""
    repository = tmp_path_factory.mktemp("client-repository")
    write_toy_model(repository, "faulty", FAULTY_MODEL, **FAULTY)
    process = ServerProcess(repository)
    shutil.copytree(repository / "faulty", repository / "pending")
    yield FaultyServer(process.url, repository)
    process.stop()


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    yield server
    server.close()
