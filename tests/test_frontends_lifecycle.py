"""The life of a server with front-end processes: SIGTERM drains every front
end (readiness 503, what is in flight finishes, exit 0); a model loaded or
unloaded through one front end is seen by all; the scheduler process's
death ends every front end; a start that cannot succeed says why in one
line."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from tensorserve.frontends import supervisor
from tensorserve.settings import Settings
from tests.conftest import ServerProcess
from tests.helpers import ECHO, MSGPACK, FileGate, body, wait_until, write_toy_model
from tests.test_frontends import front_ends, hold, infer, queued, start, stats


@pytest.fixture
def gated(tmp_path: Path) -> tuple[Path, FileGate]:
    gate = FileGate(tmp_path)
    write_toy_model(tmp_path, "gated", gate.model(), **{**ECHO, "max_batch_size": 8})
    return tmp_path, gate


@contextlib.contextmanager
def serving(gated: tuple[Path, FileGate], *flags: str) -> Iterator[ServerProcess]:
    """A server of the gated model, its gate open, with two front ends; stopped
    on the way out."""
    repo, gate = gated
    gate.open()
    server = start(repo, *flags)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as executor:
        yield executor


def test_sigterm_drains_every_front_end_and_exits_0(
    gated: tuple[Path, FileGate], pool: ThreadPoolExecutor
) -> None:
    repo, gate = gated
    server = start(repo, "--drain-delay-s", "1")
    try:
        processes = front_ends(server)
        held = hold(pool, server.url, gate)
        calls = [pool.submit(infer, server.url, float(v)) for v in (11, 12, 13, 14)]
        queued(server.url, 4)
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        # Readiness says no on whichever front end answers (each gets the signal
        # from the scheduler process, a moment later).
        wait_until(lambda: httpx.get(f"{server.url}/v2/health/ready").status_code == 503,
                   "readiness 503")
        for _ in range(4):
            reply = httpx.get(f"{server.url}/v2/health/ready")
            assert reply.status_code == 503 and reply.json()["reason"] == "the server is shutting down"
        gate.open()
        assert held.result(30)[0] == 200
        assert [c.result(30)[0] for c in calls] == [200] * 4
        assert server.process.wait(60) == 0
        for process in processes:
            assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    finally:
        server.stop()


def test_a_model_unloaded_through_one_front_end_is_gone_from_all(
    gated: tuple[Path, FileGate],
) -> None:
    with serving(gated, "--model-control-mode", "explicit") as server:
        unloaded = httpx.post(f"{server.url}/v2/repository/models/gated/unload", json={})
        assert unloaded.status_code == 200, unloaded.text
        # Every front end was told before the answer came back: any connection sees it.
        for _ in range(6):
            assert httpx.get(f"{server.url}/v2/models/gated/ready").status_code == 503
            status, reply = infer(server.url, 1.0)
            assert (status, reply["code"]) == (503, "model_not_ready")
        loaded = httpx.post(f"{server.url}/v2/repository/models/gated/load", json={})
        assert loaded.status_code == 200, loaded.text
        for _ in range(6):
            assert infer(server.url, 1.0)[0] == 200


def test_a_model_reloaded_with_a_new_config_is_validated_by_it_in_every_front_end(
    gated: tuple[Path, FileGate],
) -> None:
    repo, gate = gated
    with serving(gated, "--model-control-mode", "explicit") as server:
        wide = {"dtype": "float32", "shape": [-1, 8]}
        write_toy_model(repo, "gated", gate.model(),
                        **{**ECHO, "max_batch_size": 8, "inputs": {"x": wide}, "outputs": {"y": wide}})
        assert httpx.post(f"{server.url}/v2/repository/models/gated/load", json={}).status_code == 200
        for _ in range(6):  # any connection, either front end: the new config, never the old
            reply = httpx.post(f"{server.url}/v2/models/gated/infer", headers=MSGPACK,
                               content=body([{"x": np.ones((2, 8), np.float32)}]), timeout=30)
            assert reply.status_code == 200, reply.content
            old = httpx.post(f"{server.url}/v2/models/gated/infer", headers=MSGPACK,
                             content=body([{"x": np.ones((2, 4), np.float32)}]), timeout=30)
            assert old.status_code == 400, old.content


def test_a_front_end_that_stops_answering_is_killed_and_restarted(
    gated: tuple[Path, FileGate],
) -> None:
    stuck = None
    with serving(gated) as server:
        try:
            # start() waited for both to report (one still starting gets longer to count as stuck).
            stuck = front_ends(server)[0]
            stuck.send_signal(signal.SIGSTOP)  # alive, its loop frozen: it reports nothing
            stuck.wait(30)  # killed by the scheduler process (psutil.TimeoutExpired if not)
            wait_until(lambda: len(front_ends(server)) == 2, "a new front end", timeout=60)
            assert server.log is not None
            assert f"(pid {stuck.pid}) has sent nothing for 5 s: killing it" in server.log.read_text()
            for _ in range(4):
                assert infer(server.url, 1.0)[0] == 200
        finally:
            if stuck is not None:
                with contextlib.suppress(psutil.NoSuchProcess):  # stopped, it would outlive the test
                    stuck.kill()


def test_the_scheduler_process_dying_ends_every_front_end(gated: tuple[Path, FileGate]) -> None:
    with serving(gated) as server:
        processes = front_ends(server)
        assert server.process is not None
        server.process.send_signal(signal.SIGKILL)
        for process in processes:
            process.wait(30)  # not our child: psutil.TimeoutExpired if it lives on
        assert server.log is not None
        gone = "the scheduler process has gone: this front end cannot serve, exiting"
        assert server.log.read_text().count(gone) == 2


def test_a_port_in_use_is_one_line_and_nothing_starts(gated: tuple[Path, FileGate]) -> None:
    repo, _ = gated
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tensorserve", "serve", "--frontends", "2",
             "--host", "127.0.0.1", "--port", str(port), "--model-repository", str(repo)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        taken.close()
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"tensorserve serve: error: cannot listen on 127.0.0.1:{port} for HTTP: "
        f"the port is already in use"
    )


def test_frontends_must_be_auto_or_a_count() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tensorserve", "serve", "--frontends", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--frontends / TENSORSERVE_FRONTENDS: Value error, must be auto or 1 to 64" in done.stderr


@pytest.mark.parametrize(("cpus", "count"), [(1, 1), (2, 1), (4, 3), (16, 8)])
def test_auto_is_the_cpus_less_one_from_1_to_8(
    monkeypatch: pytest.MonkeyPatch, cpus: int, count: int
) -> None:
    monkeypatch.setattr("tensorserve.host.available_cpus", lambda: cpus)
    assert supervisor.frontend_count(Settings(frontends="auto")) == count
    assert supervisor.frontend_count(Settings(frontends=3)) == 3


def test_one_front_end_is_the_one_process_server(gated: tuple[Path, FileGate]) -> None:
    repo, gate = gated
    gate.open()
    server = ServerProcess(repo, "--frontends", "1")
    try:
        assert front_ends(server) == []
        assert infer(server.url, 2.0)[0] == 200
        assert stats(server.url)["total_requests"] == 1
    finally:
        server.stop()
