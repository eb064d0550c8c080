"""Request and output parameters through the Python client, against the real
server with the bundled embedder (``normalize``, a declared bool; ``norm``,
the per-row output parameter its forward returns)."""

from __future__ import annotations

import json
import urllib.request

import msgpack
import numpy as np
import pytest
from tensorserve_client import (
    AsyncClient,
    Client,
    InferResult,
    InvalidInput,
    ProtocolError,
    _protocol,
)
from tensorserve_client._protocol import Response

from tests.client.helpers import FAST, outputs_body, tokens


def test_each_item_gets_its_own_output_parameters(client: Client) -> None:
    items = [tokens(n, seed=n) for n in (4, 9, 2)]
    raw = client.infer_batch("embedder", items, parameters={"normalize": False})
    unit = client.infer_batch("embedder", items)  # the declared default: true
    for r, u in zip(raw, unit):
        assert isinstance(r, InferResult) and isinstance(u, InferResult)
        norm = r.parameters["norm"]
        # Each item's own norm: its raw embedding's length, its unit one's scale.
        assert np.linalg.norm(r["embedding"]) == pytest.approx(norm, rel=1e-5)
        np.testing.assert_allclose(u["embedding"] * norm, r["embedding"], rtol=1e-4, atol=1e-5)
        assert u.parameters["norm"] == pytest.approx(norm, rel=1e-5)
    assert len({round(r.parameters["norm"], 4) for r in raw}) == 3  # not one value for all
    one = client.infer("embedder", items[0], parameters={"normalize": False})
    assert one.parameters["norm"] == pytest.approx(raw[0].parameters["norm"], rel=1e-5)
    assert client.infer("tagger", tokens(3)).parameters == {}  # a model that returns none


def test_a_bad_parameter_is_invalid_input_naming_it(client: Client) -> None:
    with pytest.raises(InvalidInput) as caught:
        client.infer("embedder", tokens(3), parameters={"normalize": 1})
    assert caught.value.status == 400
    assert str(caught.value.message) == "parameters.normalize must be a boolean, got 1"


async def test_the_async_client_gives_output_parameters_too(server_url: str) -> None:
    items = [tokens(5, seed=1), tokens(12, seed=2)]
    async with AsyncClient(server_url, retries=FAST) as client:
        rows = await client.infer_batch("embedder", items, parameters={"normalize": False})
        one = await client.infer("embedder", items[1], parameters={"normalize": False})
    norms = [np.linalg.norm(row["embedding"]) for row in rows]
    assert [row.parameters["norm"] for row in rows] == pytest.approx(norms, rel=1e-5)
    assert one.parameters["norm"] == pytest.approx(norms[1], rel=1e-5)


def test_oip_gives_one_value_per_row_in_the_response_parameters(server_url: str) -> None:
    ids = np.stack([tokens(6, seed=s)["input_ids"] for s in (1, 2)])
    request = {
        "inputs": [
            {"name": "input_ids", "shape": [2, 6], "datatype": "INT64", "data": ids.ravel().tolist()},
            {"name": "attention_mask", "shape": [2, 6], "datatype": "INT64", "data": [1] * 12},
        ],
        "parameters": {"normalize": False},
    }
    sent = urllib.request.Request(
        f"{server_url}/v2/models/embedder/infer", data=json.dumps(request).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(sent, timeout=30) as reply:
        answer = json.load(reply)
    embedding = np.array(answer["outputs"][0]["data"]).reshape(2, 64)
    assert answer["parameters"]["norm"] == pytest.approx(np.linalg.norm(embedding, axis=1), rel=1e-5)


def _answer(**extra: object) -> Response:
    message = msgpack.unpackb(outputs_body({"y": np.zeros(1, np.float32)},
                                           {"y": np.ones(1, np.float32)}))
    return Response(200, "application/msgpack", msgpack.packb({**message, **extra}))


def test_the_answers_parameters_are_read_item_by_item_or_refused() -> None:
    call = _protocol.infer("m", [{"x": [1.0]}, {"x": [2.0]}])
    rows = call.complete(_answer(parameters=[{"score": 0.5}, {"score": 0.25}]))
    assert [row.parameters for row in rows] == [{"score": 0.5}, {"score": 0.25}]
    assert [row.parameters for row in call.complete(_answer())] == [{}, {}]
    with pytest.raises(ProtocolError, match="sent 2 items but the answer's parameters are not 2 maps"):
        call.complete(_answer(parameters=[{"score": 0.5}]))
    with pytest.raises(ProtocolError, match="output 1: parameters must be a map"):
        call.complete(_answer(parameters=[{}, 3]))
