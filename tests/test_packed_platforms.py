"""Packed batches (issue #54) for model files: a TorchScript program, a
torch.export program and an ONNX graph take the packed input and the batch
input as arguments like a model.py does, and each caller gets its own rows.

Each model returns ``x * 2 + (its item's end in the batch)``, the end read
from the batch input ``ends`` (BATCH_ACCUMULATED_ELEMENT_COUNT) by each
token, so a wrong offset or another caller's row shows at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, save

from tensorserve import ServedModel
from tests.helpers import toy_config

FULL_BATCHES = {"dispatch": "timer", "max_queue_delay_ms": 30_000.0, "policy": "fifo"}
CONFIG: dict[str, Any] = {
    "max_batch_size": 3,
    "warmup": {"enabled": False},
    "dynamic_batching": FULL_BATCHES,
    "inputs": {"x": {"dtype": "float32", "shape": [-1], "allow_ragged_batch": True}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1]}},
}
BATCH_INPUT = """
[[batch_input]]
kind = "BATCH_ACCUMULATED_ELEMENT_COUNT"
target_name = "ends"
data_type = "int64"
source_input = ["x"]
"""


class PlusEnds(torch.nn.Module):
    def forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        # Each token's item: how many ends lie at or before it.
        owner = torch.bucketize(torch.arange(x.shape[0]), ends, right=True)
        return x * 2 + ends[owner].to(x.dtype)


def torchscript(path: Path) -> None:
    torch.jit.save(torch.jit.script(PlusEnds()), str(path))


def exported(path: Path) -> None:
    x, ends = torch.ones(5), torch.tensor([2, 5])
    dims = {"x": {0: torch.export.Dim("tokens", max=4096)}, "ends": {0: torch.export.Dim("b")}}
    torch.export.save(torch.export.export(PlusEnds(), (x, ends), dynamic_shapes=dims), str(path))


def onnx_graph(path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens"])
    ends = helper.make_tensor_value_info("ends", TensorProto.INT64, ["batch"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens"])

    def const(name: str, values: list[Any]) -> Any:
        tensor = helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
        return helper.make_node("Constant", [], [name], value=tensor)

    nodes = [  # owner[t] = the number of ends <= t; y = 2x + ends[owner]
        const("zero", [0]), const("one", [1]), const("minus_one", [-1]), const("start", [0]),
        helper.make_node("Shape", ["x"], ["count"]),
        helper.make_node("Squeeze", ["count", "zero"], ["count_scalar"]),
        helper.make_node("Squeeze", ["start", "zero"], ["start_scalar"]),
        helper.make_node("Squeeze", ["one", "zero"], ["step_scalar"]),
        helper.make_node("Range", ["start_scalar", "count_scalar", "step_scalar"], ["t"]),
        helper.make_node("Unsqueeze", ["t", "minus_one"], ["column"]),
        helper.make_node("LessOrEqual", ["ends", "column"], ["passed"]),
        helper.make_node("Cast", ["passed"], ["passed_int"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["passed_int", "one"], ["owner"], keepdims=0),
        helper.make_node("Gather", ["ends", "owner"], ["end"]),
        helper.make_node("Cast", ["end"], ["end_float"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "x"], ["twice"]),
        helper.make_node("Add", ["twice", "end_float"], ["y"]),
    ]  # fmt: skip
    graph = helper.make_graph(nodes, "plus_ends", [x, ends], [y])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize(
    ("filename", "write", "platform"),
    [
        ("model.pt", torchscript, "pytorch_libtorch"),
        ("model.pt2", exported, "pytorch_libtorch"),
        ("model.onnx", onnx_graph, "onnxruntime_onnx"),
    ],
)
def test_a_packed_model_file_gives_each_caller_its_rows(
    tmp_path: Path, filename: str, write: Any, platform: str
) -> None:
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "config.toml").write_text(toy_config(**CONFIG, platform=platform) + BATCH_INPUT)
    write(folder / "1" / filename)
    lengths = [3, 1, 4]
    items = [{"x": np.arange(n, dtype=np.float32) + 10 * i} for i, n in enumerate(lengths)]
    with ServedModel.from_repository(tmp_path, "m") as model:
        futures = [model.submit_many([item])[0] for item in items]  # one batch of three
        rows = [future.result(60)["y"] for future in futures]
    for row, item, end in zip(rows, items, np.cumsum(lengths)):
        np.testing.assert_array_equal(row, item["x"] * 2 + end)
