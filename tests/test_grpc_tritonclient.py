"""The real ``tritonclient.grpc`` (sync and aio) against a real server
process: health, metadata, config, statistics, the repository index,
inference with variable lengths from concurrent callers and several rows
per request, errors as gRPC statuses, and a gRPC caller and an HTTP caller
in the same batch.

The reference for every padded result is each row computed alone.
"""

from __future__ import annotations

import asyncio
import signal
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_grpc_aio
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess
from tests.helpers import ECHO, wait_until, write_toy_model

# A prefix sum along each item's length axis: a wrong pad value, a wrong row
# or a wrong slice all show in the result.
CUMSUM_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return x.cumsum(dim=1)
"""
CUMSUM = {**ECHO, "dynamic_batching": {"max_queue_delay_ms": 20.0}}

# Also says how many rows its batch had. A batch holding 7 creates the file
# GATE + ".entered", then waits until the file GATE exists, so the callers
# behind it queue up and form one batch.
GATED_MODEL = """
    import os, time
    import torch

    GATE = {gate!r}

    class Model(torch.nn.Module):
        def forward(self, x):
            if (x == 7).any():
                open(GATE + ".entered", "w").close()
                deadline = time.monotonic() + 30
                while not os.path.exists(GATE) and time.monotonic() < deadline:
                    time.sleep(0.01)
            n = torch.full((x.shape[0], 1), float(x.shape[0]))
            return {{"y": x * 2, "n": n}}
"""
GATED = {
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_ms": 1.0},
    "inputs": {"x": {"dtype": "float32", "shape": [-1, 4]}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1, 4]}, "n": {"dtype": "float32", "shape": [1]}},
}

rng = np.random.default_rng(7)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    repo = tmp_path_factory.mktemp("grpc_repo")
    gate = repo / "gate-open"
    write_toy_model(repo, "cumsum", CUMSUM_MODEL, **CUMSUM)
    write_toy_model(repo, "gated", GATED_MODEL.format(gate=str(gate)), **GATED)
    server = ServerProcess(repo)
    yield server, gate
    server.stop()


@pytest.fixture(scope="module")
def client(served: tuple[ServerProcess, Path]) -> Iterator[triton_grpc.InferenceServerClient]:
    client = triton_grpc.InferenceServerClient(served[0].grpc_address)
    yield client
    client.close()


def x_input(array: np.ndarray, module: Any = triton_grpc) -> Any:
    tensor = module.InferInput("x", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return tensor


def rows(k: int, length: int) -> np.ndarray:
    return rng.standard_normal((k, length, 4)).astype(np.float32)


# ---------------------------------------------------------------------- metadata
def test_health_metadata_config_and_index(client: triton_grpc.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("cumsum")
    metadata = client.get_server_metadata()
    assert metadata.name == "tensorserve" and "model_repository" in metadata.extensions
    model = client.get_model_metadata("cumsum", as_json=True)
    assert model["versions"] == ["1"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in model["inputs"]] == [
        ("x", "FP32", ["-1", "-1", "4"])
    ]
    config = client.get_model_config("cumsum", as_json=True)["config"]
    assert config["name"] == "cumsum" and config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_FP32" and config["input"][0]["dims"] == [
        "-1", "4"
    ]
    index = client.get_model_repository_index(as_json=True)["models"]
    assert sorted((m["name"], m["state"]) for m in index) == [
        ("cumsum", "READY"), ("gated", "READY")
    ]


def test_statistics_count_items(client: triton_grpc.InferenceServerClient) -> None:
    before = client.get_inference_statistics("cumsum", as_json=True)["model_stats"][0]
    client.infer("cumsum", [x_input(rows(3, 5))])
    after = client.get_inference_statistics("cumsum", as_json=True)["model_stats"][0]
    assert int(after.get("inference_count", 0)) == int(before.get("inference_count", 0)) + 3


# ---------------------------------------------------------------------- inference
def test_several_rows_per_request_match_each_row_alone(
    client: triton_grpc.InferenceServerClient,
) -> None:
    x = rows(4, 6)
    result = client.infer("cumsum", [x_input(x)], request_id="rows-4")
    assert result.get_response().id == "rows-4"
    np.testing.assert_allclose(result.as_numpy("y"), x.cumsum(axis=1), rtol=1e-5, atol=1e-5)


async def test_concurrent_variable_lengths_are_padded_and_unpadded_per_caller(
    served: tuple[ServerProcess, Path],
) -> None:
    """Concurrent aio callers of different lengths (and row counts) share
    batches; each gets exactly its own rows, at its own length."""
    client = triton_grpc_aio.InferenceServerClient(served[0].grpc_address)
    try:
        sent = [rows(1 + i % 3, 2 + 3 * i) for i in range(12)]
        results = await asyncio.gather(
            *(client.infer("cumsum", [x_input(x, triton_grpc_aio)]) for x in sent)
        )
        for x, result in zip(sent, results):
            y = result.as_numpy("y")
            assert y.shape == x.shape
            np.testing.assert_allclose(y, x.cumsum(axis=1), rtol=1e-5, atol=1e-5)
    finally:
        await client.close()


def test_typed_contents_as_well_as_raw_bytes(served: tuple[ServerProcess, Path]) -> None:
    """Inputs in ``contents.fp32_contents`` (not raw bytes) decode the same."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    x = rows(2, 3)
    request = service_pb2.ModelInferRequest(model_name="cumsum")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    with grpc.insecure_channel(served[0].grpc_address) as channel:
        reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    (output,) = reply.outputs
    y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(list(output.shape))
    np.testing.assert_allclose(y, x.cumsum(axis=1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- errors
def status_of(call: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value.status(), caught.value.message()


def test_errors_are_grpc_statuses(client: triton_grpc.InferenceServerClient) -> None:
    status, message = status_of(lambda: client.infer("nope", [x_input(rows(1, 2))]))
    assert status == "StatusCode.NOT_FOUND" and "nope" in message
    bad = triton_grpc.InferInput("x", [1, 2, 3], "FP32")  # the model's last axis is 4
    bad.set_data_from_numpy(np.zeros((1, 2, 3), np.float32))
    status, message = status_of(lambda: client.infer("cumsum", [bad]))
    assert status == "StatusCode.INVALID_ARGUMENT" and "axis 2 must be 4" in message
    wrong = triton_grpc.InferInput("x", [1, 2, 4], "INT32")
    wrong.set_data_from_numpy(np.zeros((1, 2, 4), np.int32))
    status, message = status_of(lambda: client.infer("cumsum", [wrong]))
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message == "input 'x': datatype INT32 does not match the model's FP32"
    status, _ = status_of(lambda: client.get_model_metadata("nope"))
    assert status == "StatusCode.NOT_FOUND"


def test_a_message_over_the_body_limit_is_resource_exhausted(
    tmp_path: Path,
) -> None:
    write_toy_model(tmp_path, "cumsum", CUMSUM_MODEL, **CUMSUM)
    server = ServerProcess(tmp_path, "--max-request-bytes", "4096")
    try:
        client = triton_grpc.InferenceServerClient(server.grpc_address)
        status, _ = status_of(lambda: client.infer("cumsum", [x_input(rows(1, 512))]))
        assert status == "StatusCode.RESOURCE_EXHAUSTED"
        assert client.infer("cumsum", [x_input(rows(1, 8))]).as_numpy("y").shape == (1, 8, 4)
        client.close()
    finally:
        server.stop()


def test_a_grpc_deadline_bounds_the_wait_and_the_item_leaves_the_queue(
    client: triton_grpc.InferenceServerClient, served: tuple[ServerProcess, Path]
) -> None:
    """A call whose gRPC deadline (0.3 s; the server's own timeout is an
    hour) passes while its item waits behind a held batch gets
    DEADLINE_EXCEEDED; the held call is answered when the gate opens."""
    server, gate = served
    assert not gate.exists() and not entered(gate).exists()
    held = triton_grpc.InferenceServerClient(server.grpc_address)
    results: list[Any] = []
    held.async_infer("gated", [x_input(np.full((1, 2, 4), 7, np.float32))],
                     callback=lambda result, error: results.append((result, error)))
    try:
        wait_until(entered(gate).exists, "the held batch in the model")
        status, _ = status_of(
            lambda: client.infer("gated", [x_input(rows(1, 2))], client_timeout=0.3)
        )
        assert status == "StatusCode.DEADLINE_EXCEEDED"
    finally:
        gate.touch()
        wait_until(lambda: bool(results), "the held call's answer", timeout=30)
        close_gate(gate)
        held.close()
    assert results[0][1] is None


# ---------------------------------------------------------------------- co-batching
def _stats(server: ServerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.url}/v2/models/gated/stats", timeout=10) as reply:
        return json.load(reply)["batching"]


def _queue_depth(server: ServerProcess) -> int:
    return int(_stats(server)["queue_depth"])


def entered(gate: Path) -> Path:
    return gate.with_name(gate.name + ".entered")


def close_gate(gate: Path) -> None:
    gate.unlink(missing_ok=True)
    entered(gate).unlink(missing_ok=True)


def test_a_grpc_caller_and_an_http_caller_share_one_batch(
    served: tuple[ServerProcess, Path],
) -> None:
    """Behind a held batch, one gRPC and one HTTP item queue up; when the
    gate opens they run as one batch of 2, and each caller gets its own row."""
    import tritonclient.http as triton_http

    server, gate = served
    assert not gate.exists() and not entered(gate).exists()
    grpc_client = triton_grpc.InferenceServerClient(server.grpc_address)
    http_client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    answers: dict[str, Any] = {}

    def keep(name: str) -> Any:
        return lambda result, error: answers.__setitem__(name, (result, error))

    try:
        grpc_client.async_infer("gated", [x_input(np.full((1, 3, 4), 7, np.float32))],
                                callback=keep("held"))
        wait_until(entered(gate).exists, "the held batch in the model")
        x_grpc, x_http = rows(1, 2), rows(1, 5)
        grpc_client.async_infer("gated", [x_input(x_grpc)], callback=keep("grpc"))
        tensor = triton_http.InferInput("x", list(x_http.shape), "FP32")
        tensor.set_data_from_numpy(x_http)
        pending = http_client.async_infer("gated", [tensor])
        # >= 2: an item whose deadline passed may still be counted until a batch forms.
        wait_until(lambda: _queue_depth(server) >= 2, "both callers queued")
        gate.touch()
        http_result = pending.get_result(timeout=30)
        wait_until(lambda: {"grpc", "held"} <= set(answers), "the gRPC answers", timeout=30)
    finally:
        gate.touch()
        grpc_client.close()
        http_client.close()
    grpc_result, error = answers["grpc"]
    assert error is None
    np.testing.assert_allclose(grpc_result.as_numpy("y"), x_grpc * 2)
    np.testing.assert_allclose(http_result.as_numpy("y"), x_http * 2)
    assert grpc_result.as_numpy("n").tolist() == [[2.0]]
    assert http_result.as_numpy("n").tolist() == [[2.0]]
    close_gate(gate)


# ---------------------------------------------------------------------- ids, metrics, drain
def test_request_ids_trailing_codes_and_metrics_by_protocol(
    served: tuple[ServerProcess, Path],
) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    server = served[0]
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(service_pb2.ModelInferRequest(model_name="nope"),
                            metadata=(("x-request-id", "trace-42"),))
        error = caught.value
        assert error.code() is grpc.StatusCode.NOT_FOUND
        assert dict(error.initial_metadata())["x-request-id"] == "trace-42"
        trailing = dict(error.trailing_metadata())
        assert trailing["tensorserve-code"] == "model_not_found"
        assert trailing["x-request-id"] == "trace-42"
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }

    def requests(**labels: str) -> float:
        return samples.get(("tensorserve_requests_total", frozenset(labels.items())), 0.0)

    assert requests(model="_unknown", version="", code="model_not_found", protocol="grpc") >= 1
    assert requests(model="cumsum", version="1", code="ok", protocol="grpc") >= 1


def test_sigterm_turns_grpc_readiness_off_then_stops(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "cumsum", CUMSUM_MODEL, **CUMSUM)
    server = ServerProcess(tmp_path, "--drain-delay-s", "3")
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        assert client.is_server_ready()
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: not client.is_server_ready(), "readiness off while draining")
        # Still serving while load balancers stop sending.
        assert client.infer("cumsum", [x_input(rows(1, 2))]).as_numpy("y").shape == (1, 2, 4)
        # Then it stops listening, and exits 0 on its own after the one signal.
        assert server.process.wait(timeout=60) == 0
    finally:
        client.close()
        server.stop()
