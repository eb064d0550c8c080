"""Fault isolation and readiness against a real server process on loopback:
co-batched HTTP callers of a poisoned item or a worker-killing item get their
rows; readiness names the models that cannot serve, and why."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import numpy as np
import psutil
import pytest
from tensorserve_bench.server import ServerProcess as BareServer

from tests.conftest import ServerProcess
from tests.helpers import ECHO, MSGPACK, POISON_MODEL, body, from_wire, wait_until, write_toy_model
from tests.test_faults import CRASHY

pytestmark = pytest.mark.timeout(180)

# Everything sent at once forms one batch: the timer waits 300 ms for company.
TOGETHER = {**ECHO, "max_batch_size": 16,
            "dynamic_batching": {"max_queue_delay_ms": 300.0, "dispatch": "timer"}}


def _x(value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((3, 4), value, np.float32)}


def _infer(url: str, model: str, value: float) -> tuple[int, object]:
    reply = httpx.post(f"{url}/v2/models/{model}/infer", content=body([_x(value)]),
                       headers=MSGPACK, timeout=60)
    decoded = msgpack.unpackb(reply.content)
    if reply.status_code != 200:
        return reply.status_code, decoded["error"]
    return 200, from_wire(decoded["outputs"][0]["y"])[0, 0].item()


def _together(url: str, model: str, values: list[float]) -> list[tuple[int, object]]:
    with ThreadPoolExecutor(len(values)) as pool:
        return list(pool.map(lambda v: _infer(url, model, v), values))


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("faulty")
    write_toy_model(repo, "poison", POISON_MODEL, **TOGETHER)
    write_toy_model(repo, "crashy", CRASHY, **{**TOGETHER, "isolation": "process",
                                               "faults": {"watchdog_ms": 3000}})
    write_toy_model(repo, "spare", POISON_MODEL, **ECHO)
    server = ServerProcess(repo, "--model-control-mode", "explicit")  # unloads "spare"
    yield server
    server.stop()


@pytest.mark.parametrize(("model", "bad", "status", "message"), [
    ("poison", 13.0, 500, "model 'poison' failed: RuntimeError: poison value 13 in batch"),
    ("crashy", 7.0, 500, "model 'crashy': this item crashed the model's worker process"),
])
def test_co_batched_http_callers_of_a_bad_item_get_their_rows(
    faulty_server: ServerProcess, model: str, bad: float, status: int, message: str
) -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 9.0, 10.0, 11.0, 12.0, 14.0, bad]  # 7 kills
    results = _together(faulty_server.url, model, values)
    assert results[:-1] == [(200, 2 * v) for v in values[:-1]]
    code, error = results[-1]
    assert code == status and str(error).startswith(message)
    ready = httpx.get(f"{faulty_server.url}/v2/models/{model}/ready")
    assert ready.status_code == 200
    assert _infer(faulty_server.url, model, 3.0) == (200, 6.0)


def test_unloading_one_model_leaves_the_server_ready(faulty_server: ServerProcess) -> None:
    url = faulty_server.url
    assert httpx.post(f"{url}/v2/repository/models/spare/unload", timeout=60).status_code == 200
    assert httpx.get(f"{url}/v2/health/ready").json() == {"ready": True}
    assert httpx.get(f"{url}/v2/models/spare/ready").status_code == 503
    assert httpx.post(f"{url}/v2/repository/models/spare/load", timeout=60).status_code == 200


def _forked_workers(server: ServerProcess) -> list[psutil.Process]:
    """The workers the model's worker template forked (the server's grandchildren)."""
    return [worker for template in psutil.Process(server.process.pid).children()
            for worker in template.children()]


def _instance_worker(server: ServerProcess) -> psutil.Process:
    """The model's instance worker: the oldest (the standby starts once it is up)."""
    return min(_forked_workers(server), key=lambda p: p.create_time())


def test_a_frozen_worker_makes_the_server_not_ready_until_the_watchdog_replaces_it(
    faulty_server: ServerProcess,
) -> None:
    url = faulty_server.url
    wait_until(lambda: len(_forked_workers(faulty_server)) >= 2, "the standby worker started", 60)
    assert _infer(url, "crashy", 1.0) == (200, 2.0)
    frozen = _instance_worker(faulty_server)
    frozen.suspend()  # SIGSTOP
    try:
        answer: list[tuple[int, object]] = []
        caller = threading.Thread(target=lambda: answer.append(_infer(url, "crashy", 4.0)))
        caller.start()
        wait_until(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 503,
                   "readiness 503 while the worker is frozen", 10)
        reply = httpx.get(f"{url}/v2/health/ready").json()
        assert reply["ready"] is False
        assert "has been running one batch for" in reply["not_ready"]["crashy"]
        assert httpx.get(f"{url}/v2/models/crashy/ready").status_code == 503
        caller.join(60)
        assert answer == [(200, 8.0)]  # the watchdog killed it; the batch ran again
    finally:
        try:
            os.kill(frozen.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    wait_until(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 200,
               "ready again", 30)
    assert not frozen.is_running() or frozen.status() == psutil.STATUS_ZOMBIE


def test_a_model_that_failed_to_load_makes_the_server_not_ready_and_says_which(
    tmp_path: Path,
) -> None:
    write_toy_model(tmp_path, "good", POISON_MODEL, **ECHO)
    write_toy_model(tmp_path, "broken", "raise ImportError('no such helper')\n", **ECHO)
    # The server is never ready: wait for the good model instead.
    server = BareServer(str(tmp_path))
    server.ready_url = f"{server.url}/v2/models/good/ready"
    server.start()
    try:
        reply = httpx.get(f"{server.url}/v2/health/ready")
        assert reply.status_code == 503
        problems = reply.json()["not_ready"]
        assert list(problems) == ["broken"]
        assert problems["broken"].startswith("FAILED: ")
        assert "no such helper" in problems["broken"]
    finally:
        server.stop()
