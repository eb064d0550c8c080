"""Shutdown the way Kubernetes needs it, on a real server process: on SIGTERM
readiness turns 503 at once while requests are still served for
``drain_delay_s``; then the listening socket closes and what is in flight
gets ``shutdown_grace_s`` to finish; what is left is answered 503 (never a
reset connection); worker processes stop; exit status 0. A second signal
exits at once with 128 + its number."""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import psutil
import pytest
from tensorserve_bench.server import ServerProcess as BenchServerProcess

from tests.conftest import ServerProcess
from tests.helpers import MSGPACK, SLEEPY_IO, SLEEPY_MODEL, body, wait_until, write_toy_model

SLEEPY: dict[str, Any] = {
    "max_batch_size": 1,  # one request at a time: queued work is the sum of the naps
    **SLEEPY_IO,
}
GRACE_OVER = (
    "the server is shutting down and its grace period ended before this request finished; "
    "send it to another replica"
)


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    write_toy_model(tmp_path / "repo", "sleepy", SLEEPY_MODEL, **SLEEPY)
    return tmp_path / "repo"


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as executor:
        yield executor


def infer(url: str, nap_ms: float) -> tuple[int, Any]:
    reply = httpx.post(
        f"{url}/v2/models/sleepy/infer",
        content=body([{"ms": [nap_ms]}]),
        headers=MSGPACK,
        timeout=60,
    )
    return reply.status_code, msgpack.unpackb(reply.content)


def requests_seen(url: str) -> int:
    stats = httpx.get(f"{url}/v2/models/sleepy/stats").json()
    return int(stats["batching"]["total_requests"])


def send(pool: ThreadPoolExecutor, url: str, naps: list[float]) -> list[Future[tuple[int, Any]]]:
    """Requests in flight: sent, and seen by the server's batcher."""
    before = requests_seen(url)
    sent = [pool.submit(infer, url, nap) for nap in naps]
    wait_until(lambda: requests_seen(url) >= before + len(naps), "the server got the requests")
    return sent


def status(url: str) -> int:
    return httpx.get(url).status_code


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def workers(server: BenchServerProcess) -> list[psutil.Process]:
    assert server.process is not None
    return [
        child
        for child in psutil.Process(server.process.pid).children()
        if "tensorserve.runtime.worker_main" in child.cmdline()
    ]


def exit_status(server: BenchServerProcess, within: float) -> int:
    assert server.process is not None
    try:
        return server.process.wait(within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs {within} s after the signal{server.log_tail()}")


def test_readiness_fails_at_once_while_requests_are_still_served(
    repository: Path, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    log = tmp_path / "server.log"
    server = BenchServerProcess(
        str(repository),
        ["--isolation", "process", "--drain-delay-s", "2", "--shutdown-grace-s", "30",
         "--log-level", "INFO"],
        log=log,
    ).start()  # fmt: skip
    try:
        in_flight = send(pool, server.url, [600, 600, 600])  # 1.8 s of queued work
        started = workers(server)  # the model's worker (and a standby, where kept)
        assert started

        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: status(f"{server.url}/v2/health/ready") == 503, "readiness 503")
        ready = httpx.get(f"{server.url}/v2/models/sleepy/ready")
        assert ready.status_code == 503
        assert ready.json()["reason"] == "the server is shutting down"
        # Still accepting and serving while load balancers catch up; each
        # reply closes its connection, so the client's next one goes elsewhere.
        late = httpx.post(
            f"{server.url}/v2/models/sleepy/infer",
            content=body([{"ms": [10]}]),
            headers=MSGPACK,
            timeout=60,
        )
        assert (late.status_code, late.headers["connection"]) == (200, "close")

        assert exit_status(server, within=30) == 0
        assert [future.result()[0] for future in in_flight] == [200, 200, 200]
        assert psutil.wait_procs(started, timeout=10)[1] == []  # the worker stopped too
        phases = [
            line.split("shutdown: ", 1)[1].split(" (", 1)[0].split(";", 1)[0]
            for line in log.read_text().splitlines()
            if "shutdown: " in line
        ]
        assert phases == [
            "SIGTERM received",
            "readiness answers 503",
            "no longer accepting",
            "every request answered",
            "done",
        ]
    finally:
        server.stop()


def test_what_the_grace_period_cannot_finish_is_answered_503(
    repository: Path, pool: ThreadPoolExecutor
) -> None:
    server = ServerProcess(repository, "--drain-delay-s", "0", "--shutdown-grace-s", "0.5")
    try:
        in_flight = send(pool, server.url, [1500, 1500, 1500])  # one running, two queued
        server.process.send_signal(signal.SIGTERM)
        # No new connections once the drain delay is over, while the rest finishes.
        wait_until(lambda: refuses_connections(server.port), "the listening socket closed")
        assert server.process.poll() is None
        answers = [future.result() for future in in_flight]
        assert [(code, reply["code"], reply["error"]) for code, reply in answers] == [
            (503, "model_not_ready", GRACE_OVER)
        ] * 3
        assert exit_status(server, within=30) == 0
    finally:
        server.stop()


def test_a_second_signal_exits_at_once(repository: Path) -> None:
    server = ServerProcess(
        repository, "--isolation", "process", "--drain-delay-s", "60", "--shutdown-grace-s", "60"
    )
    try:
        started = workers(server)
        server.process.send_signal(signal.SIGINT)
        wait_until(lambda: status(f"{server.url}/v2/health/ready") == 503, "readiness 503")
        server.process.send_signal(signal.SIGINT)
        assert exit_status(server, within=5) == 128 + signal.SIGINT
        # Its worker sees its socket close and exits on its own.
        assert psutil.wait_procs(started, timeout=10)[1] == []
    finally:
        server.stop()
