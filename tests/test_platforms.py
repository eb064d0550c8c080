"""Models without a model.py (docs/model-repository.md, "Model files"): an ONNX
graph run by ONNX Runtime, a TorchScript file and a torch.export program,
served from a repository by a real server, batched, padded and un-padded as
any model; a bad file or a signature that does not match config.toml fails
that model with a sentence, never the server."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import torch
from tensorserve_bench.server import ServerProcess

from tensorserve.errors import ConfigError
from tensorserve.repository.config import parse_config
from tensorserve.repository.loader import discover, load_model, read_config
from tests.helpers import MSGPACK, body, from_wire, toy_config, wait_until, write_model

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

PAD = 1000.0  # x's pad value: a leak into the masked sum is off by thousands
MASKED_SUM = {
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_ms": 20.0},
    "inputs": {"x": {"dtype": "float32", "shape": [-1], "pad_value": PAD},
               "mask": {"dtype": "int64", "shape": [-1], "pad_value": 0}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1], "unpad_like": "x"},
                "total": {"dtype": "float32", "shape": [1]}},
}  # fmt: skip


def masked_sum_onnx(path: Path, tokens: int | str = "tokens",
                    x_type: int = TensorProto.FLOAT) -> None:
    """y = 2x per position; total = the sum of x where mask is 1."""
    x = helper.make_tensor_value_info("x", x_type, ["batch", tokens])
    mask = helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", tokens])
    y = helper.make_tensor_value_info("y", x_type, ["batch", tokens])
    total = helper.make_tensor_value_info("total", x_type, ["batch", 1])

    def const(name: str, kind: int, values: list[Any], dims: list[int]) -> Any:
        return helper.make_node("Constant", [], [name],
                                value=helper.make_tensor(name, kind, dims, values))

    nodes = [
        const("two", x_type, [2.0], []), const("zero", x_type, [0.0], []),
        const("axes", TensorProto.INT64, [1], [1]),
        helper.make_node("Mul", ["x", "two"], ["y"]),
        helper.make_node("Cast", ["mask"], ["keep"], to=TensorProto.BOOL),
        helper.make_node("Where", ["keep", "x", "zero"], ["kept"]),
        helper.make_node("ReduceSum", ["kept", "axes"], ["total"], keepdims=1),
    ]  # fmt: skip
    graph = helper.make_graph(nodes, "masked_sum", [x, mask], [y, total])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


class MaskedSum(torch.nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = torch.where(mask != 0, x, torch.zeros_like(x))
        return x * 2, kept.sum(1, keepdim=True)


def torchscript(path: Path) -> None:
    torch.jit.save(torch.jit.script(MaskedSum()), str(path))


def exported(path: Path) -> None:
    x, mask = torch.ones(2, 5), torch.ones(2, 5, dtype=torch.int64)
    batch, tokens = torch.export.Dim("batch", max=64), torch.export.Dim("tokens", max=4096)
    dims = {"x": {0: batch, 1: tokens}, "mask": {0: batch, 1: tokens}}
    torch.export.save(torch.export.export(MaskedSum(), (x, mask), dynamic_shapes=dims), str(path))


def model_folder(repo: Path, name: str, filename: str, write: Any, **config: Any) -> None:
    folder = repo / name / "1"
    folder.mkdir(parents=True)
    (repo / name / "config.toml").write_text(toy_config(**{**MASKED_SUM, **config}))
    write(folder / filename)


def items(lengths: list[int], rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    return [{"x": rng.normal(size=n).astype(np.float32), "mask": np.ones(n, dtype=np.int64)}
            for n in lengths]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    repo = tmp_path_factory.mktemp("platforms")
    onnx_config = {"platform": "onnxruntime_onnx", "onnxruntime": {"intra_op_threads": 1}}
    model_folder(repo, "onnx_sum", "model.onnx", masked_sum_onnx, **onnx_config,
                 isolation="process", faults={"standby_worker": False})
    model_folder(repo, "script_sum", "model.pt", torchscript, platform="pytorch_libtorch")
    model_folder(repo, "export_sum", "model.pt2", exported, platform="pytorch_libtorch")
    model_folder(repo, "not_onnx", "model.onnx", lambda p: p.write_bytes(b"not a graph"),
                 **onnx_config)
    model_folder(repo, "fixed_axis", "model.onnx", lambda p: masked_sum_onnx(p, tokens=8),
                 **onnx_config)
    model_folder(repo, "one_output", "model.pt", torchscript, platform="pytorch_libtorch",
                 outputs={"y": MASKED_SUM["outputs"]["y"]})
    server = ServerProcess(str(repo))
    server.ready_url = f"{server.url}/v2/health/live"  # failed models keep it not ready
    server.start()
    wait_until(lambda: all(m.get("state") != "LOADING" for m in
                           httpx.get(f"{server.url}/v2/models").json()["models"]),
               "every model loaded or failed", timeout=120)
    yield server.url
    server.stop()


def infer(url: str, model: str, batch: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    reply = httpx.post(f"{url}/v2/models/{model}/infer", content=body(batch), headers=MSGPACK,
                       timeout=60)
    assert reply.status_code == 200, reply.content[:300]
    decoded = msgpack.unpackb(reply.content)
    return [{name: from_wire(t) for name, t in row.items()} for row in decoded["outputs"]]


@pytest.mark.parametrize("model", ["onnx_sum", "script_sum", "export_sum"])
def test_co_batched_callers_get_their_own_unpadded_rows(served: str, model: str) -> None:
    rng = np.random.default_rng(7)
    lengths = [3, 11, 1, 7, 16]
    batch = items(lengths, rng)
    batch[1]["mask"][8:] = 0  # a caller's own masked positions are left out of its sum too
    together = infer(served, model, batch)  # one request: its items are padded into one batch
    for item, row in zip(batch, together):
        assert row["y"].shape == item["x"].shape  # un-padded to the caller's own length
        np.testing.assert_allclose(row["y"], 2 * item["x"], rtol=1e-6)
        expected = item["x"][item["mask"] == 1].sum()
        np.testing.assert_allclose(row["total"], [expected], rtol=1e-5, atol=1e-5)  # no PAD
    alone = [infer(served, model, [item])[0] for item in batch]
    for row, single in zip(together, alone):
        np.testing.assert_array_equal(row["y"], single["y"])
        np.testing.assert_allclose(row["total"], single["total"], rtol=1e-6)
    with ThreadPoolExecutor(4) as pool:  # separate callers, batched by the server
        rows = list(pool.map(lambda item: infer(served, model, [item])[0], batch * 2))
    for item, row in zip(batch * 2, rows):
        np.testing.assert_allclose(row["y"], 2 * item["x"], rtol=1e-6)


def test_bad_files_and_mismatches_fail_their_model_only(served: str) -> None:
    models = {m["name"]: m for m in httpx.get(f"{served}/v2/models").json()["models"]}
    reasons = {name: m.get("reason", "") for name, m in models.items()}
    assert models["onnx_sum"]["state"] == "READY"
    assert reasons["not_onnx"].startswith("not_onnx/1/model.onnx: ONNX Runtime cannot load it")
    assert reasons["fixed_axis"] == (
        "fixed_axis/1/model.onnx: input 'x': axis 1 is fixed at 8 in the graph but variable "
        "(-1) in config.toml; export it as a dynamic axis"
    )
    assert reasons["one_output"] == (
        "one_output/1/model.pt: forward(x, mask) returns 2 tensor(s); config.toml declares "
        "1 output(s) (a tuple maps to them by position)"
    )
    metadata = httpx.get(f"{served}/v2/models/onnx_sum").json()
    assert metadata["platform"] == "onnxruntime_onnx"


def _load(tmp_path: Path, filename: str, write: Any, **config: Any) -> Any:
    model_folder(tmp_path, "m", filename, write, **config)
    source = discover(tmp_path)["m"]
    return load_model(source, None, read_config(source), intra_op_threads=1)


@pytest.mark.parametrize(("filename", "write", "config", "reason"), [
    ("model.onnx", lambda p: masked_sum_onnx(p, x_type=TensorProto.DOUBLE), {},
     "m/1/model.onnx: input 'x' is float64 in the graph, float32 in config.toml"),
    ("model.onnx", masked_sum_onnx, {"inputs": {"x": MASKED_SUM["inputs"]["x"]}},
     "m/1/model.onnx: the graph's input(s) mask are not declared in config.toml"),
    ("model.onnx", masked_sum_onnx,
     {"outputs": {**MASKED_SUM["outputs"], "total": {"dtype": "float32", "shape": [2]}}},
     "m/1/model.onnx: output 'total': axis 1 is 1 in the graph, 2 in config.toml"),
    ("model.pt", torchscript,
     {"inputs": {"x": MASKED_SUM["inputs"]["x"], "attention": MASKED_SUM["inputs"]["mask"]}},
     "m/1/model.pt: input(s) attention of config.toml are not arguments of forward(x, mask)"),
    ("model.pt", lambda p: p.write_bytes(b"PK not a zip"), {},
     "m/1/model.pt: not a TorchScript file torch.jit.load can read"),
    ("model.pt2", exported,
     {"inputs": {**MASKED_SUM["inputs"], "mask": {"dtype": "int32", "shape": [-1]}}},
     "m/1/model.pt2: input 'mask' is int64 in the program, int32 in config.toml"),
])  # fmt: skip
def test_a_file_that_does_not_match_its_config_is_refused_with_a_sentence(
    tmp_path: Path, filename: str, write: Any, config: dict[str, Any], reason: str
) -> None:
    platform = "onnxruntime_onnx" if filename.endswith(".onnx") else "pytorch_libtorch"
    with pytest.raises(ConfigError) as raised:
        _load(tmp_path, filename, write, platform=platform, **config)
    assert str(raised.value).startswith(reason), str(raised.value)


def test_without_onnxruntime_the_model_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime fails
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, "model.onnx", masked_sum_onnx, platform="onnxruntime_onnx")
    assert str(error.value) == (
        "m/1/model.onnx: platform 'onnxruntime_onnx' needs onnxruntime: pip install onnxruntime "
        "(or onnxruntime-gpu on a CUDA machine)"
    )


def test_a_missing_model_file_names_the_file_the_platform_needs(tmp_path: Path) -> None:
    write_model(tmp_path, "m", toy_config(**MASKED_SUM, platform="pytorch_libtorch"), "")
    (tmp_path / "m" / "1" / "model.py").unlink()
    source = discover(tmp_path)["m"]
    with pytest.raises(ConfigError, match=r"m/1/model.pt or model.pt2: file not found"):
        load_model(source, None, read_config(source))


@pytest.mark.parametrize(("fields", "reason"), [
    ({"platform": "onnxruntime_onnx", "compile": "default"},
     "compile needs a model.py, not platform = 'onnxruntime_onnx'"),
    ({"onnxruntime": {"intra_op_threads": 2}}, "[onnxruntime] is for platform = 'onnxruntime_onnx'"),
    ({"platform": "tensorflow_savedmodel"}, "platform: Input should be"),
])  # fmt: skip
def test_what_a_platform_cannot_do_is_a_config_error(fields: dict[str, Any], reason: str) -> None:
    data = {"input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
            "output": [{"name": "y", "dtype": "float32", "shape": [-1]}], **fields}
    with pytest.raises(ConfigError) as raised:
        parse_config(data, "m/config.toml")
    assert reason in str(raised.value)


@pytest.mark.timeout(240)
def test_the_examples_repository_serves_tagger_onnx_with_the_onnx_extra() -> None:
    """examples/model_repository (the docs serve it with the onnx extra): the
    bundled tagger exported to ONNX, READY, answering as the tagger does; and
    packed_tagger, the tagger's weights on packed batches, answering the same."""
    examples = Path(__file__).resolve().parent.parent / "examples" / "model_repository"
    server = ServerProcess(str(examples)).start()  # ready: every model of it loaded
    try:
        models = httpx.get(f"{server.url}/v2/models").json()["models"]
        states = {m["name"]: m["state"] for m in models}
        assert states == {"packed_tagger": "READY", "tagger_onnx": "READY"}
        rng = np.random.default_rng(3)
        batch = [{"input_ids": rng.integers(1, 4096, n, dtype=np.int64),
                  "attention_mask": np.ones(n, np.int64)} for n in (5, 17, 2)]
        rows = infer(server.url, "tagger_onnx", batch)
        assert [row["logits"].shape for row in rows] == [(5, 9), (17, 9), (2, 9)]
        alone = infer(server.url, "tagger_onnx", batch[2:])[0]
        np.testing.assert_allclose(rows[2]["logits"], alone["logits"], rtol=1e-4, atol=1e-4)
        packed = infer(server.url, "packed_tagger", [{"input_ids": b["input_ids"]} for b in batch])
        for row, expected in zip(packed, rows):
            np.testing.assert_allclose(row["logits"], expected["logits"], rtol=1e-4, atol=1e-4)
    finally:
        server.stop()
