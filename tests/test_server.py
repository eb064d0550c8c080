"""The HTTP server end to end (pytest-aiohttp against the real app and the
bundled models): padded batches equal per-item runs, every caller gets its
own row, bad input gets its 4xx, failures stay within their batch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np
import pytest
import torch

from tensorserve.http.app import create_app
from tensorserve.repository.config import load_config
from tensorserve.repository.loader import discover, load_model
from tensorserve.settings import Settings
from tests.conftest import REPOSITORY
from tests.helpers import ECHO, MSGPACK, POISON_MODEL, body, from_wire, token_item, write_toy_model

rng = np.random.default_rng(1234)


@pytest.fixture
async def client(server_url: str) -> Any:
    """A session on the suite's real server process, which serves the bundled
    repository (loading it once, not once per test). Other tests use that
    server too, so counters are compared before and after (``batching``)."""
    async with aiohttp.ClientSession(base_url=server_url) as session:
        yield session


async def batching(client: Any, model: str) -> dict[str, Any]:
    return (await (await client.get(f"/v2/models/{model}/stats")).json())["batching"]


def reference(model: str, item: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model run on one item alone, unpadded."""
    source = discover(REPOSITORY)[model]
    loaded = load_model(source, None, load_config(source.path / "config.toml"))
    with torch.inference_mode():
        out = loaded.module(**{k: torch.from_numpy(v.copy())[None] for k, v in item.items()})
    outputs = out if isinstance(out, dict) else {loaded.config.output[0].name: out}
    return {k: v[0].numpy() for k, v in outputs.items()}


async def infer(client: Any, model: str, items: list[dict[str, Any]], **extra: Any) -> tuple[int, Any]:
    response = await client.post(f"/v2/models/{model}/infer", data=body(items, **extra), headers=MSGPACK)
    return response.status, msgpack.unpackb(await response.read())


async def test_concurrent_padded_callers_match_per_item_runs(client: Any) -> None:
    items = [token_item(int(n), rng) for n in rng.integers(1, 100, size=24)]
    before = await batching(client, "tagger")
    # A long request first holds the model, so the callers queue behind it and
    # share batches however slowly a busy machine sends them.
    holder = [token_item(120, rng) for _ in range(64)]
    replies = await asyncio.gather(infer(client, "tagger", holder),
                                   *(infer(client, "tagger", [item]) for item in items))
    assert replies.pop(0)[0] == 200
    for item, (status, reply) in zip(items, replies):
        assert status == 200, reply
        logits = from_wire(reply["outputs"][0]["logits"])
        assert logits.shape == (len(item["input_ids"]), 9)
        np.testing.assert_allclose(logits, reference("tagger", item)["logits"], atol=1e-4, rtol=1e-4)
    after = await batching(client, "tagger")
    assert after["total_items"] - before["total_items"] == 64 + 24
    # 64 long items take at least 2 batches of 32; alone, the 24 would take 24 more.
    assert after["total_batches"] - before["total_batches"] < 2 + 24  # callers shared batches


async def test_a_request_with_more_items_than_max_batch_size_comes_back_whole_in_order(client: Any) -> None:
    items = [token_item(int(n), rng) for n in rng.integers(1, 64, size=70)]  # max_batch_size 32
    before = await batching(client, "tagger")
    status, reply = await infer(client, "tagger", items, id="req-7")
    assert status == 200
    assert reply["id"] == "req-7" and reply["model_name"] == "tagger" and reply["model_version"] == "1"
    assert len(reply["outputs"]) == 70
    for item, output in zip(items[::10], reply["outputs"][::10]):
        np.testing.assert_allclose(
            from_wire(output["logits"]), reference("tagger", item)["logits"], atol=1e-4, rtol=1e-4
        )
    assert (await batching(client, "tagger"))["total_batches"] - before["total_batches"] >= 3


async def test_fixed_shape_outputs_are_returned_whole(client: Any) -> None:
    items = [token_item(n, rng) for n in (3, 40, 17)]
    status, reply = await infer(client, "embedder", items)
    assert status == 200
    for item, output in zip(items, reply["outputs"]):
        embedding = from_wire(output["embedding"])
        assert embedding.shape == (64,)
        np.testing.assert_allclose(embedding, reference("embedder", item)["embedding"], atol=1e-5)


async def test_two_variable_axes_round_trip(client: Any) -> None:
    images = [{"image": rng.normal(size=s).astype(np.float32)} for s in [(5, 9), (12, 3), (7, 7)]]
    replies = await asyncio.gather(*(infer(client, "image_filter", [image]) for image in images))
    for image, (status, reply) in zip(images, replies):
        assert status == 200
        filtered = from_wire(reply["outputs"][0]["filtered"])
        assert filtered.shape == image["image"].shape
        np.testing.assert_allclose(filtered, reference("image_filter", image)["filtered"], atol=1e-5)


async def test_plain_lists_are_cast_to_the_declared_dtype(client: Any) -> None:
    item = {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}
    status, reply = await infer(client, "tagger", [item])
    assert status == 200
    expected = reference("tagger", {k: np.array(v, np.int64) for k, v in item.items()})["logits"]
    np.testing.assert_allclose(from_wire(reply["outputs"][0]["logits"]), expected, atol=1e-4)


def good() -> dict[str, np.ndarray]:
    return token_item(5, rng)


BAD_REQUESTS = [
    ([good(), {"input_ids": np.ones(3, np.float32), "attention_mask": np.ones(3, np.int64)}],
     "item 1, feature 'input_ids': dtype float32 does not match the declared int64"),
    ([{"input_ids": np.ones(3, np.int64)}], "item 0: missing feature 'attention_mask'"),
    ([{**good(), "extra": [1]}], "item 0: unexpected feature(s) 'extra'"),
    ([{"input_ids": np.ones((2, 3), np.int64), "attention_mask": np.ones(3, np.int64)}],
     "item 0, feature 'input_ids': expected 1 dimension(s) with shape [-1], got shape [2, 3]"),
    ([{"input_ids": np.ones(600, np.int64), "attention_mask": np.ones(600, np.int64)}],
     "item 0, feature 'input_ids': axis 0 has length 600; it must be between 1 and 512"),
    ([{"input_ids": [[1, 2], [3]], "attention_mask": [1]}],
     "item 0, feature 'input_ids': the list is not a rectangular list of numbers"),
    ([{"input_ids": {"dtype": "int64", "shape": [4], "data": b"\0" * 8}, "attention_mask": [1]}],
     "item 0, feature 'input_ids': data holds 8 bytes, but shape [4] of int64 needs 32"),
    ([{"input_ids": {"dtype": "complex64", "shape": [1], "data": b"\0" * 8}, "attention_mask": [1]}],
     "item 0, feature 'input_ids': unknown dtype 'complex64'"),
    ([{"input_ids": "hello", "attention_mask": [1]}],
     "item 0, feature 'input_ids': expected a tensor map or a list of numbers, got str"),
]


@pytest.mark.parametrize("items, message", BAD_REQUESTS)
async def test_bad_items_get_a_400_naming_item_and_feature_and_the_server_keeps_serving(
    client: Any, items: list[dict[str, Any]], message: str
) -> None:
    status, reply = await infer(client, "tagger", items)
    assert status == 400
    assert reply["code"] == "invalid_input"
    assert reply["error"].startswith(message), reply["error"]
    status, reply = await infer(client, "tagger", [good()])
    assert status == 200 and len(reply["outputs"]) == 1


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1 not msgpack", "body is not valid msgpack"),
        (msgpack.packb([1, 2]), "body must be a msgpack map with an 'items' list"),
        (msgpack.packb({"items": []}), "'items' must be a non-empty list of feature maps"),
        (msgpack.packb({"items": [{}] * 5000}), "'items' holds 5000 items; the limit is 4096"),
        (msgpack.packb({"items": [{}], "parameters": {"timeout_ms": -1}}),
         "parameters.timeout_ms must be a positive number"),
    ],
)
async def test_malformed_bodies_get_a_400(client: Any, payload: bytes, message: str) -> None:
    response = await client.post("/v2/models/tagger/infer", data=payload, headers=MSGPACK)
    assert response.status == 400
    assert msgpack.unpackb(await response.read())["error"].startswith(message)


async def test_unknown_model_and_version_are_404(client: Any) -> None:
    status, reply = await infer(client, "nope", [good()])
    assert (status, reply["error"]) == (404, "unknown model 'nope'")
    response = await client.post("/v2/models/tagger/versions/7/infer", data=body([good()]), headers=MSGPACK)
    assert response.status == 404
    assert "version '7' is not served (serving version 1)" in msgpack.unpackb(await response.read())["error"]
    response = await client.post("/v2/models/tagger/versions/1/infer", data=body([good()]), headers=MSGPACK)
    assert response.status == 200


async def test_health_metadata_and_model_list(client: Any) -> None:
    assert (await client.get("/v2/health/live")).status == 200
    assert (await client.get("/v2/health/ready")).status == 200
    models = (await (await client.get("/v2/models")).json())["models"]
    assert {m["name"]: m["state"] for m in models} == {
        "attention_tagger": "READY", "embedder": "READY", "gru_tagger": "READY",
        "image_filter": "READY", "tagger": "READY", "text_embedder": "READY",
        "text_tagger": "READY", "tokenizer": "READY",
    }
    meta = await (await client.get("/v2/models/tagger")).json()
    assert meta["inputs"][0] == {
        "name": "input_ids", "datatype": "INT64", "shape": [-1, -1], "dtype": "int64", "pad_value": 0
    }
    assert meta["outputs"][0]["shape"] == [-1, -1, 9]
    config = await (await client.get("/v2/models/tagger/config")).json()
    assert config["max_batch_size"] == 32 and config["input"][1]["name"] == "attention_mask"
    ready = await client.get("/v2/models/tagger/ready")
    assert ready.status == 200 and (await ready.json())["ready"] is True
    metrics = await (await client.get("/metrics")).text()
    assert 'tensorserve_model_ready{model="tagger"} 1.0' in metrics


async def test_body_over_the_limit_gets_413(aiohttp_client: Any, tmp_path: Path) -> None:
    write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO)
    app = create_app(Settings(model_repository=tmp_path, max_request_bytes=2048), wait_for_models=True)
    client = await aiohttp_client(app)
    status, reply = await infer(client, "echo", [{"x": np.zeros((200, 4), np.float32)}])
    assert status == 413 and "too large" in reply["error"]


@pytest.fixture
async def toy_client(aiohttp_client: Any, tmp_path: Path) -> Any:
    """A repository with a poisonable model, a model that fails to import, one
    whose weights don't match and one without its weights."""
    write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO)
    write_toy_model(tmp_path, "broken", "import torch\nraise ImportError('no such thing')\n", **ECHO)
    folder = write_toy_model(tmp_path, "mismatch", """
        import torch
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(4, 4)
            def forward(self, x):
                return self.proj(x)
    """, **ECHO)
    from safetensors.torch import save_file
    save_file({"proj.weight": torch.zeros(4, 3), "other": torch.zeros(1)}, str(folder / "1" / "model.safetensors"))
    # The same module with no weights file at all: refused, never random weights.
    (folder.parent / "noweights").mkdir()
    for name in ("config.toml", "1/model.py"):
        (folder.parent / "noweights" / name).parent.mkdir(exist_ok=True)
        (folder.parent / "noweights" / name).write_text((folder / name).read_text())
    bad_dtype = {"x": {**ECHO["inputs"]["x"], "dtype": "float33"}}
    write_toy_model(tmp_path, "badconfig", POISON_MODEL, **{**ECHO, "inputs": bad_dtype})
    app = create_app(Settings(model_repository=tmp_path), wait_for_models=True)
    return await aiohttp_client(app)


async def test_a_broken_model_is_not_ready_with_its_reason_and_others_serve(toy_client: Any) -> None:
    reasons = {m["name"]: m.get("reason", "") for m in (await (await toy_client.get("/v2/models")).json())["models"]}
    assert "import failed: ImportError: no such thing" in reasons["broken"]
    assert "missing keys: proj.bias" in reasons["mismatch"]
    assert "unexpected keys: other" in reasons["mismatch"]
    assert "proj.weight: shape [4, 3] in file, [4, 4] in model" in reasons["mismatch"]
    assert reasons["noweights"].endswith(
        "noweights/1: the module has 2 parameters or buffers (proj.weight, proj.bias) but no "
        "model.safetensors to load them from; add the file, or set weights = 'init' in "
        "config.toml to serve the values Model(**parameters) gives them")
    assert reasons["badconfig"] == "badconfig/config.toml: input[0].dtype: unknown dtype 'float33'; " \
        "expected one of bool, uint8, uint16, uint32, uint64, int8, int16, int32, int64, float16, " \
        "float32, float64, bfloat16, bytes"
    ready = await toy_client.get("/v2/models/broken/ready")
    assert ready.status == 503 and "no such thing" in (await ready.json())["reason"]
    meta = await (await toy_client.get("/v2/models/broken")).json()
    assert meta["state"] == "FAILED" and "no such thing" in meta["reason"]
    assert (await toy_client.get("/v2/health/ready")).status == 503
    status, reply = await infer(toy_client, "broken", [{"x": np.zeros((1, 4), np.float32)}])
    assert status == 503 and "model 'broken' is not ready (FAILED)" in reply["error"]
    status, reply = await infer(toy_client, "echo", [{"x": np.ones((2, 4), np.float32)}])
    assert status == 200 and from_wire(reply["outputs"][0]["y"]).tolist() == [[2.0] * 4] * 2


async def test_a_model_that_raises_fails_only_its_batch(toy_client: Any) -> None:
    poison = {"x": np.full((3, 4), 13, np.float32)}
    status, reply = await infer(toy_client, "echo", [poison])
    assert status == 500 and reply["code"] == "model_failure"
    assert "RuntimeError: poison value 13 in batch" in reply["error"]
    goods = [{"x": np.full((n, 4), n, np.float32)} for n in range(1, 6)]
    replies = await asyncio.gather(*(infer(toy_client, "echo", [g]) for g in goods))
    for g, (status, reply) in zip(goods, replies):
        assert status == 200
        np.testing.assert_array_equal(from_wire(reply["outputs"][0]["y"]), g["x"] * 2)
    stats = await (await toy_client.get("/v2/models/echo/stats")).json()
    assert stats["batching"]["failed_items"] == 1


async def test_fixed_axis_mismatch_is_a_400(toy_client: Any) -> None:
    status, reply = await infer(toy_client, "echo", [{"x": np.ones((2, 5), np.float32)}])
    assert status == 400
    assert reply["error"] == "item 0, feature 'x': axis 1 has size 5, expected 4 (shape [-1, 4])"
