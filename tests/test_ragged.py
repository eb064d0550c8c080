"""Ragged outputs (issue #39, item 2): an output declared ``ragged = true``
comes back from the model as a list of one tensor per row, each its own
length (what a tokenizer returns), and each caller gets its own row as it is,
beside the outputs that are un-padded as usual — in a model thread, in a
worker process, and over the native protocol and KServe JSON.

The toy model answers row i with ``ids`` = its first value v repeated v
times and ``words`` = the strings "0" .. "v-1": a length the test predicts
and that no input's length gives, so a row cut by an input's length, or
another caller's row, shows at once. A batch holding 99 returns one ``ids``
row too few.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from tensorserve import ModelFailure, ServedModel
from tensorserve.errors import ConfigError
from tensorserve.repository.config import parse_config
from tests.conftest import ServerProcess
from tests.helpers import MSGPACK, body, from_wire, write_toy_model

RAGGED_MODEL = """
    import numpy as np
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            firsts = [int(v) for v in x[:, 0].tolist()]
            ids = [torch.full((v,), v, dtype=torch.int64) for v in firsts]
            if 99 in firsts:
                ids = ids[:-1]
            words = [np.array([str(k).encode() for k in range(v)], dtype=object) for v in firsts]
            batch = torch.full((len(firsts), 1), len(firsts), dtype=torch.int64)
            return {"y": x * 2, "ids": ids, "words": words, "batch": batch}
"""
IO: dict[str, Any] = {
    "max_batch_size": 3,
    "warmup": {"enabled": False},
    "inputs": {"x": {"dtype": "int64", "shape": [-1]}},
    "outputs": {
        "y": {"dtype": "int64", "shape": [-1]},
        "ids": {"dtype": "int64", "shape": [-1], "ragged": True},
        "words": {"dtype": "bytes", "shape": [-1], "ragged": True},
        "batch": {"dtype": "int64", "shape": [1]},
    },
}
# Batches of exactly three items: the timer holds a batch until it is full.
FULL_BATCHES = {"dispatch": "timer", "max_queue_delay_ms": 30_000.0, "policy": "fifo"}
# (input length, first value): no caller's row length is its input's length.
CALLERS = [(2, 5), (6, 1), (3, 3)]


def _x(length: int, value: int) -> np.ndarray:
    return np.full(length, value, dtype=np.int64)


def _words(value: int) -> list[bytes]:
    return [str(k).encode() for k in range(value)]


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("output", "message"),
    [
        ({"shape": [4], "ragged": True}, "output 'ids': ragged = true needs a -1 axis"),
        (
            {"shape": [-1], "ragged": True, "unpad_like": "x"},
            "output 'ids': ragged = true takes each row as it is; drop unpad_like",
        ),
    ],
)
def test_a_ragged_output_that_cannot_be_is_refused_at_load(output: dict, message: str) -> None:
    data = {
        "input": [{"name": "x", "dtype": "int64", "shape": [-1]}],
        "output": [{"name": "ids", "dtype": "int64", **output}],
    }
    with pytest.raises(ConfigError, match=message):
        parse_config(data, "m/config.toml")


def test_a_ragged_output_needs_no_input_to_follow() -> None:
    # A tokenizer's input has no variable axis (one string); its ids do.
    config = parse_config(
        {
            "input": [{"name": "text", "dtype": "bytes", "shape": [1]}],
            "output": [{"name": "ids", "dtype": "int64", "shape": [-1], "ragged": True}],
        },
        "m/config.toml",
    )
    assert config.output[0].ragged and config.unpad_source(config.output[0]) is None


# ---------------------------------------------------------------------- through the batch
@pytest.fixture(scope="module", params=["thread", "process"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    repository = tmp_path_factory.mktemp(f"ragged-{request.param}")
    write_toy_model(repository, "ragged", RAGGED_MODEL, dynamic_batching=FULL_BATCHES, **IO)
    model = ServedModel.from_repository(
        repository, "ragged", isolation=request.param, faults={"standby_worker": False}
    )
    with model:
        yield model


def test_co_batched_callers_each_get_their_own_row_of_its_own_length(
    served: ServedModel,
) -> None:
    futures = [served.submit_many([{"x": _x(n, v)}])[0] for n, v in CALLERS]
    for future, (n, v) in zip(futures, CALLERS):
        row = future.result(60)
        assert int(row["batch"][0]) == 3  # one batch, all three
        np.testing.assert_array_equal(row["y"], _x(n, 2 * v))  # un-padded to its input
        np.testing.assert_array_equal(row["ids"], np.full(v, v, dtype=np.int64))
        assert row["ids"].dtype == np.int64
        assert list(row["words"]) == _words(v)


def test_a_wrong_row_count_fails_only_the_item_it_is_pinned_on(served: ServedModel) -> None:
    good = [served.submit_many([{"x": _x(3, v)}])[0] for v in (2, 4)]
    bad = served.submit_many([{"x": _x(2, 99)}])[0]
    with pytest.raises(ModelFailure, match="ragged output 'ids' must be a list of one tensor"):
        bad.result(60)
    # The batch was split: the others ran again without it and got their rows.
    for future, v in zip(good, (2, 4)):
        np.testing.assert_array_equal(future.result(60)["ids"], np.full(v, v))


def test_a_wrong_row_count_says_how_many_rows_came_back() -> None:
    model = ServedModel.from_function(
        lambda x: {"ids": [x[0, :1]]},
        inputs=[{"name": "x", "dtype": "int64", "shape": [-1]}],
        outputs=[{"name": "ids", "dtype": "int64", "shape": [-1], "ragged": True}],
        max_batch_size=2,
        dynamic_batching=FULL_BATCHES,
        faults={"split_failed_batches": False},
    )
    with model:
        futures = model.submit_many([{"x": _x(2, 1)}, {"x": _x(3, 1)}])
        for future in futures:
            with pytest.raises(ModelFailure) as caught:
                future.result(10)
            assert caught.value.message == (
                "ragged output 'ids' must be a list of one tensor per row; got 1 rows for a "
                "batch of 2"
            )


# ---------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def ragged_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repository = tmp_path_factory.mktemp("ragged-server")
    write_toy_model(
        repository, "ragged", RAGGED_MODEL, dynamic_batching={"max_queue_delay_ms": 2.0}, **IO
    )
    server = ServerProcess(repository)
    yield server
    server.stop()


def _post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_native_protocol_returns_each_items_row(ragged_server: ServerProcess) -> None:
    url = f"{ragged_server.url}/v2/models/ragged/infer"
    status, raw = _post(url, body([{"x": _x(n, v)} for n, v in CALLERS]), MSGPACK)
    assert status == 200, raw
    outputs = msgpack.unpackb(raw)["outputs"]
    for item, (n, v) in zip(outputs, CALLERS):
        np.testing.assert_array_equal(from_wire(item["y"]), _x(n, 2 * v))
        np.testing.assert_array_equal(from_wire(item["ids"]), np.full(v, v))
    status, raw = _post(url, body([{"x": _x(2, 99)}]), MSGPACK)
    reply = msgpack.unpackb(raw)
    assert (status, reply["code"]) == (500, "model_failure")
    assert "ragged output 'ids'" in reply["error"]


def test_kserve_json_returns_the_row(ragged_server: ServerProcess) -> None:
    request = {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1, 3], "data": [4] * 3}]}
    url = f"{ragged_server.url}/v2/models/ragged/infer"
    status, raw = _post(url, json.dumps(request).encode(), {"Content-Type": "application/json"})
    assert status == 200, raw
    outputs = {o["name"]: o for o in json.loads(raw)["outputs"]}
    assert (outputs["ids"]["shape"], outputs["ids"]["data"]) == ([1, 4], [4, 4, 4, 4])
    assert (outputs["y"]["shape"], outputs["y"]["data"]) == ([1, 3], [8, 8, 8])
    assert outputs["words"]["data"] == ["0", "1", "2", "3"]


def test_kserve_json_rows_of_one_request_with_different_lengths_are_a_400_saying_so(
    ragged_server: ServerProcess,
) -> None:
    # KServe answers a request's rows as one tensor, which ragged rows cannot
    # make: the caller sent a request only the native protocol can answer.
    data = [4, 4, 2, 2]
    request = {"inputs": [{"name": "x", "datatype": "INT64", "shape": [2, 2], "data": data}]}
    url = f"{ragged_server.url}/v2/models/ragged/infer"
    status, raw = _post(url, json.dumps(request).encode(), {"Content-Type": "application/json"})
    assert status == 400
    assert json.loads(raw)["error"] == (
        "output 'ids': the 2 rows of this request have different shapes [(2,), (4,)], which "
        "one KServe v2 tensor cannot hold; send one item per request, or use the native "
        "protocol, which answers each item with its own rows"
    )
