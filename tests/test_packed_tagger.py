"""examples/model_repository/packed_tagger (issue #54): the bundled tagger's
weights on packed batches. Each item's logits equal the padded tagger's for
the same item within 1e-5 (float32, CPU), with attention on a nested jagged
tensor and item by item, and served: rows cut from a packed batch equal the
rows the padded tagger serves."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tensorserve import ServedModel

ROOT = Path(__file__).resolve().parent.parent
TAGGER = ROOT / "model_repository" / "tagger"
EXAMPLES = ROOT / "examples" / "model_repository"
PACKED = EXAMPLES / "packed_tagger"
LENGTHS = [5, 17, 1, 64, 3, 128]
ATOL = 1e-5


def _model(folder: Path, **parameters: object) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location(f"_m_{uuid.uuid4().hex}", folder / "1/model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Model(**parameters)
    model.load_state_dict(load_file(str(folder / "1/model.safetensors")), strict=True)
    return model.eval()


def _items() -> list[np.ndarray]:
    rng = np.random.default_rng(54)
    return [rng.integers(1, 4096, n) for n in LENGTHS]


def test_the_packed_tagger_carries_the_taggers_weights() -> None:
    assert (PACKED / "1/model.safetensors").read_bytes() == (TAGGER / "1/model.safetensors").read_bytes()


@pytest.mark.parametrize("attention", ["nested", "segments"])
def test_each_items_logits_equal_the_padded_taggers(attention: str) -> None:
    padded, packed = _model(TAGGER), _model(PACKED, attention=attention)
    items = [torch.from_numpy(a) for a in _items()]
    ids = torch.zeros(len(items), max(LENGTHS), dtype=torch.int64)
    for row, one in zip(ids, items):
        row[: len(one)] = one
    cu = torch.tensor([0, *np.cumsum(LENGTHS)])
    with torch.inference_mode():
        reference = padded(ids, (ids != 0).long())
        logits = packed(torch.cat(items), cu, torch.zeros(max(LENGTHS), dtype=torch.int32))
    assert logits.shape == (sum(LENGTHS), 9)
    for i, length in enumerate(LENGTHS):
        torch.testing.assert_close(
            logits[cu[i] : cu[i + 1]], reference[i, :length], atol=ATOL, rtol=ATOL
        )


def test_served_rows_equal_the_padded_taggers_rows() -> None:
    items = _items()
    options = {"isolation": "thread", "device": "cpu", "warmup": {"enabled": False}}
    with (
        ServedModel.from_repository(EXAMPLES, "packed_tagger", **options) as packed,
        ServedModel.from_repository(ROOT / "model_repository", "tagger", **options) as padded,
    ):
        rows = packed.infer_many_sync([{"input_ids": a} for a in items], timeout=60)
        expected = padded.infer_many_sync(
            [{"input_ids": a, "attention_mask": np.ones_like(a)} for a in items], timeout=60
        )
        assert packed.stats.snapshot(0)["padding_efficiency"] == 1.0
    for row, reference, one in zip(rows, expected, items):
        assert row["logits"].shape == (len(one), 9)
        np.testing.assert_allclose(row["logits"], reference["logits"], atol=ATOL, rtol=ATOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_nested_attention_serves_the_padded_taggers_rows() -> None:
    """The path a GPU takes (attention = "auto": a nested jagged tensor with
    SDPA), served, against the padded tagger on the same GPU."""
    items = _items()
    options = {"isolation": "thread", "device": "cuda", "warmup": {"enabled": False}}
    with (
        ServedModel.from_repository(EXAMPLES, "packed_tagger", **options) as packed,
        ServedModel.from_repository(ROOT / "model_repository", "tagger", **options) as padded,
    ):
        rows = packed.infer_many_sync([{"input_ids": a} for a in items], timeout=120)
        expected = padded.infer_many_sync(
            [{"input_ids": a, "attention_mask": np.ones_like(a)} for a in items], timeout=120
        )
    for row, reference in zip(rows, expected):
        np.testing.assert_allclose(row["logits"], reference["logits"], atol=1e-3, rtol=1e-3)
