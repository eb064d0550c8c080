"""``tensorserve serve --frontends 2`` on real processes: a scheduler process
that owns the models and two front-end processes sharing its ports. Requests
from both front ends share batches, each caller gets its own row, a front
end that dies fails only its own callers and comes back, ``/metrics`` on
any front end shows the whole server, and deadlines, disconnects, request
parameters, output parameters, ensembles and gRPC work through them.
(Drain, model control and the scheduler process's death:
``tests/test_frontends_lifecycle.py``.)"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess
from tests.helpers import (
    ECHO,
    MSGPACK,
    POISON_MODEL,
    FileGate,
    body,
    from_wire,
    front_ends,
    toy_config,
    wait_until,
    write_toy_model,
)
from tests.test_ensemble import DOUBLE_PY, FLOATS, SHIFT_PY, TOY, _ensemble_toml, _step, _write
from tests.test_request_parameters import DECLARED, PARAMS_MODEL

# Room for every caller of a test in one batch behind the held one.
GATED = {**ECHO, "max_batch_size": 32, "dynamic_batching": {"max_queue_delay_ms": 1.0}}
PARAMS = {
    **{k: v for k, v in ECHO.items() if k in ("inputs", "outputs")},
    "max_batch_size": 8,
    "request_parameter": DECLARED,
}
# One row a batch: a bounded queue (2 behind the running one), and priority levels.
SMALL = {
    **ECHO,
    "max_batch_size": 1,
    "dynamic_batching": {"max_queue_delay_ms": 1.0, "max_queue_size": 2},
}
RANKED = {**ECHO, "max_batch_size": 1, "dynamic_batching": {"priority_levels": 2, "policy": "fifo"}}
CALLERS = 16  # on 16 connections, all on one front end once in 2**15 runs


def start(repo: Path, *args: str) -> ServerProcess:
    server = ServerProcess(
        repo, "--frontends", "2", "--log-format", "json", "--access-log", "--log-level", "INFO",
        *args,
        log=repo / "server.log",
    )  # fmt: skip
    # Both started: each front end listens before its first report (its CPU series).
    wait_until(lambda: len(front_ends(server)) == 2, "two front ends", timeout=60)
    wait_until(
        lambda: httpx.get(f"{server.url}/metrics").text.count('role="frontend"') >= 4,
        "both front ends reporting",
        timeout=60,
    )
    return server


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, FileGate]]:
    repo = tmp_path_factory.mktemp("frontends")
    gate = FileGate(repo)
    write_toy_model(repo, "gated", gate.model(), **GATED)
    write_toy_model(repo, "params", PARAMS_MODEL, **PARAMS)
    write_toy_model(repo, "small", gate.model(), **SMALL)
    write_toy_model(repo, "ranked", gate.model(), **RANKED)
    write_toy_model(repo, "poison", POISON_MODEL, **ECHO)
    _write(repo, "double", _toy_toml({"x": FLOATS}, {"y": FLOATS}), DOUBLE_PY)
    _write(repo, "shift", _toy_toml({"a": FLOATS, "b": FLOATS}, {"s": FLOATS}), SHIFT_PY)
    steps = [
        _step("double", {"x": "X"}, {"y": "D"}),
        _step("shift", {"a": "D", "b": "X"}, {"s": "OUT"}),
    ]
    _write(repo, "pair", _ensemble_toml(steps), None)
    server = start(repo)
    yield server, gate
    server.stop()


def _toy_toml(inputs: dict[str, Any], outputs: dict[str, Any]) -> str:
    return toy_config(inputs, outputs, **TOY)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(CALLERS + 2) as executor:
        yield executor


def x_of(value: float) -> np.ndarray:
    return np.full((2, 4), value, np.float32)


def infer(
    url: str, value: float, request_id: str = "", model: str = "gated", **parameters: Any
) -> tuple[int, Any]:
    """One request on a connection of its own (the kernel picks its front end)."""
    return send(url, value, request_id, model, **parameters)[:2]


def send(
    url: str, value: float, request_id: str = "", model: str = "gated", **parameters: Any
) -> tuple[int, Any, httpx.Headers]:
    headers = {**MSGPACK, "X-Request-ID": request_id} if request_id else MSGPACK
    extra = {"parameters": parameters} if parameters else {}
    reply = httpx.post(
        f"{url}/v2/models/{model}/infer",
        content=body([{"x": x_of(value)}], **extra),
        headers=headers,
        timeout=60,
    )
    return reply.status_code, msgpack.unpackb(reply.content), reply.headers


def stats(url: str, model: str = "gated") -> dict[str, Any]:
    batching: dict[str, Any] = httpx.get(f"{url}/v2/models/{model}/stats").json()["batching"]
    return batching


def queued(url: str, count: int) -> None:
    wait_until(lambda: stats(url)["queue_depth"] >= count, f"{count} items queued", timeout=30)


def served_by(log: Path, request_ids: set[str]) -> dict[str, str]:
    """request id -> the front end whose access log line answered it."""
    seen = {}
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("logger") == "tensorserve.access" and record["request_id"] in request_ids:
            seen[record["request_id"]] = record["process"]
    return seen


def hold(
    pool: ThreadPoolExecutor, url: str, gate: FileGate, model: str = "gated"
) -> Future[tuple[int, Any]]:
    gate.close()
    held = pool.submit(infer, url, 7.0, "", model)
    gate.wait_entered()
    return held


def test_callers_of_both_front_ends_share_one_batch_each_getting_its_own_row(
    served: tuple[ServerProcess, FileGate], pool: ThreadPoolExecutor
) -> None:
    server, gate = served
    held = hold(pool, server.url, gate)
    before = stats(server.url)
    values = [float(10 + i) for i in range(CALLERS)]
    ids = {f"share-{v:g}": v for v in values}
    calls = {rid: pool.submit(infer, server.url, v, rid) for rid, v in ids.items()}
    queued(server.url, CALLERS)
    gate.open()
    assert held.result(30)[0] == 200
    for rid, call in calls.items():
        status, reply = call.result(30)
        assert status == 200, reply
        assert from_wire(reply["outputs"][0]["y"]).tolist() == (x_of(ids[rid]) * 2).tolist()
    after = stats(server.url)
    # The held batch, then one batch of every caller: both front ends' items in it.
    assert after["total_batches"] - before["total_batches"] == 2
    wait_until(lambda: len(served_by(server.log, set(ids))) == CALLERS, "the access log lines")
    assert set(served_by(server.log, set(ids)).values()) == {"frontend 0", "frontend 1"}


def _samples(url: str) -> list[Any]:
    text = httpx.get(f"{url}/metrics").text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def test_metrics_on_any_front_end_show_the_whole_server(
    served: tuple[ServerProcess, FileGate], pool: ThreadPoolExecutor
) -> None:
    server, gate = served
    gate.open()
    assert all(
        c.result(30)[0] == 200 for c in [pool.submit(infer, server.url, 1.0) for _ in range(8)]
    )
    expected = stats(server.url)["total_requests"]

    def counted() -> float:
        return sum(
            s.value
            for s in _samples(server.url)
            if s.name == "tensorserve_requests_total" and s.labels["model"] == "gated"
            and s.labels["code"] == "ok"
        )  # fmt: skip

    # Each front end reports what it observed at least every 0.5 s.
    wait_until(lambda: counted() == expected, f"{expected} requests counted", timeout=10)
    assert server.process is not None
    pids = {str(p.pid) for p in front_ends(server)}

    def roles(name: str) -> set[tuple[str, str]]:
        return {(s.labels["role"], s.labels["pid"]) for s in _samples(server.url) if s.name == name}

    wanted = {("scheduler", str(server.process.pid))} | {("frontend", pid) for pid in pids}
    wait_until(lambda: roles("tensorserve_process_cpu_seconds_total") == wanted, "CPU by role")
    assert roles("tensorserve_event_loop_lag_seconds") == wanted


def test_a_front_end_that_dies_fails_only_its_callers_and_is_restarted(
    served: tuple[ServerProcess, FileGate], pool: ThreadPoolExecutor
) -> None:
    server, gate = served
    held = hold(pool, server.url, gate)
    ran_before = len(gate.seen_values())
    values = [float(100 + i) for i in range(CALLERS)]
    calls = [pool.submit(infer, server.url, v) for v in values]
    queued(server.url, CALLERS)
    victim = front_ends(server)[0]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    # Its callers' items leave the queue: the scheduler waits on nobody dead.
    wait_until(
        lambda: stats(server.url)["queue_depth"] < CALLERS, "its items withdrawn", timeout=30
    )
    gate.open()
    try:  # the held caller may have been the victim's
        assert held.result(30)[0] == 200
    except httpx.TransportError:
        pass
    answered, failed = [], []
    for value, call in zip(values, calls):
        try:
            status, reply = call.result(30)
        except httpx.TransportError:  # its connection closed: never a wrong row
            failed.append(value)
            continue
        assert status == 200, reply
        assert from_wire(reply["outputs"][0]["y"]).tolist() == (x_of(value) * 2).tolist()
        answered.append(value)
    assert answered and failed
    # The model ran the survivors' items only (and the held one).
    ran = gate.seen_values()[ran_before:]
    assert sorted(set(ran) - {7.0}) == sorted(answered)
    wait_until(
        lambda: (
            len(front_ends(server)) == 2 and victim.pid not in {p.pid for p in front_ends(server)}
        ),
        "the front end restarted",
        timeout=60,
    )
    wait_until(lambda: _ready(server.url), "ready again", timeout=30)
    assert all(
        c.result(30)[0] == 200 for c in [pool.submit(infer, server.url, 3.0) for _ in range(4)]
    )
    assert f"(pid {victim.pid}) exited with status -9; restarting it" in server.log.read_text()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready").status_code == 200
    except httpx.TransportError:
        return False


def test_a_deadline_and_a_caller_that_leaves_withdraw_their_items(
    served: tuple[ServerProcess, FileGate], pool: ThreadPoolExecutor
) -> None:
    server, gate = served
    held = hold(pool, server.url, gate)
    ran_before = len(gate.seen_values())
    status, reply = infer(server.url, 41.0, timeout_ms=200)
    assert status == 504 and reply["code"] == "deadline_exceeded"
    with pytest.raises(httpx.ReadTimeout):  # the caller leaves
        httpx.post(
            f"{server.url}/v2/models/gated/infer",
            content=body([{"x": x_of(42.0)}]), headers=MSGPACK, timeout=0.5,
        )  # fmt: skip
    wait_until(lambda: stats(server.url)["queue_depth"] == 0, "both items withdrawn", timeout=10)
    gate.open()
    assert held.result(30)[0] == 200
    assert infer(server.url, 43.0)[0] == 200
    assert {41.0, 42.0}.isdisjoint(gate.seen_values()[ran_before:])


def test_a_full_queue_is_503_with_retry_after_and_priority_orders_the_queue(
    served: tuple[ServerProcess, FileGate], pool: ThreadPoolExecutor
) -> None:
    server, gate = served
    held = hold(pool, server.url, gate, "small")
    queued_calls = [pool.submit(infer, server.url, 21.0 + i, "", "small") for i in range(2)]
    wait_until(lambda: stats(server.url, "small")["queue_depth"] == 2, "the queue full")
    status, reply, headers = send(server.url, 30.0, "", "small")
    assert (status, reply["code"]) == (503, "server_busy")
    assert 1 <= int(headers["Retry-After"]) <= 60
    gate.open()
    assert [c.result(30)[0] for c in (held, *queued_calls)] == [200] * 3
    # Priority: behind a held batch, a later level-1 item runs before earlier level-2 ones.
    held = hold(pool, server.url, gate, "ranked")
    ran_before = len(gate.seen_values())
    low = [pool.submit(infer, server.url, 51.0 + i, "", "ranked", priority=2) for i in range(2)]
    wait_until(lambda: stats(server.url, "ranked")["queue_depth"] == 2, "the low items queued")
    high = pool.submit(infer, server.url, 59.0, "", "ranked", priority=1)
    wait_until(lambda: stats(server.url, "ranked")["queue_depth"] == 3, "the high item queued")
    gate.open()
    assert [c.result(30)[0] for c in (held, *low, high)] == [200] * 4
    ran = gate.seen_values()[ran_before:]  # the held one wrote on entry, before
    assert ran[0] == 59.0 and sorted(ran[1:]) == [51.0, 52.0]


def test_request_and_output_parameters_travel_through_a_front_end(
    served: tuple[ServerProcess, FileGate],
) -> None:
    server, _ = served
    reply = httpx.post(
        f"{server.url}/v2/models/params/infer",
        content=body([{"x": x_of(1.0)}], parameters={"scale": 3.0, "tag": "ab", "loud": True}),
        headers=MSGPACK,
        timeout=30,
    )
    assert reply.status_code == 200, reply.content
    answer = msgpack.unpackb(reply.content)
    assert from_wire(answer["outputs"][0]["y"]).tolist() == (x_of(1.0) * 3).tolist()
    assert answer["parameters"][0]["tag"] == "AB" and answer["parameters"][0]["scale"] == 3.0
    refused = httpx.post(
        f"{server.url}/v2/models/params/infer",
        content=body([{"x": x_of(1.0)}], parameters={"scale": 3.0}),
        headers=MSGPACK,
        timeout=30,
    )
    assert refused.status_code == 400
    assert "tag" in msgpack.unpackb(refused.content)["error"]


def test_an_ensemble_runs_in_the_scheduler_process_through_either_protocol(
    served: tuple[ServerProcess, FileGate],
) -> None:
    server, _ = served
    request = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    reply = httpx.post(f"{server.url}/v2/models/pair/infer", json=request, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [3.5, 6.5, 9.5]
    client = grpcclient.InferenceServerClient(server.grpc_address)
    x = grpcclient.InferInput("X", [1, 3], "FP32")
    x.set_data_from_numpy(np.array([[1, 2, 3]], np.float32))
    result = client.infer("pair", [x])
    assert result.as_numpy("OUT").tolist() == [[3.5, 6.5, 9.5]]
    assert client.get_model_metadata("gated").name == "gated"
    assert client.is_server_ready()


def _log_records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def test_the_scheduler_process_logs_a_models_failure_with_its_callers_request_id(
    served: tuple[ServerProcess, FileGate],
) -> None:
    server, _ = served
    status, error, _ = send(server.url, 13.0, "poisoned-http", "poison")
    assert status == 500 and error["code"] == "model_failure", error
    client = grpcclient.InferenceServerClient(server.grpc_address)
    x = grpcclient.InferInput("x", [1, 1, 4], "FP32")
    x.set_data_from_numpy(np.full((1, 1, 4), 13.0, np.float32))
    with pytest.raises(grpcclient.InferenceServerException, match="poison value 13"):
        client.infer("poison", [x], headers={"x-request-id": "poisoned-grpc"})

    def failures() -> dict[str, dict[str, Any]]:
        return {
            record["request_id"]: record
            for record in _log_records(server.log)
            if record.get("process") == "scheduler" and record["level"] == "ERROR"
        }

    wait_until(
        lambda: {"poisoned-http", "poisoned-grpc"} <= set(failures()),
        "the scheduler process's lines of both failures",
    )
    for request_id in ("poisoned-http", "poisoned-grpc"):
        line = failures()[request_id]
        assert (
            "-> model_failure: model 'poison' failed: RuntimeError: poison value 13"
            in (line["message"])
        ), line
        assert "in forward" in line["exc"], line  # the model's own frames, which do not cross
    # The front end's line about the same call carries the same id.
    assert any(
        record["request_id"] == "poisoned-http"
        and record["level"] == "ERROR"
        and record["process"].startswith("frontend")
        and "-> 500 model_failure" in record["message"]
        for record in _log_records(server.log)
    )


def test_front_ends_serve_both_protocols_without_torch(
    served: tuple[ServerProcess, FileGate],
) -> None:
    server, _ = served
    for value in range(4):  # on connections of their own: most likely both front ends
        assert infer(server.url, float(value), model="poison")[0] == 200
        data = {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, 4], "data": [value] * 4}]
        }
        assert httpx.post(f"{server.url}/v2/models/poison/infer", json=data).status_code == 200
    x = grpcclient.InferInput("x", [1, 1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 1, 4), np.float32))
    assert grpcclient.InferenceServerClient(server.grpc_address).infer("poison", [x]).as_numpy(
        "y"
    ).tolist() == [[[2.0] * 4]]
    assert server.process is not None

    def torch_mapped(pid: int) -> bool:
        return any("libtorch" in m.path for m in psutil.Process(pid).memory_maps())

    # The scheduler process runs the models; a front end only decodes,
    # validates and encodes, with numpy (~250 MB of RSS less each).
    assert torch_mapped(server.process.pid)
    assert [torch_mapped(p.pid) for p in front_ends(server)] == [False, False]


def test_front_ends_log_which_process_they_are(served: tuple[ServerProcess, FileGate]) -> None:
    server, _ = served
    processes = {
        json.loads(line).get("process")
        for line in server.log.read_text().splitlines()
        if line.startswith("{")
    }
    assert {"scheduler", "frontend 0", "frontend 1"} <= processes
    assert os.environ.get("TENSORSERVE_FRONTEND_SETTINGS_JSON") is None
