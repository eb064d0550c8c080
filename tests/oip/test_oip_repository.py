"""tritonclient against a server of its own, on a temporary repository (so the
shared server is never disturbed): padding across OIP requests, output
subsets, an unbatched model, the repository extension (index, load, reload,
unload with requests in flight) and the request-size bounds."""

from __future__ import annotations

import gzip
import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.conftest import REPOSITORY, ServerProcess
from tests.helpers import wait_until, write_toy_model

rng = np.random.default_rng(11)

TWOHEAD: dict[str, Any] = {
    "max_batch_size": 8,
    "inputs": {"x": {"dtype": "float32", "shape": [-1]}},
    "outputs": {
        "doubled": {"dtype": "float32", "shape": [-1]},
        "total": {"dtype": "float32", "shape": [1]},
    },
}
TWOHEAD_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return {{"doubled": x * {factor}, "total": x.sum(dim=1, keepdim=True)}}
"""
# max_batch_size 0: no batch dimension on the wire (Triton's rule: only 0;
# 1 has one, tests/oip/test_oip_codec.py).
SLOW: dict[str, Any] = {
    "max_batch_size": 0,
    "inputs": {"x": {"dtype": "float32", "shape": [-1]}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1]}},
}
# 100 ms a forward, on purpose: unloading must wait for requests still running.
SLOW_MODEL = """
    import time
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.1)
            return x + 1
"""
BROKEN_MODEL = """
    import torch
    raise ImportError("this model is broken on purpose")
"""
LIMIT = 1 << 20  # --max-request-bytes


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repository")
    shutil.copytree(REPOSITORY / "tagger", repo / "tagger")
    config = repo / "tagger" / "config.toml"
    shipped = config.read_text()
    assert "max_queue_delay_ms = 5.0" in shipped  # else the edit below would do nothing
    # Hold every item up to 1 s so concurrent requests share one padded batch
    # (300 ms was not always enough on a loaded 2-core machine), in arrival
    # order: the length-aware policy may rightly keep a 3-token row apart from
    # a 64-token one (its learnt cost says whether that pays).
    config.write_text(
        shipped.replace("max_queue_delay_ms = 5.0",
                        'max_queue_delay_ms = 1000.0\ndispatch = "timer"\npolicy = "fifo"')
    )
    write_toy_model(repo, "twohead", TWOHEAD_MODEL.format(factor=2), **TWOHEAD)
    write_toy_model(repo, "slow", SLOW_MODEL, **SLOW)
    return repo


@pytest.fixture(scope="module")
def own_server(repo: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        repo, "--max-request-bytes", str(LIMIT), "--model-control-mode", "explicit"
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(own_server: ServerProcess) -> Iterator[triton_http.InferenceServerClient]:
    client = triton_http.InferenceServerClient(
        own_server.url.removeprefix("http://"), concurrency=8
    )
    yield client
    client.close()


def floats(name: str, array: np.ndarray, binary: bool = True) -> triton_http.InferInput:
    return triton_http.InferInput(name, list(array.shape), "FP32").set_data_from_numpy(
        array, binary
    )


def token_inputs(ids: np.ndarray) -> list[triton_http.InferInput]:
    return [
        triton_http.InferInput(name, list(ids.shape), "INT64").set_data_from_numpy(array)
        for name, array in (("input_ids", ids), ("attention_mask", np.ones_like(ids)))
    ]


def stats(url: str, model: str) -> dict:
    with urllib.request.urlopen(f"{url}/v2/models/{model}/stats") as response:
        return json.loads(response.read())


# ---------------------------------------------------------------------- padding
def test_requests_of_different_lengths_are_padded_together(
    client: triton_http.InferenceServerClient, own_server: ServerProcess, server_url: str
) -> None:
    shapes = [(3, 7), (1, 40), (2, 19), (4, 3), (1, 64)]
    batches = [rng.integers(1, 4096, size=shape, dtype=np.int64) for shape in shapes]
    pending = [client.async_infer("tagger", token_inputs(ids)) for ids in batches]
    results = [p.get_result(timeout=30).as_numpy("logits") for p in pending]
    batching = stats(own_server.url, "tagger")["batching"]
    # 11 rows of 5 lengths in fewer batches than requests: rows were padded together
    assert batching["total_items"] == 11
    assert batching["total_batches"] < len(shapes)
    assert batching["padding_efficiency"] < 1
    reference = triton_http.InferenceServerClient(server_url.removeprefix("http://"))
    try:
        for ids, logits in zip(batches, results):
            assert logits.shape == (*ids.shape, 9)
            for row, got in zip(ids, logits):
                alone = reference.infer("tagger", token_inputs(row[None])).as_numpy("logits")[0]
                np.testing.assert_allclose(got, alone, rtol=1e-4, atol=1e-4)
    finally:
        reference.close()


# ---------------------------------------------------------------------- outputs
def test_requested_output_subsets(client: triton_http.InferenceServerClient) -> None:
    x = rng.standard_normal((3, 5)).astype(np.float32)
    both = client.infer("twohead", [floats("x", x)])
    assert [o["name"] for o in both.get_response()["outputs"]] == ["doubled", "total"]
    np.testing.assert_allclose(both.as_numpy("doubled"), x * 2, rtol=1e-6)
    np.testing.assert_allclose(both.as_numpy("total"), x.sum(axis=1, keepdims=True), rtol=1e-5)

    only = client.infer(
        "twohead", [floats("x", x)], outputs=[triton_http.InferRequestedOutput("total")]
    )
    assert [o["name"] for o in only.get_response()["outputs"]] == ["total"]
    assert only.as_numpy("doubled") is None
    np.testing.assert_allclose(only.as_numpy("total"), x.sum(axis=1, keepdims=True), rtol=1e-5)

    mixed = client.infer(
        "twohead",
        [floats("x", x, binary=False)],
        outputs=[
            triton_http.InferRequestedOutput("total", binary_data=False),
            triton_http.InferRequestedOutput("doubled", binary_data=True),
        ],
    )
    outputs = mixed.get_response()["outputs"]
    assert [o["name"] for o in outputs] == ["total", "doubled"]
    assert "data" in outputs[0] and outputs[1]["parameters"]["binary_data_size"] == x.nbytes
    np.testing.assert_allclose(mixed.as_numpy("doubled"), x * 2, rtol=1e-6)


def test_an_unbatched_model_has_no_batch_dimension(
    client: triton_http.InferenceServerClient,
) -> None:
    metadata = client.get_model_metadata("slow")
    assert metadata["inputs"][0]["shape"] == [-1]
    assert client.get_model_config("slow")["max_batch_size"] == 0
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(client.infer("slow", [floats("x", x)]).as_numpy("y"), x + 1)


# ---------------------------------------------------------------------- repository
def test_index_load_reload_and_failed_reload(
    client: triton_http.InferenceServerClient, repo: Path
) -> None:
    assert {m["name"]: m["state"] for m in client.get_model_repository_index()} == {
        "slow": "READY",
        "tagger": "READY",
        "twohead": "READY",
    }
    x = np.ones((1, 2), np.float32)
    write_toy_model(repo, "twohead", TWOHEAD_MODEL.format(factor=3), version=2, **TWOHEAD)
    client.load_model("twohead")  # a reload: the highest version is served
    result = client.infer("twohead", [floats("x", x)])
    assert result.get_response()["model_version"] == "2"
    np.testing.assert_array_equal(result.as_numpy("doubled"), x * 3)

    write_toy_model(repo, "twohead", BROKEN_MODEL, version=3, **TWOHEAD)
    with pytest.raises(InferenceServerException) as error:
        client.load_model("twohead")
    assert error.value.status() == "400"
    assert "failed to reload model 'twohead'; still serving version 2" in error.value.message()
    assert client.infer("twohead", [floats("x", x)]).get_response()["model_version"] == "2"
    shutil.rmtree(repo / "twohead" / "3")


def test_a_model_added_on_disk_is_listed_and_its_load_failure_explained(
    client: triton_http.InferenceServerClient, repo: Path
) -> None:
    write_toy_model(repo, "broken", BROKEN_MODEL, **SLOW)
    try:
        listed = {m["name"]: m for m in client.get_model_repository_index()}
        assert listed["broken"] == {
            "name": "broken",
            "state": "UNAVAILABLE",
            "reason": "not loaded",
        }
        with pytest.raises(InferenceServerException) as error:
            client.load_model("broken")
        assert error.value.status() == "400"
        assert "failed to load model 'broken'" in error.value.message()
        assert "this model is broken on purpose" in error.value.message()
        listed = {m["name"]: m for m in client.get_model_repository_index()}
        assert listed["broken"]["state"] == "UNAVAILABLE"
        assert "this model is broken on purpose" in listed["broken"]["reason"]
        with pytest.raises(InferenceServerException) as error:
            client.load_model("missing")
        assert error.value.status() == "404"
    finally:
        client.unload_model("broken")  # a failed model would keep the server not ready
        shutil.rmtree(repo / "broken")


def test_unload_lets_requests_in_flight_finish(
    client: triton_http.InferenceServerClient, own_server: ServerProcess
) -> None:
    before = stats(own_server.url, "slow")["batching"]["total_requests"]
    xs = [np.full(4, i, np.float32) for i in range(5)]
    pending = [client.async_infer("slow", [floats("x", x)]) for x in xs]
    wait_until(
        lambda: stats(own_server.url, "slow")["batching"]["total_requests"] >= before + 5,
        "the 5 requests did not reach the queue",
    )
    client.unload_model("slow")  # 5 x 100 ms still to run: returns once they have
    for x, request in zip(xs, pending):
        np.testing.assert_array_equal(request.get_result(timeout=10).as_numpy("y"), x + 1)

    assert not client.is_model_ready("slow")
    assert client.is_server_ready()  # an unloaded model does not make the server unready
    listed = {m["name"]: m for m in client.get_model_repository_index()}
    assert listed["slow"] == {
        "name": "slow",
        "version": "1",
        "state": "UNAVAILABLE",
        "reason": "unloaded",
    }
    with pytest.raises(InferenceServerException) as error:
        client.infer("slow", [floats("x", xs[0])])
    assert (
        error.value.status() == "503"
        and "model 'slow' is not ready (UNAVAILABLE)" in error.value.message()
    )

    client.load_model("slow")
    assert client.is_model_ready("slow")
    np.testing.assert_array_equal(
        client.infer("slow", [floats("x", xs[2])]).as_numpy("y"), xs[2] + 1
    )


def test_index_can_list_ready_models_only(own_server: ServerProcess) -> None:
    request = urllib.request.Request(
        f"{own_server.url}/v2/repository/index", data=b'{"ready": true}', method="POST"
    )
    with urllib.request.urlopen(request) as response:
        assert all(m["state"] == "READY" for m in json.loads(response.read()))


# ---------------------------------------------------------------------- size bounds
def raw_post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_compressed_body_is_bounded_by_max_request_bytes(own_server: ServerProcess) -> None:
    x = np.zeros((1, LIMIT // 4), np.float32)  # more than the limit once inflated
    request = {
        "inputs": [
            {
                "name": "x",
                "shape": list(x.shape),
                "datatype": "FP32",
                "parameters": {"binary_data_size": x.nbytes},
            }
        ]
    }
    header = json.dumps(request).encode()
    bomb = gzip.compress(header + x.tobytes())
    assert len(bomb) < LIMIT // 100
    status, error = raw_post(
        f"{own_server.url}/v2/models/twohead/infer",
        bomb,
        {"Content-Encoding": "gzip", "Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400
    assert error["error"] == (
        f"the gzip-compressed body decompresses to more than max_request_bytes ({LIMIT} bytes)"
    )


def test_a_body_over_max_request_bytes_is_413(own_server: ServerProcess) -> None:
    status, error = raw_post(f"{own_server.url}/v2/models/twohead/infer", bytes(LIMIT + 1), {})
    assert status == 413 and error["error"].startswith("request body too large")
