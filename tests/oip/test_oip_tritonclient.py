"""The real ``tritonclient[http]`` against a real server process (the bundled
repository): metadata, binary and JSON inference, several rows per request,
variable lengths across concurrent requests, errors, statistics.

The reference for every padded result is the same rows sent alone, one
request each, in sequence (so they run unpadded), or the native protocol.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import tritonclient.http as triton_http
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

from tests.helpers import MSGPACK, body, from_wire

rng = np.random.default_rng(4)
MODELS = [
    "attention_tagger", "embedder", "gru_tagger", "image_filter", "tagger",
    "text_embedder", "text_tagger", "tokenizer",
]


@pytest.fixture(scope="module")
def client(server_url: str) -> Iterator[triton_http.InferenceServerClient]:
    client = triton_http.InferenceServerClient(server_url.removeprefix("http://"), concurrency=8)
    yield client
    client.close()


def tokens(k: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(1, 4096, size=(k, t), dtype=np.int64)
    return ids, np.ones_like(ids)


def inputs(binary: bool = True, **arrays: np.ndarray) -> list[triton_http.InferInput]:
    made = []
    for name, array in arrays.items():
        datatype = {"int64": "INT64", "float32": "FP32", "int32": "INT32"}.get(
            array.dtype.name, "BYTES"
        )
        tensor = triton_http.InferInput(name, list(array.shape), datatype)
        made.append(tensor.set_data_from_numpy(array, binary_data=binary))
    return made


def tagger_rows_alone(
    client: triton_http.InferenceServerClient, ids: np.ndarray, model: str = "tagger"
) -> np.ndarray:
    """Each row in a request of its own, one after another: unpadded."""
    rows = [
        client.infer(
            model, inputs(input_ids=row[None], attention_mask=np.ones_like(row[None]))
        ).as_numpy("logits")[0]
        for row in ids
    ]
    return np.stack(rows)


# ---------------------------------------------------------------------- metadata
def test_health_and_server_metadata(client: triton_http.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "tensorserve" and metadata["version"]
    assert {"binary_tensor_data", "model_repository", "statistics", "model_configuration"} <= set(
        metadata["extensions"]
    )


def test_model_metadata_config_and_readiness(client: triton_http.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("tagger", model_version="1")
    assert metadata["versions"] == ["1"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        ("input_ids", "INT64", [-1, -1]),
        ("attention_mask", "INT64", [-1, -1]),
    ]
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["outputs"]] == [
        ("logits", "FP32", [-1, -1, 9])
    ]
    config = client.get_model_config("tagger")
    assert config["max_batch_size"] == 32
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("input_ids", "TYPE_INT64", [-1]),
        ("attention_mask", "TYPE_INT64", [-1]),
    ]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 5000
    assert client.is_model_ready("tagger") and client.is_model_ready("tagger", "1")
    assert not client.is_model_ready("tagger", "2") and not client.is_model_ready("nope")


# ---------------------------------------------------------------------- inference
def test_binary_rows_match_the_native_protocol_per_item(
    client: triton_http.InferenceServerClient, server_url: str
) -> None:
    ids, mask = tokens(4, 9)
    result = client.infer("tagger", inputs(input_ids=ids, attention_mask=mask), request_id="req-7")
    assert result.get_response()["id"] == "req-7"
    assert result.get_response()["model_version"] == "1"
    logits = result.as_numpy("logits")
    assert logits.shape == (4, 9, 9) and logits.dtype == np.float32
    items = [{"input_ids": row, "attention_mask": np.ones_like(row)} for row in ids]
    request = urllib.request.Request(
        f"{server_url}/v2/models/tagger/infer", data=body(items), headers=MSGPACK
    )
    native = msgpack.unpackb(urllib.request.urlopen(request).read())["outputs"]
    for row, output in zip(logits, native):
        np.testing.assert_allclose(row, from_wire(output["logits"]), rtol=1e-5, atol=1e-5)


def test_json_data_in_and_out_equals_binary(client: triton_http.InferenceServerClient) -> None:
    ids, mask = tokens(2, 6)
    binary = client.infer("tagger", inputs(input_ids=ids, attention_mask=mask)).as_numpy("logits")
    result = client.infer(
        "tagger",
        inputs(binary=False, input_ids=ids, attention_mask=mask),
        outputs=[triton_http.InferRequestedOutput("logits", binary_data=False)],
    )
    output = result.get_output("logits")
    assert "data" in output and "parameters" not in output  # really JSON
    assert output["shape"] == [2, 6, 9]
    np.testing.assert_allclose(result.as_numpy("logits"), binary, rtol=1e-5, atol=1e-5)


def test_several_rows_per_request(client: triton_http.InferenceServerClient) -> None:
    ids, mask = tokens(5, 11)
    embedding = client.infer("embedder", inputs(input_ids=ids, attention_mask=mask)).as_numpy(
        "embedding"
    )
    assert embedding.shape == (5, 64)
    for row, expected in zip(ids, embedding):
        alone = client.infer(
            "embedder", inputs(input_ids=row[None], attention_mask=np.ones((1, 11), np.int64))
        )
        np.testing.assert_allclose(alone.as_numpy("embedding")[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["tagger", "gru_tagger", "attention_tagger"])
def test_variable_lengths_across_concurrent_requests(
    client: triton_http.InferenceServerClient, model: str
) -> None:
    shapes = [(int(rng.integers(1, 5)), int(rng.integers(2, 80))) for _ in range(16)]
    batches = [tokens(k, t) for k, t in shapes]
    pending = [
        client.async_infer(model, inputs(input_ids=ids, attention_mask=mask), request_id=str(i))
        for i, (ids, mask) in enumerate(batches)
    ]
    results = [p.get_result(timeout=30) for p in pending]
    for i, ((k, t), (ids, _), result) in enumerate(zip(shapes, batches, results)):
        assert result.get_response()["id"] == str(i)
        logits = result.as_numpy("logits")
        assert logits.shape == (k, t, 9)  # its own length back, not the batch's
        np.testing.assert_allclose(
            logits, tagger_rows_alone(client, ids, model), rtol=1e-4, atol=1e-4
        )


def test_two_variable_axes_across_concurrent_requests(
    client: triton_http.InferenceServerClient,
) -> None:
    images = [
        rng.standard_normal((2, h, w)).astype(np.float32) for h, w in [(5, 9), (12, 3), (7, 7)]
    ]
    pending = [client.async_infer("image_filter", inputs(image=image)) for image in images]
    for image, request in zip(images, pending):
        filtered = request.get_result(timeout=30).as_numpy("filtered")
        assert filtered.shape == image.shape
        for row, expected in zip(image, filtered):
            alone = client.infer("image_filter", inputs(image=row[None])).as_numpy("filtered")[0]
            np.testing.assert_allclose(alone, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(client: triton_http.InferenceServerClient, algorithm: str) -> None:
    ids, mask = tokens(3, 20)
    plain = client.infer("tagger", inputs(input_ids=ids, attention_mask=mask)).as_numpy("logits")
    compressed = client.infer(
        "tagger",
        inputs(input_ids=ids, attention_mask=mask),
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,  # answered uncompressed; the client copes
    ).as_numpy("logits")
    np.testing.assert_allclose(compressed, plain, rtol=1e-5, atol=1e-5)


async def test_the_asyncio_client(server_url: str) -> None:
    async with triton_aio.InferenceServerClient(server_url.removeprefix("http://")) as client:
        assert await client.is_server_ready()
        batches = [tokens(2, t) for t in (4, 17, 33)]
        results = await asyncio.gather(
            *(client.infer("tagger", inputs(input_ids=ids, attention_mask=m)) for ids, m in batches)
        )
        assert [r.as_numpy("logits").shape for r in results] == [(2, 4, 9), (2, 17, 9), (2, 33, 9)]


# ---------------------------------------------------------------------- errors
def error_of(
    client: triton_http.InferenceServerClient, model: str, *args: Any, **kwargs: Any
) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as error:
        client.infer(model, *args, **kwargs)
    return error.value


@pytest.mark.parametrize(
    "arrays, status, message",
    [
        (
            {"input_ids": np.ones((1, 4), np.int32), "attention_mask": np.ones((1, 4), np.int64)},
            "400",
            "input 'input_ids': datatype INT32 does not match the model's INT64",
        ),
        (
            {
                "input_ids": np.array([[b"a", b"b"]], dtype=np.object_),
                "attention_mask": np.ones((1, 2), np.int64),
            },
            "400",
            "input 'input_ids': datatype BYTES does not match the model's INT64",
        ),
        (
            {
                "input_ids": np.ones((1, 600), np.int64),
                "attention_mask": np.ones((1, 600), np.int64),
            },
            "400",
            "input 'input_ids': shape [1, 600]: axis 1 has length 600; it must be between 1 and 512",
        ),
        (
            {"input_ids": np.ones((2, 4), np.int64), "attention_mask": np.ones((3, 4), np.int64)},
            "400",
            "inputs disagree on the batch dimension (first axis): 'input_ids': 2, 'attention_mask': 3",
        ),
        ({"input_ids": np.ones((1, 4), np.int64)}, "400", "missing input(s) 'attention_mask'"),
        (
            {"input_ids": np.ones(4, np.int64), "attention_mask": np.ones(4, np.int64)},
            "400",
            "input 'input_ids': shape [4] has 1 dimension(s); the model expects [-1, -1] (batch dimension first)",
        ),
    ],
)
def test_bad_requests_surface_the_servers_message(
    client: triton_http.InferenceServerClient,
    arrays: dict[str, np.ndarray],
    status: str,
    message: str,
) -> None:
    error = error_of(client, "tagger", inputs(**arrays))
    assert error.status() == status
    assert message in error.message()


def test_unknown_model_output_and_version(client: triton_http.InferenceServerClient) -> None:
    ids, mask = tokens(1, 3)
    error = error_of(client, "nope", inputs(input_ids=ids, attention_mask=mask))
    assert (error.status(), error.message()) == ("404", "unknown model 'nope'")
    error = error_of(
        client, "tagger", inputs(input_ids=ids, attention_mask=mask), model_version="3"
    )
    assert error.status() == "404" and "version '3' is not served" in error.message()
    error = error_of(
        client,
        "tagger",
        inputs(input_ids=ids, attention_mask=mask),
        outputs=[triton_http.InferRequestedOutput("probs")],
    )
    assert (
        error.status() == "400"
        and "unknown output 'probs'; the model produces 'logits'" in error.message()
    )


def test_timeout_is_microseconds(client: triton_http.InferenceServerClient) -> None:
    ids, mask = tokens(1, 3)
    error = error_of(client, "tagger", inputs(input_ids=ids, attention_mask=mask), timeout=1)
    assert error.status() == "504" and "tagger" in error.message()
    ok = client.infer(
        "tagger", inputs(input_ids=ids, attention_mask=mask), timeout=30_000_000, priority=1
    )
    assert ok.as_numpy("logits").shape == (1, 3, 9)


# ---------------------------------------------------------------------- raw HTTP
def post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_plain_json_with_nested_data(server_url: str) -> None:
    request = {
        "id": "nested",
        "inputs": [
            {
                "name": "input_ids",
                "shape": [2, 3],
                "datatype": "INT64",
                "data": [[5, 6, 7], [8, 9, 10]],
            },
            {
                "name": "attention_mask",
                "shape": [2, 3],
                "datatype": "INT64",
                "data": [1, 1, 1, 1, 1, 1],
            },
        ],
    }
    status, headers, answer = post(
        f"{server_url}/v2/models/embedder/infer",
        json.dumps(request).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200, answer
    assert headers["Content-Type"].startswith("application/json")
    assert "Inference-Header-Content-Length" not in headers
    reply = json.loads(answer)
    assert reply["id"] == "nested" and reply["model_name"] == "embedder"
    [output] = reply["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("embedding", "FP32", [2, 64])
    assert len(output["data"]) == 128


def test_the_native_protocol_keeps_its_route_and_takes_gzip_too(server_url: str) -> None:
    items = [{"input_ids": np.arange(1, 6, dtype=np.int64), "attention_mask": [1] * 5}]
    status, headers, answer = post(
        f"{server_url}/v2/models/tagger/infer",
        gzip.compress(body(items)),
        {**MSGPACK, "Content-Encoding": "gzip"},
    )
    assert status == 200 and headers["Content-Type"] == "application/msgpack"
    assert from_wire(msgpack.unpackb(answer)["outputs"][0]["logits"]).shape == (5, 9)


def test_errors_are_json_with_the_message(server_url: str) -> None:
    status, headers, answer = post(f"{server_url}/v2/models/tagger/infer", b"{not json", {})
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    error = json.loads(answer)
    assert error["error"].startswith("the inference request header is not valid JSON")
    assert error["code"] == "invalid_input"


# ---------------------------------------------------------------------- statistics
def test_statistics(client: triton_http.InferenceServerClient) -> None:
    ids, mask = tokens(3, 5)
    client.infer("tagger", inputs(input_ids=ids, attention_mask=mask))
    stats = client.get_inference_statistics("tagger")
    [stat] = stats["model_stats"]
    assert (stat["name"], stat["version"]) == ("tagger", "1")
    assert stat["inference_count"] >= 3 and stat["execution_count"] >= 1
    assert stat["inference_stats"]["compute_infer"]["ns"] > 0
    assert stat["batching"] == stats["batching"]  # tensorserve's own view is kept
    assert stats["batching"]["total_items"] >= 3
    every = client.get_inference_statistics()
    assert [s["name"] for s in every["model_stats"]] == MODELS


def test_repository_index(client: triton_http.InferenceServerClient) -> None:
    index = client.get_model_repository_index()
    assert index == [{"name": name, "version": "1", "state": "READY"} for name in MODELS]
