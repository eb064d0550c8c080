"""Packed batches (issue #54) through the batcher and a real server: each
caller gets its own rows in a model thread and a worker process, a bad item
fails alone (split and retried), a wrong total is a model_failure naming the
output, and every protocol (msgpack, KServe JSON and binary through
tritonclient, gRPC through tritonclient) and an ensemble answer each item.

The toy model gives each token ``1000 * token + its item's length``, the
length read from the batch input ``cu`` (so a wrong offset, or another
caller's row, shows at once), echoes the packed bytes input ``words``, gives
each item its element count (a fixed [1] output, by row) and a ragged row
of its first token. A batch holding 13 raises; one holding 99 returns one
``y`` row too few.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from tensorserve import ModelFailure, ServedModel
from tests.conftest import ServerProcess
from tests.helpers import MSGPACK, body, from_wire, write_toy_model

PACKED_MODEL = """
    import numpy as np
    import torch

    class Model(torch.nn.Module):
        def forward(self, x, words, cu, count):
            if (x == 13).any():
                raise RuntimeError("poison value 13 in batch")
            lengths = cu[1:] - cu[:-1]
            y = x * 1000 + lengths.repeat_interleave(lengths)
            if (x == 99).any():
                y = y[:-1]
            firsts = [x[start : start + 1] for start in cu[:-1].tolist()]
            return {"y": y, "w": words, "n": count[:, None], "first": firsts}
"""
IO: dict[str, Any] = {
    "max_batch_size": 3,
    "warmup": {"enabled": False},
    "inputs": {
        "x": {"dtype": "int64", "shape": [-1], "allow_ragged_batch": True},
        "words": {"dtype": "bytes", "shape": [-1], "allow_ragged_batch": True},
    },
    "outputs": {
        "y": {"dtype": "int64", "shape": [-1], "unpad_like": "x"},
        "w": {"dtype": "bytes", "shape": [-1]},
        "n": {"dtype": "int64", "shape": [1]},
        "first": {"dtype": "int64", "shape": [-1], "ragged": True},
    },
}
BATCH_INPUTS = """
[[batch_input]]
kind = "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO"
target_name = "cu"
data_type = "int64"
source_input = ["x"]

[[batch_input]]
kind = "BATCH_ELEMENT_COUNT"
target_name = "count"
data_type = "int64"
source_input = ["x"]

[[batch_output]]
kind = "BATCH_SCATTER_WITH_INPUT_SHAPE"
target_name = ["w"]
source_input = ["words"]
"""
ENSEMBLE = """
platform = "ensemble"
max_batch_size = 3

[[input]]
name = "X"
dtype = "int64"
shape = [-1]

[[input]]
name = "W"
dtype = "bytes"
shape = [-1]

[[output]]
name = "Y"
dtype = "int64"
shape = [-1]

[[ensemble_scheduling.step]]
model_name = "packed"
input_map = { x = "X", words = "W" }
output_map = { y = "Y" }
"""
# Batches of exactly three items: the timer holds a batch until it is full.
FULL_BATCHES = {"dispatch": "timer", "max_queue_delay_ms": 30_000.0, "policy": "fifo"}


def write_packed_model(repository: Path, **config: Any) -> None:
    folder = write_toy_model(repository, "packed", PACKED_MODEL, **{**IO, **config})
    with open(folder / "config.toml", "a") as f:
        f.write(BATCH_INPUTS)


def item(length: int, first: int = 1) -> dict[str, np.ndarray]:
    x = np.arange(first, first + length, dtype=np.int64)
    words = np.array([f"w{first}-{k}".encode() for k in range(length % 3 + 1)], dtype=object)
    return {"x": x, "words": words}


def check_row(row: dict[str, Any], sent: dict[str, np.ndarray]) -> None:
    x = sent["x"]
    np.testing.assert_array_equal(row["y"], x * 1000 + len(x))
    assert list(row["w"]) == list(sent["words"])
    assert row["n"].tolist() == [len(x)]
    assert row["first"].tolist() == [x[0]]


# ---------------------------------------------------------------------- through the batcher
@pytest.fixture(scope="module", params=["thread", "process"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    repository = tmp_path_factory.mktemp(f"packed-{request.param}")
    write_packed_model(repository, dynamic_batching=FULL_BATCHES)
    model = ServedModel.from_repository(
        repository, "packed", isolation=request.param, faults={"standby_worker": False}
    )
    with model:
        yield model


def test_co_batched_callers_each_get_their_own_rows(served: ServedModel) -> None:
    sent = [item(5, 1), item(2, 20), item(7, 40)]
    futures = [served.submit_many([one])[0] for one in sent]
    for future, one in zip(futures, sent):
        check_row(future.result(60), one)
    assert served.stats.snapshot(0)["padding_efficiency"] == 1.0


def test_a_poisoned_item_fails_alone_and_a_wrong_total_names_the_output(
    served: ServedModel,
) -> None:
    good = served.submit_many([item(3, 1)])[0]
    poisoned = served.submit_many([item(2, 12)])[0]  # holds 13
    short = served.submit_many([item(4, 97)])[0]  # holds 99: y one row short
    with pytest.raises(ModelFailure, match="poison value 13"):
        poisoned.result(60)
    with pytest.raises(ModelFailure) as caught:
        short.result(60)
    assert caught.value.message == (
        "output 'y' has shape [3]; packed like input 'x' it must be [4]: axis 0 the sum of "
        "the batch's 1 lengths"
    )
    check_row(good.result(60), item(3, 1))  # split from the others, it ran again


# ---------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repository = tmp_path_factory.mktemp("packed-server")
    write_packed_model(repository, isolation="process", dynamic_batching={"max_queue_delay_ms": 2.0})
    ensemble = repository / "twice" / "1"
    ensemble.mkdir(parents=True)
    (ensemble.parent / "config.toml").write_text(ENSEMBLE)
    process = ServerProcess(repository)
    yield process
    process.stop()


def _post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_msgpack_answers_each_item_its_rows_and_a_wrong_total_is_a_model_failure(
    server: ServerProcess,
) -> None:
    sent = [item(5, 1), item(1, 30), item(3, 50)]
    url = f"{server.url}/v2/models/packed/infer"
    status, raw = _post(url, _native(sent), MSGPACK)
    assert status == 200, raw
    for row, one in zip(msgpack.unpackb(raw)["outputs"], sent):
        check_row({name: _decoded(tensor) for name, tensor in row.items()}, one)
    status, raw = _post(url, _native([item(2, 98)]), MSGPACK)
    reply = msgpack.unpackb(raw)
    assert (status, reply["code"]) == (500, "model_failure")
    assert reply["error"].endswith("output 'y' has shape [1]; packed like input 'x' it must be "
                                   "[2]: axis 0 the sum of the batch's 1 lengths")  # fmt: skip


def _native(items: list[dict[str, np.ndarray]]) -> bytes:
    """A msgpack body; bytes go as a list of strings, as the native protocol takes them."""
    wire = [
        {**one, "words": {"dtype": "bytes", "shape": [len(one["words"])], "data": list(one["words"])}}
        for one in items
    ]
    return body(wire)


def _decoded(tensor: dict[str, Any]) -> np.ndarray:
    if tensor["dtype"] == "bytes":
        return np.array(tensor["data"], dtype=object)
    return from_wire(tensor)


def test_kserve_json_answers_the_item(server: ServerProcess) -> None:
    request = {
        "inputs": [
            {"name": "x", "datatype": "INT64", "shape": [1, 3], "data": [7, 8, 9]},
            {"name": "words", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "bc"]},
        ]
    }
    url = f"{server.url}/v2/models/packed/infer"
    status, raw = _post(url, json.dumps(request).encode(), {"Content-Type": "application/json"})
    assert status == 200, raw
    outputs = {o["name"]: o for o in json.loads(raw)["outputs"]}
    assert (outputs["y"]["shape"], outputs["y"]["data"]) == ([1, 3], [7003, 8003, 9003])
    assert (outputs["w"]["shape"], outputs["w"]["data"]) == ([1, 2], ["a", "bc"])
    assert outputs["n"]["data"] == [3]


def _inputs(module: Any, one: dict[str, np.ndarray], binary: bool | None = None) -> list[Any]:
    x = module.InferInput("x", [1, len(one["x"])], "INT64")
    words = module.InferInput("words", [1, len(one["words"])], "BYTES")
    for tensor, array in ((x, one["x"][None]), (words, one["words"][None])):
        if binary is None:
            tensor.set_data_from_numpy(array)
        else:
            tensor.set_data_from_numpy(array, binary_data=binary)
    return [x, words]


def test_tritonclient_http_binary_and_grpc_get_each_items_rows(server: ServerProcess) -> None:
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        for one in (item(4, 3), item(9, 60)):
            result = http.infer("packed", _inputs(triton_http, one, binary=True))
            np.testing.assert_array_equal(result.as_numpy("y")[0], one["x"] * 1000 + len(one["x"]))
            assert result.as_numpy("w")[0].tolist() == list(one["words"])
            answer = grpc.infer("packed", _inputs(triton_grpc, one))
            np.testing.assert_array_equal(answer.as_numpy("y")[0], one["x"] * 1000 + len(one["x"]))
            assert answer.as_numpy("first").tolist() == [[one["x"][0]]]
        config = grpc.get_model_config("packed").config  # in Triton's terms
        assert [t.allow_ragged_batch for t in config.input] == [True, True]
        cu = config.batch_input[0]
        assert (triton_grpc.model_config_pb2.BatchInput.Kind.Name(cu.kind), list(cu.target_name),
                triton_grpc.model_config_pb2.DataType.Name(cu.data_type), list(cu.source_input)) == (
            "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", ["cu"], "TYPE_INT64", ["x"])  # fmt: skip
        assert list(config.batch_output[0].target_name) == ["w"]
    finally:
        http.close()
        grpc.close()


def test_an_ensemble_step_on_a_packed_model_answers_each_item(server: ServerProcess) -> None:
    sent = [item(2, 5), item(6, 70)]
    wire = msgpack.unpackb(_native(sent))["items"]
    ensemble = msgpack.packb({"items": [{"X": one["x"], "W": one["words"]} for one in wire]})
    status, raw = _post(f"{server.url}/v2/models/twice/infer", ensemble, MSGPACK)
    assert status == 200, raw
    for row, one in zip(msgpack.unpackb(raw)["outputs"], sent):
        np.testing.assert_array_equal(from_wire(row["Y"]), one["x"] * 1000 + len(one["x"]))
