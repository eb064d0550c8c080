"""A server that cannot start says why in one line on stderr and exits
non-zero, with no traceback and no process left behind: invalid settings, a
port in use, a missing, unreadable or empty model repository. The real CLI,
in a subprocess of its own session (so a worker it started is found even
once re-parented)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import ServerProcess
from tests.helpers import ECHO, POISON_MODEL, write_toy_model


@dataclass
class Exited:
    returncode: int
    stderr: str
    leftovers: list[str]  # command lines of the session's processes still alive


def serve(*args: str, env: dict[str, str] | None = None) -> Exited:
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorserve", "serve", "--host", "127.0.0.1", *args],
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        text=True,
    )
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    leftovers = []
    for other in psutil.process_iter():
        try:
            if os.getsid(other.pid) == process.pid and other.status() != psutil.STATUS_ZOMBIE:
                leftovers.append(" ".join(other.cmdline()))
                other.kill()
        except (OSError, psutil.Error):
            pass
    return Exited(process.returncode, stderr, leftovers)


def assert_one_line(exited: Exited, status: int, message: str) -> None:
    assert exited.returncode == status, exited.stderr
    assert exited.stderr.count("\n") == 1 and "Traceback" not in exited.stderr, exited.stderr
    assert exited.stderr == message + "\n"
    assert exited.leftovers == []


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A repository with one model in worker-process isolation: a start that
    loads it before failing would leave a worker process behind."""
    write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO, isolation="process")
    return tmp_path


def test_an_out_of_range_port_flag(repository: Path) -> None:
    assert_one_line(
        serve("--port", "99999", "--model-repository", str(repository)),
        2,
        "tensorserve serve: error: --port / TENSORSERVE_PORT: Input should be less than or "
        "equal to 65535 (see tensorserve serve --help)",
    )


def test_a_port_variable_that_is_not_a_number(repository: Path) -> None:
    assert_one_line(
        serve("--model-repository", str(repository), env={"TENSORSERVE_PORT": "abc"}),
        2,
        "tensorserve serve: error: --port / TENSORSERVE_PORT: Input should be a valid integer, "
        "unable to parse string as an integer (see tensorserve serve --help)",
    )


def test_a_flag_of_the_wrong_type(repository: Path) -> None:
    assert_one_line(
        serve("--drain-delay-s", "soon", "--model-repository", str(repository)),
        2,
        "tensorserve serve: error: argument --drain-delay-s: invalid float value: 'soon' "
        "(see tensorserve serve --help)",
    )


def test_a_port_in_use_starts_no_model_and_no_worker(repository: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exited = serve("--port", str(port), "--model-repository", str(repository))
    assert_one_line(
        exited,
        1,
        f"tensorserve serve: error: cannot listen on 127.0.0.1:{port}: the port is already in use",
    )


def test_a_missing_repository(tmp_path: Path) -> None:
    missing = tmp_path / "modle_repository"
    assert_one_line(
        serve("--port", "0", "--model-repository", str(missing)),
        1,
        f"tensorserve serve: error: model repository {str(missing)!r} does not exist",
    )


def test_a_repository_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "models.tar"
    file.write_bytes(b"not a folder")
    assert_one_line(
        serve("--port", "0", "--model-repository", str(file)),
        1,
        f"tensorserve serve: error: model repository {str(file)!r} is not a directory",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every folder")
def test_an_unreadable_repository(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        exited = serve("--port", "0", "--model-repository", str(locked))
    finally:
        locked.chmod(0o755)
    assert_one_line(
        exited,
        1,
        f"tensorserve serve: error: model repository {str(locked)!r} cannot be read: "
        f"Permission denied",
    )


def test_an_empty_repository_is_an_error_unless_allowed(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()  # a folder without config.toml is not a model
    assert_one_line(
        serve("--port", "0", "--model-repository", str(tmp_path)),
        1,
        f"tensorserve serve: error: model repository {str(tmp_path)!r} holds no model (a "
        f"folder with a config.toml); pass --allow-empty-repository to start without one and "
        f"load models later through the repository API (--model-control-mode explicit) or from "
        f"the repository's files (--model-control-mode poll)",
    )
    server = ServerProcess(tmp_path, "--allow-empty-repository", "--model-control-mode", "explicit")
    try:
        assert httpx.get(f"{server.url}/v2/models").json() == {"models": []}
        # Filled at run time, then loaded through the repository API.
        write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO)
        loaded = httpx.post(f"{server.url}/v2/repository/models/echo/load", timeout=60)
        assert loaded.status_code == 200, loaded.text
        assert httpx.get(f"{server.url}/v2/models/echo/ready").status_code == 200
    finally:
        assert server.stop().returncode == 0
